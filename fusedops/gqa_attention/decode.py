"""GQA attention: the KV-cache decode plan and its eager wrapper (the math: ``contract``)."""

from __future__ import annotations

import functools

import torch

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.dtypes import accumulator_dtype
from ..core.index_checks import check_each_at_most
from ..core.options import Option, expect_bool, expect_int, optional
from ..core.target import multiprocessors
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, indices, inputs, outputs, status_word, updated
from .checks import expect_head_bytes, has_status, host_values, paged_table
from .contract import (DTYPES, FP8, MAX_HEAD_DIM, DecodeAttentionProblem, decode_context,
                       decode_floor, default_num_splits, resolve_scale, softcap, softmax_scale,
                       window_size)

DECODE_OPTIONS = (Option("softmax_scale", softmax_scale, None),
                  Option("num_splits", optional(functools.partial(expect_int, minimum=1)), None),
                  Option("causal", expect_bool, True),
                  Option("window_size", window_size, (-1, -1)),
                  Option("softcap", softcap, 0.0),
                  Option("rotary_interleaved", expect_bool, False))


class GQAAttentionDecode(Plan):
    """Decode step with a KV cache: append the new tokens' k, v in place at cache_seqlens (or
    append nothing), then attend the queries to the cache, split-KV.

    Args (tensors or TensorDescs):
        q: [b, T, h_q, d] bf16/fp16/fp32 (float64: torch backend), T >= 1 queries per row, d <= 256
            with d·element size a multiple of 16 bytes.
        k_new, v_new: [b, N, h_kv, d], q's dtype, N >= 1 tokens to append (usually N = T); both
            None: attend only (nothing appended, flash_attn_with_kvcache without k, v).
        k_cache, v_cache: contiguous [rows, capacity, h_kv, d] (rows = b, or any with
            cache_batch_idx), or paged [num_pages, page_size, h_kv, d] (page_size a multiple of 16)
            with block_table [b, max_pages] int32; q's dtype, or float8_e4m3fn (d a multiple of
            16) with k_scale, v_scale fp32 [1] (per tensor) or [h_kv] (per KV head): the cache
            holds value / scale, saturated to +-448. Read and written in place.
        cache_seqlens: [b] int32 on the device: keys already in each row's cache. The new tokens
            go to positions cache_seqlens .. cache_seqlens + N - 1; cache_seqlens itself is not
            advanced (the caller does, as with flash_attn_with_kvcache).
        cache_batch_idx: optional [b] int32: row i uses cache row cache_batch_idx[i] (contiguous
            caches); a negative entry is a padding row (nothing read or written, o = 0).
        cache_leftpad: optional [b] int32: row i's keys start at cache position cache_leftpad[i].
        rotary_cos, rotary_sin: optional [seqlen_ro, r / 2] (q's dtype or fp32, seqlen_ro >= the
            capacity, r <= d): rotate the appended k and q on their first r features in the append
            kernel (``rotary_interleaved``: pairs (x0, x1), ...; else halves); needs k_new, v_new.
        causal (default True), window_size=(left, right): bottom-right aligned masks as in
            training (offset = cache_seqlens + N - T); softcap: as in training.
        softmax_scale: a finite float > 0 (default 1/sqrt(d)).
        num_splits: the fixed number of key ranges (flash-decoding), an int >= 1; default from
            the SM count (the device's; on the CPU the target family's part) and b·h_kv·capacity
            (``contract.default_num_splits``): the fewest of 1 to min(32, capacity / 512) that
            fill the grid's waves to within 90% of the best count.
        status: an optional int32 [1] status word (pass it to execute too): the kernels OR
            Status.CACHE_SEQLENS / BLOCK_TABLE / SLOT_INDEX into it for invalid rows.

    q, k_new, v_new, o and the caches may be strided views (the last dimension contiguous, the
    other strides multiples of 16 bytes): slices of a fused QKV projection, or
    ``kv_cache[:, :, 0]`` of a [b, capacity, 2, h_kv, d] cache. A row is valid when 0 <=
    cache_seqlens[i] <= capacity - N, 0 <= cache_leftpad[i] <= cache_seqlens[i], (paged) every
    page it needs (j·page_size < cache_seqlens[i] + N) is in [0, num_pages), its cache row is
    below the cache's rows, no earlier row appends to the same cache row, and (rotary) its query
    positions are in the table; decided on the device before anything is written
    (docs/plans.md, "Index data"). An invalid row appends nothing and gets o = 0, lse = -inf;
    the other rows are unaffected.

    execute(q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse, block_table=,
    cache_batch_idx=, cache_leftpad=, k_scale=, v_scale=, rotary_cos=, rotary_sin=, workspace=,
    status=) updates k_cache, v_cache and writes o [b, T, h_q, d] (q's dtype) and lse [b, h_q, T]
    fp32 (contiguous); returns TupleDict(o, lse). Workspace (Triton): the splits' fp32 partial
    outputs and lse, each row's validity and (rotary) the rotated q. Nothing depends on
    host-side lengths, so a decode step can be captured in a CUDA Graph once and replayed as
    the cache grows. o, lse and the caches must not overlap each other or the inputs.
    """

    op_name = "gqa_attention_decode"
    backend_module = "gqa_attention.program"
    program_name = "decode"
    backends = ("torch", "triton")
    operands = (*inputs("q", strided=True), *inputs("k_new", "v_new", optional=True, strided=True),
                *updated("k_cache", "v_cache", strided=True), *indices("cache_seqlens"),
                *outputs("o", strided=True), *outputs("lse"),
                *indices("block_table", "cache_batch_idx", "cache_leftpad", optional=True),
                *inputs("k_scale", "v_scale", "rotary_cos", "rotary_sin", optional=True),
                *status_word())
    options = DECODE_OPTIONS
    returns = ("o", "lse")

    def __init__(self, q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                 cache_batch_idx=None, cache_leftpad=None, softmax_scale=None, k_scale=None,
                 v_scale=None, rotary_cos=None, rotary_sin=None, num_splits=None, causal=True,
                 window_size=(-1, -1), softcap=0.0, rotary_interleaved=False, status=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                              cache_seqlens=cache_seqlens, block_table=block_table,
                              cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                              k_scale=k_scale, v_scale=v_scale, rotary_cos=rotary_cos,
                              rotary_sin=rotary_sin, status=status),
                         dict(softmax_scale=softmax_scale, num_splits=num_splits, causal=causal,
                              window_size=window_size, softcap=softcap,
                              rotary_interleaved=rotary_interleaved), backend)

    def _validate(self, descs, *, softmax_scale, num_splits, causal, window_size, softcap,
                  rotary_interleaved) -> DecodeAttentionProblem:
        q = descs["q"]
        expect_ndim("q", q, 4, "[b, T, h_q, d]")
        expect_dtype("q", q, DTYPES)
        b, T, hq, d = q.shape
        if min(b, T) < 1 or not 1 <= d <= MAX_HEAD_DIM:
            raise ValidationError(f"q: expected b, T >= 1 and d in [1, {MAX_HEAD_DIM}], got {list(q.shape)}")
        expect_head_bytes("q", q)
        kc, vc = descs["k_cache"], descs["v_cache"]
        expect_ndim("k_cache", kc, 4, "[b, capacity, h_kv, d] or [num_pages, page_size, h_kv, d]")
        expect_dtype("k_cache", kc, (q.dtype, FP8))
        expect_dtype("v_cache", vc, (kc.dtype,))
        expect_shape("v_cache", vc, kc.shape, "like k_cache")
        hkv = kc.shape[2]
        if hkv < 1 or hq % hkv:
            raise ValidationError(f"k_cache: expected h_kv >= 1 dividing h_q = {hq}, got {hkv}")
        if kc.shape[3] != d:
            raise ValidationError(
                f"k_cache: expected [..., h_kv, d] = [..., {hkv}, {d}], got {list(kc.shape)}")
        expect_head_bytes("k_cache", kc)
        new = self._validate_new(descs, b, hkv, d, q.dtype)
        if descs.get("block_table") is not None:
            if "cache_batch_idx" in descs:
                raise ValidationError("cache_batch_idx: expected None with a paged cache "
                                      "(block_table maps each row to its pages)")
            page_size, max_pages, _ = paged_table(descs, "k_cache", b, "b")
            capacity = page_size * max_pages
        else:
            if "cache_batch_idx" not in descs and kc.shape[0] != b:
                raise ValidationError(f"k_cache: expected [b, capacity, h_kv, d] with b = {b} (or pass "
                                      f"block_table for a paged cache, cache_batch_idx to pick "
                                      f"rows), got {list(kc.shape)}")
            capacity = kc.shape[1]
            page_size, max_pages = capacity, 1
        for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad"):
            if name in descs:
                expect_dtype(name, descs[name], (torch.int32,))
                expect_shape(name, descs[name], (b,), "[b]")
        per_head = self._validate_scales(descs, kc.dtype, hkv)
        rotary = self._validate_rotary(descs, q.dtype, d, capacity, new)
        for name in ("cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad",
                     "k_scale", "v_scale", "rotary_cos", "rotary_sin"):
            if name in descs:
                expect_contiguous(name, descs[name])
        self._plan_tensor("o", (b, T, hq, d), q.dtype)
        self._plan_tensor("lse", (b, hq, T), accumulator_dtype(q.dtype))
        return DecodeAttentionProblem(
            q.dtype, kc.dtype, b, T, hq, hkv, d, "block_table" in descs, page_size, max_pages,
            capacity, resolve_scale(softmax_scale, d), per_head,
            (default_num_splits(capacity, b * hkv, multiprocessors(self.device))
             if num_splits is None else num_splits), self.device,
            kc.shape[0], has_status(descs), new, causal, window_size, softcap,
            "cache_batch_idx" in descs, "cache_leftpad" in descs, rotary[0], rotary_interleaved,
            rotary[1], descs["rotary_cos"].dtype if rotary[0] else None)

    @staticmethod
    def _validate_new(descs, b: int, hkv: int, d: int, dtype) -> int:
        """k_new, v_new: both [b, N, h_kv, d] in q's dtype, or both absent; returns N (0: none)."""
        kn, vn = descs.get("k_new"), descs.get("v_new")
        if (kn is None) != (vn is None):
            raise ValidationError("k_new, v_new: expected both (tokens to append) or neither "
                                  "(attend only), got one")
        if kn is None:
            return 0
        expect_ndim("k_new", kn, 4, "[b, N, h_kv, d]")
        n = kn.shape[1]
        for name, desc in (("k_new", kn), ("v_new", vn)):
            expect_dtype(name, desc, (dtype,))
            expect_shape(name, desc, (b, n, hkv, d), "[b, N, h_kv, d] (h_kv, d of the cache)")
        if n < 1:
            raise ValidationError(f"k_new: expected N >= 1 new tokens, got {list(kn.shape)}")
        return n

    @staticmethod
    def _validate_rotary(descs, dtype, d: int, capacity: int, new: int) -> tuple[int, int]:
        """rotary_cos, rotary_sin: both [seqlen_ro, r / 2] (q's dtype or fp32, seqlen_ro >= the
        capacity, r <= d) with k_new, v_new, or both absent; returns (r, seqlen_ro)."""
        cos, sin = descs.get("rotary_cos"), descs.get("rotary_sin")
        if (cos is None) != (sin is None):
            raise ValidationError("rotary_cos, rotary_sin: expected both or neither, got one")
        if cos is None:
            return 0, 0
        if not new:
            raise ValidationError("rotary_cos: expected k_new, v_new with rotary (it rotates q "
                                  "and the appended k), got none")
        expect_ndim("rotary_cos", cos, 2, "[seqlen_ro, rotary_dim / 2]")
        expect_dtype("rotary_cos", cos, tuple(dict.fromkeys((dtype, torch.float32))))
        expect_dtype("rotary_sin", sin, (cos.dtype,))
        expect_shape("rotary_sin", sin, cos.shape, "like rotary_cos")
        length, half = cos.shape
        if not 1 <= 2 * half <= d:
            raise ValidationError(f"rotary_cos: expected rotary_dim / 2 in [1, d / 2 = {d // 2}], "
                                  f"got {list(cos.shape)}")
        if length < capacity:
            raise ValidationError(f"rotary_cos: expected at least the {capacity} positions of the "
                                  f"cache, got {list(cos.shape)}")
        return 2 * half, length

    def floor(self):
        """The cache read once at the fullest valid context (cache_seqlens = capacity - N: it
        is runtime data), the new tokens, o and lse written once: ``contract.decode_floor``."""
        return decode_floor(self.problem)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Every row at the context the cost models take (capacity - N), a block table giving
        each row its own pages (wrapping around a smaller pool), each row its own cache row,
        no left padding, unit FP8 scales."""
        p, dev = self.problem, self.device
        out = dict(cache_seqlens=torch.full((p.batch,), decode_context(p), dtype=torch.int32,
                                            device=dev))
        if p.paged:
            table = torch.arange(p.batch * p.max_pages, dtype=torch.int64, device=dev) % p.pages
            out["block_table"] = table.view(p.batch, p.max_pages).to(torch.int32)
        if p.batch_idx:
            out["cache_batch_idx"] = (torch.arange(p.batch, device=dev) % p.pages).to(torch.int32)
        if p.leftpad:
            out["cache_leftpad"] = torch.zeros(p.batch, dtype=torch.int32, device=dev)
        if p.cache_dtype == FP8:
            shape = self.desc("k_scale").shape
            out.update(k_scale=torch.ones(shape, device=dev), v_scale=torch.ones(shape, device=dev))
        return out

    def _check_index_values(self, tensors) -> None:
        """cache_seqlens in [0, capacity - N] (and, rotary, room for the query positions);
        cache_leftpad in [0, cache_seqlens]; cache_batch_idx below the cache's rows (negative:
        padding) and, appending, no two rows on one cache row; then (paged) every page a row
        needs (j·page_size < cache_seqlens + N) in [0, num_pages)."""
        p = self.problem
        lengths = tensors.get("cache_seqlens")
        if lengths is None:
            return
        room = p.capacity - p.appended
        what = f"room for {p.appended} new tokens in a capacity of {p.capacity}"
        if p.paged:
            what += f": block_table's {p.max_pages} pages of {p.page_size}"
        if p.rotary_dim:
            room = min(room, p.rotary_len - p.rotary_queries)
            what += f", and the query positions in rotary_cos's {p.rotary_len}"
        check_each_at_most("cache_seqlens", lengths, [room] * p.batch, what)
        values = host_values(lengths)
        if tensors.get("cache_leftpad") is not None:
            check_each_at_most("cache_leftpad", tensors["cache_leftpad"], values,
                               "at most the row's cache_seqlens")
        if tensors.get("cache_batch_idx") is not None:
            seen = {}
            for i, row in enumerate(host_values(tensors["cache_batch_idx"])):
                if row >= p.pages or (p.appended and row in seen):
                    why = (f"below the cache's {p.pages} rows" if row >= p.pages else
                           f"distinct rows when appending (row {seen[row]} has it too)")
                    raise ValidationError(f"cache_batch_idx: expected entries {why}, got "
                                          f"cache_batch_idx[{i}] = {row}")
                if row >= 0:
                    seen[row] = i
        table = tensors.get("block_table")
        if not p.paged or table is None:
            return
        rows = table.detach().to("cpu", torch.int64).tolist()
        for i, length in enumerate(values):
            for j in range(min(p.max_pages, -(-(length + p.appended) // p.page_size))):
                if not 0 <= rows[i][j] < p.pages:
                    raise ValidationError(f"block_table: expected entries in [0, {p.pages}), got "
                                          f"block_table[{i}, {j}] = {rows[i][j]}")

    @staticmethod
    def _validate_scales(descs, cache_dtype, hkv: int) -> bool:
        """Checks k_scale, v_scale against the cache dtype; returns whether they are per KV head."""
        if cache_dtype != FP8:
            if "k_scale" in descs or "v_scale" in descs:
                raise ValidationError("k_scale, v_scale: only for a float8_e4m3fn cache")
            return False
        for name in ("k_scale", "v_scale"):
            if name not in descs:
                raise ValidationError(
                    f"{name}: expected an fp32 tensor [1] or [h_kv] with an FP8 cache, got None")
            expect_dtype(name, descs[name], (torch.float32,))
            if tuple(descs[name].shape) not in ((1,), (hkv,)):
                raise ValidationError(f"{name}: expected shape [1] or [h_kv] = [{hkv}], got "
                                      f"{list(descs[name].shape)}")
        if descs["v_scale"].shape != descs["k_scale"].shape:
            raise ValidationError("v_scale: expected the shape of k_scale")
        return descs["k_scale"].shape == (hkv,) and hkv > 1

    def execute(self, q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse, *, block_table=None,
                cache_batch_idx=None, cache_leftpad=None, k_scale=None, v_scale=None,
                rotary_cos=None, rotary_sin=None, workspace=None, status=None,
                current_stream=None) -> TupleDict:
        """Appends to the caches and writes ``o`` and ``lse``; returns TupleDict(o, lse)."""
        return self._execute(dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                                  cache_seqlens=cache_seqlens, o=o, lse=lse, block_table=block_table,
                                  cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                  k_scale=k_scale, v_scale=v_scale, rotary_cos=rotary_cos,
                                  rotary_sin=rotary_sin, workspace=workspace, status=status,
                                  current_stream=current_stream))


def gqa_attention_decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                         cache_batch_idx=None, cache_leftpad=None, softmax_scale=None,
                         k_scale=None, v_scale=None, rotary_cos=None, rotary_sin=None,
                         num_splits=None, causal=True, window_size=(-1, -1), softcap=0.0,
                         rotary_interleaved=False, status=None, check_inputs: bool | None = None,
                         backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager decode step (see GQAAttentionDecode): updates k_cache, v_cache in place, allocates
    o, lse and the workspace; returns TupleDict(o, lse). ``check_inputs=True`` (or
    FUSEDOPS_CHECK_INPUTS=1) first checks the index data on the host (a synchronisation);
    ``status``: the optional status word the kernels report into."""
    return GQAAttentionDecode.eager(
        dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
             cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
             cache_leftpad=cache_leftpad, k_scale=k_scale, v_scale=v_scale, rotary_cos=rotary_cos,
             rotary_sin=rotary_sin, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs,
        softmax_scale=softmax_scale, num_splits=num_splits, causal=causal,
        window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved)
