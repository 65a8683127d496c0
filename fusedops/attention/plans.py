"""GQA attention: training forward/backward and KV-cache decode plans, and their eager wrappers
(the math and the masks: ``contract``)."""

from __future__ import annotations

import functools

import torch

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.dtypes import accumulator_dtype
from ..core.index_checks import check_cu_seqlens, check_each_at_most
from ..core.options import Option, expect_bool, expect_int, optional
from ..core.status import STATUS_DTYPE
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, indices, inputs, outputs, status_word, updated
from .contract import (DTYPES, FP8, MAX_HEAD_DIM, PAGE_MULTIPLE, AttentionProblem,
                       DecodeAttentionProblem, backward_floor, decode_context, decode_floor,
                       default_num_splits, forward_floor, resolve_scale, sequence_lengths,
                       softmax_scale, window_size)

_length = optional(functools.partial(expect_int, minimum=0))

TRAINING_OPTIONS = (Option("causal", expect_bool, False),
                    Option("softmax_scale", softmax_scale, None),
                    Option("window_size", window_size, (-1, -1)),
                    Option("max_seqlen_q", _length, None),
                    Option("max_seqlen_k", _length, None))


def _has_status(descs) -> bool:
    """Whether a status word is given (checked: int32 [1])."""
    status = descs.get("status")
    if status is None:
        return False
    expect_dtype("status", status, (STATUS_DTYPE,))
    expect_shape("status", status, (1,), "[1]")
    return True


def _host(t) -> list[int]:
    return t.detach().reshape(-1).to("cpu", torch.int64).tolist()


class _AttentionPlan(Plan):
    backend_module = "attention"
    backends = ("torch", "triton")
    options = TRAINING_OPTIONS

    def _validate_qkv(self, descs, *, causal, softmax_scale, window_size, max_seqlen_q,
                      max_seqlen_k) -> AttentionProblem:
        """Checks q, k, v (and cu_seqlens when packed) and returns the problem."""
        q, k, v = descs["q"], descs["k"], descs["v"]
        cq, ck = descs.get("cu_seqlens_q"), descs.get("cu_seqlens_k")
        packed = cq is not None or ck is not None
        layout = "[total, h, d]" if packed else "[b, s, h, d]"
        expect_ndim("q", q, 3 if packed else 4, layout)
        expect_dtype("q", q, DTYPES)
        for name, desc in (("k", k), ("v", v)):
            expect_ndim(name, desc, 3 if packed else 4, layout)
            expect_dtype(name, desc, (q.dtype,))
        hq, d = q.shape[-2], q.shape[-1]
        hkv = k.shape[-2]
        if hkv < 1 or hq % hkv:
            raise ValidationError(f"k: expected h_kv >= 1 dividing h_q = {hq}, got h_kv = {hkv}")
        if k.shape[-1] != d:
            raise ValidationError(f"k: expected head dim d = {d} like q, got {k.shape[-1]}")
        expect_shape("v", v, k.shape, "like k")
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValidationError(f"q: expected a head dim in [1, {MAX_HEAD_DIM}], got {d}")
        if packed:
            if cq is None or ck is None:
                raise ValidationError(
                    "cu_seqlens_q, cu_seqlens_k: expected both for packed sequences, got one")
            expect_dtype("cu_seqlens_q", cq, (torch.int32,))
            expect_ndim("cu_seqlens_q", cq, 1, "[nseq + 1]")
            expect_dtype("cu_seqlens_k", ck, (torch.int32,))
            expect_shape("cu_seqlens_k", ck, cq.shape, "[nseq + 1] like cu_seqlens_q")
            if cq.shape[0] < 2:
                raise ValidationError(
                    f"cu_seqlens_q: expected [nseq + 1] with nseq >= 1, got {list(cq.shape)}")
            for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
                if value is None:
                    raise ValidationError(f"{name}: expected an int >= 0 (the longest sequence) "
                                          f"with packed sequences, got None")
            total_q, total_k = q.shape[0], k.shape[0]
            # no sequence covers more than the packed tokens: a larger bound changes nothing
            batch, sq, sk = cq.shape[0] - 1, min(max_seqlen_q, total_q), min(max_seqlen_k, total_k)
        else:
            b, sq, _, _ = q.shape
            if k.shape[0] != b:
                raise ValidationError(f"k: expected batch {b} like q, got {k.shape[0]}")
            batch, sk = b, k.shape[1]
            total_q, total_k = b * sq, b * sk
        for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"):
            if name in descs:
                expect_contiguous(name, descs[name])
        return AttentionProblem(q.dtype, batch, sq, sk, hq, hkv, d, causal, window_size,
                                resolve_scale(softmax_scale, d), packed, total_q, total_k,
                                self.device, _has_status(descs))

    def _check_index_values(self, tensors) -> None:
        """cu_seqlens_q/k (packed): starting at 0, non-decreasing, within the packed tokens, and
        no sequence longer than max_seqlen_q/k."""
        p = self.problem
        if not p.packed:
            return
        for name, total, option in (("cu_seqlens_q", p.total_q, "max_seqlen_q"),
                                    ("cu_seqlens_k", p.total_k, "max_seqlen_k")):
            longest = getattr(self, option)
            cu = tensors.get(name)
            if cu is None:
                continue
            check_cu_seqlens(name, cu, total)
            values = _host(cu)
            for i in range(len(values) - 1):
                if values[i + 1] - values[i] > longest:
                    raise ValidationError(
                        f"{name}: expected sequences of at most {option} = {longest} tokens, got "
                        f"{name}[{i + 1}] - {name}[{i}] = {values[i + 1] - values[i]}")

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Packed: valid offsets of the sequences the cost models count (the longest the plan
        allows, as many as the tokens fill: ``contract.sequence_lengths``)."""
        p = self.problem
        if not p.packed:
            return {}
        lengths = sequence_lengths(p)
        out = {}
        for name, side in (("cu_seqlens_q", 0), ("cu_seqlens_k", 1)):
            offsets = [0]
            for pair in lengths:
                offsets.append(offsets[-1] + pair[side])
            out[name] = torch.tensor(offsets, dtype=torch.int32, device=self.device)
        return out

    def _lse_shape(self, problem: AttentionProblem) -> tuple[int, ...]:
        p = problem
        return (p.heads_q, p.total_q) if p.packed else (p.batch, p.heads_q, p.seqlen_q)


class GQAAttentionForward(_AttentionPlan):
    """Forward plan: o = softmax(scale·q kᵀ + mask) v per query head, and lse.

    Args (tensors or TensorDescs, contiguous): q [b, s_q, h_q, d], k and v [b, s_k, h_kv, d]
    (bf16/fp16/fp32; float64 reference precision on the torch backend), d <= 256, h_kv dividing
    h_q; or packed q [total_q, h_q, d], k, v [total_k, h_kv, d] with cu_seqlens_q, cu_seqlens_k
    [nseq + 1] int32 and static ints max_seqlen_q, max_seqlen_k (the longest sequences).
    causal (bool), window_size=(left, right) ints >= -1, softmax_scale (a finite float > 0;
    default 1/sqrt(d)): the bottom-right aligned masks of ``fusedops.attention.contract``.

    status: an optional int32 [1] status word (a tensor or TensorDesc; pass it to execute too):
    the kernels OR Status.CU_SEQLENS into it when the packed offsets need sanitising.

    execute(q, k, v, o, lse, cu_seqlens_q=, cu_seqlens_k=, workspace=, status=) writes o like q
    and lse fp32 (float64 for float64 inputs) [b, h_q, s_q] (packed: [h_q, total_q]): the
    natural-log log-sum-exp of the scaled, masked scores, -inf for a row that sees no key (its o
    is 0). Packed offsets are sanitised on the device, never read on the host (docs/plans.md,
    "Index data"): tokens no sequence covers get o = 0, lse = -inf. Workspace (Triton, packed):
    the sanitised offsets, 2·4·(nseq + 1) bytes; none otherwise. o and lse must not overlap the
    inputs; keep them for the backward.
    """

    op_name = "gqa_attention_forward"
    program_name = "forward"
    operands = (*inputs("q", "k", "v"), *outputs("o", "lse"),
                *indices("cu_seqlens_q", "cu_seqlens_k", optional=True), *status_word())
    returns = ("o", "lse")

    def __init__(self, q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 status=None, backend: str = "auto") -> None:
        super().__init__(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              status=status),
                         dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k), backend)

    def floor(self):
        """q, k, v read and o, lse written once; 4·b·h_q·s_q·s_k·d tensor-core FLOPs (about
        half causal): ``contract.forward_floor``."""
        return forward_floor(self.problem)

    def _validate(self, descs, **options) -> AttentionProblem:
        problem = self._validate_qkv(descs, **options)
        self._plan_tensor("o", descs["q"].shape, problem.dtype)
        self._plan_tensor("lse", self._lse_shape(problem), accumulator_dtype(problem.dtype))
        return problem

    def execute(self, q, k, v, o, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, workspace=None,
                status=None, current_stream=None) -> TupleDict:
        """Runs the forward into ``o`` and ``lse``; returns TupleDict(o, lse)."""
        return self._execute(dict(q=q, k=k, v=v, o=o, lse=lse, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, workspace=workspace, status=status,
                                  current_stream=current_stream))


class GQAAttentionBackward(_AttentionPlan):
    """Backward plan: dq, dk, dv from q, k, v, the forward's o and lse, and do, with the
    forward's options.

    Args (tensors or TensorDescs, contiguous): q, k, v, cu_seqlens as in the forward; o and do
    like q; lse as the forward writes it (fp32, or float64 for float64 inputs).

    execute(q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q=, cu_seqlens_k=, workspace=) writes dq
    like q and dk, dv like k (q's dtype). dk and dv are accumulated over the h_q / h_kv query heads
    of each KV head inside the kernels (never per query head) and deterministically (no float
    atomics). Tokens no sequence covers (packed offsets sanitised as in the forward) get zero
    gradients; ``status`` as in the forward. Workspace (Triton): delta = rowsum(do ∘ o), fp32
    per query row and head, and (packed) the sanitised offsets. The gradients must not overlap
    the inputs or each other.
    """

    op_name = "gqa_attention_backward"
    program_name = "backward"
    operands = (*inputs("q", "k", "v", "o", "lse", "do"), *outputs("dq", "dk", "dv"),
                *indices("cu_seqlens_q", "cu_seqlens_k", optional=True), *status_word())
    returns = ("dq", "dk", "dv")

    def __init__(self, q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                 window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, status=None, backend: str = "auto") -> None:
        super().__init__(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, status=status),
                         dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k), backend)

    def floor(self):
        """q, k, v, o, do, lse read and dq, dk, dv written once; the standard backward's five
        products, 2.5x the forward's FLOPs: ``contract.backward_floor``."""
        return backward_floor(self.problem)

    def _validate(self, descs, **options) -> AttentionProblem:
        problem = self._validate_qkv(descs, **options)
        qd = descs["q"]
        for name in ("o", "do"):
            expect_dtype(name, descs[name], (qd.dtype,))
            expect_shape(name, descs[name], qd.shape, "like q")
            expect_contiguous(name, descs[name])
        lse = descs["lse"]
        expect_dtype("lse", lse, (accumulator_dtype(qd.dtype),))
        expect_shape("lse", lse, self._lse_shape(problem),
                     "[h_q, total_q]" if problem.packed else "[b, h_q, s_q]")
        expect_contiguous("lse", lse)
        for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            self._plan_tensor(name, descs[src].shape, qd.dtype)
        return problem

    def execute(self, q, k, v, o, lse, do, dq, dk, dv, *, cu_seqlens_q=None, cu_seqlens_k=None,
                workspace=None, status=None, current_stream=None) -> TupleDict:
        """Runs the backward into ``dq``, ``dk``, ``dv``; returns TupleDict(dq, dk, dv)."""
        return self._execute(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  workspace=workspace, status=status,
                                  current_stream=current_stream))


def gqa_attention_forward(q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                          status=None, check_inputs: bool | None = None, backend: str = "auto",
                          current_stream=None) -> TupleDict:
    """Eager forward (see GQAAttentionForward): allocates o, lse and the workspace, returns
    TupleDict(o, lse). ``check_inputs=True`` (or FUSEDOPS_CHECK_INPUTS=1) first checks the
    packed offsets on the host (a synchronisation) and raises ValidationError naming the bad
    entry; ``status``: the optional status word the kernels report into.

    Example::

        o, lse = fusedops.gqa_attention_forward(q, k, v, causal=True)
    """
    return GQAAttentionForward.eager(
        dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)


def gqa_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                           window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, status=None,
                           check_inputs: bool | None = None, backend: str = "auto",
                           current_stream=None) -> TupleDict:
    """Eager backward (see GQAAttentionBackward): allocates the gradients and the workspace,
    returns TupleDict(dq, dk, dv). ``status``, ``check_inputs``: as in gqa_attention_forward."""
    return GQAAttentionBackward.eager(
        dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
             cu_seqlens_k=cu_seqlens_k, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)


class GQAAttentionDecode(Plan):
    """Decode step with a KV cache: append the new tokens' k, v in place at cache_seqlens, then
    attend the new queries to the cache (causally among the new tokens), split-KV.

    Args (tensors or TensorDescs, contiguous):
        q: [b, T, h_q, d] bf16/fp16/fp32 (float64: torch backend), T >= 1 new tokens per row.
        k_new, v_new: [b, T, h_kv, d], q's dtype.
        k_cache, v_cache: contiguous [b, capacity, h_kv, d], or paged [num_pages, page_size,
            h_kv, d] (page_size a multiple of 16) with block_table [b, max_pages] int32; q's dtype,
            or float8_e4m3fn with k_scale, v_scale fp32 [1] (per tensor) or [h_kv] (per KV head):
            the cache holds value / scale, saturated to +-448 (floating tensors 16-byte
            aligned, the scales too). Read and written in place.
        cache_seqlens: [b] int32 on the device: keys already in each row's cache. The new tokens
            go to positions cache_seqlens .. cache_seqlens + T - 1; cache_seqlens itself is not
            advanced (the caller does, as with flash_attn_with_kvcache).
        softmax_scale: a finite float > 0 (default 1/sqrt(d)).
        num_splits: the fixed number of key ranges (flash-decoding), an int >= 1; default one
            per 512 positions of the capacity, at most 32.
        status: an optional int32 [1] status word (pass it to execute too): the kernels OR
            Status.CACHE_SEQLENS / Status.BLOCK_TABLE into it for invalid rows.

    A row is valid when 0 <= cache_seqlens[i] <= capacity - T and (paged) every page it needs
    (j·page_size < cache_seqlens[i] + T) is in [0, num_pages); decided on the device before
    anything is written (docs/plans.md, "Index data"). An invalid row appends nothing and gets
    o = 0, lse = -inf; the other rows are unaffected.

    execute(q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse, block_table=, k_scale=,
    v_scale=, workspace=, status=) updates k_cache, v_cache and writes o [b, T, h_q, d] (q's
    dtype) and lse [b, h_q, T] fp32; returns TupleDict(o, lse). Workspace (Triton): the splits'
    fp32 partial outputs and lse, and each row's validity. Nothing depends on host-side lengths,
    so a decode step can be captured in a CUDA Graph once and replayed as the cache grows. o,
    lse and the caches must not overlap each other or the inputs.
    """

    op_name = "gqa_attention_decode"
    backend_module = "attention"
    program_name = "decode"
    backends = ("torch", "triton")
    operands = (*inputs("q", "k_new", "v_new"), *updated("k_cache", "v_cache"),
                *indices("cache_seqlens"), *outputs("o", "lse"),
                *indices("block_table", optional=True),
                *inputs("k_scale", "v_scale", optional=True), *status_word())
    options = (Option("softmax_scale", softmax_scale, None),
               Option("num_splits", optional(functools.partial(expect_int, minimum=1)), None))
    returns = ("o", "lse")

    def __init__(self, q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                 softmax_scale=None, k_scale=None, v_scale=None, num_splits=None, status=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                              cache_seqlens=cache_seqlens, block_table=block_table,
                              k_scale=k_scale, v_scale=v_scale, status=status),
                         dict(softmax_scale=softmax_scale, num_splits=num_splits), backend)

    def _validate(self, descs, *, softmax_scale, num_splits) -> DecodeAttentionProblem:
        q = descs["q"]
        expect_ndim("q", q, 4, "[b, T, h_q, d]")
        expect_dtype("q", q, DTYPES)
        b, T, hq, d = q.shape
        if min(b, T) < 1 or not 1 <= d <= MAX_HEAD_DIM:
            raise ValidationError(f"q: expected b, T >= 1 and d in [1, {MAX_HEAD_DIM}], got {list(q.shape)}")
        kn, vn = descs["k_new"], descs["v_new"]
        expect_ndim("k_new", kn, 4, "[b, T, h_kv, d]")
        hkv = kn.shape[2]
        if hkv < 1 or hq % hkv:
            raise ValidationError(f"k_new: expected h_kv >= 1 dividing h_q = {hq}, got {hkv}")
        for name, desc in (("k_new", kn), ("v_new", vn)):
            expect_dtype(name, desc, (q.dtype,))
            expect_shape(name, desc, (b, T, hkv, d), "[b, T, h_kv, d]")
        kc, vc = descs["k_cache"], descs["v_cache"]
        expect_ndim("k_cache", kc, 4, "[b, capacity, h_kv, d] or [num_pages, page_size, h_kv, d]")
        expect_dtype("k_cache", kc, (q.dtype, FP8))
        expect_dtype("v_cache", vc, (kc.dtype,))
        expect_shape("v_cache", vc, kc.shape, "like k_cache")
        if kc.shape[2:] != (hkv, d):
            raise ValidationError(
                f"k_cache: expected [..., h_kv, d] = [..., {hkv}, {d}], got {list(kc.shape)}")
        table = descs.get("block_table")
        if table is not None:
            expect_dtype("block_table", table, (torch.int32,))
            expect_ndim("block_table", table, 2, "[b, max_pages]")
            if table.shape[0] != b:
                raise ValidationError(
                    f"block_table: expected [b, max_pages] with b = {b}, got {list(table.shape)}")
            page_size, max_pages = kc.shape[1], table.shape[1]
            if page_size % PAGE_MULTIPLE:
                raise ValidationError(f"k_cache: expected a page size that is a multiple of "
                                      f"{PAGE_MULTIPLE}, got {page_size}")
            capacity = page_size * max_pages
        else:
            if kc.shape[0] != b:
                raise ValidationError(f"k_cache: expected [b, capacity, h_kv, d] with b = {b} (or pass "
                                      f"block_table for a paged cache), got {list(kc.shape)}")
            capacity = kc.shape[1]
            page_size, max_pages = capacity, 1
        seqlens = descs["cache_seqlens"]
        expect_dtype("cache_seqlens", seqlens, (torch.int32,))
        expect_shape("cache_seqlens", seqlens, (b,), "[b]")
        per_head = self._validate_scales(descs, kc.dtype, hkv)
        has_status = _has_status(descs)
        for name, desc in descs.items():
            expect_contiguous(name, desc)
        self._plan_tensor("o", (b, T, hq, d), q.dtype)
        self._plan_tensor("lse", (b, hq, T), accumulator_dtype(q.dtype))
        return DecodeAttentionProblem(
            q.dtype, kc.dtype, b, T, hq, hkv, d, table is not None, page_size, max_pages, capacity,
            resolve_scale(softmax_scale, d), per_head,
            default_num_splits(capacity) if num_splits is None else num_splits, self.device,
            kc.shape[0], has_status)

    def floor(self):
        """The cache read once at the fullest valid context (cache_seqlens = capacity - T: it
        is runtime data), the new tokens, o and lse written once: ``contract.decode_floor``."""
        return decode_floor(self.problem)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Every row at the context the cost models take (capacity - T), a block table giving
        each row its own pages (wrapping around a smaller pool), unit FP8 scales."""
        p, dev = self.problem, self.device
        out = dict(cache_seqlens=torch.full((p.batch,), decode_context(p), dtype=torch.int32,
                                            device=dev))
        if p.paged:
            table = torch.arange(p.batch * p.max_pages, dtype=torch.int64, device=dev) % p.pages
            out["block_table"] = table.view(p.batch, p.max_pages).to(torch.int32)
        if p.cache_dtype == FP8:
            shape = self.desc("k_scale").shape
            out.update(k_scale=torch.ones(shape, device=dev), v_scale=torch.ones(shape, device=dev))
        return out

    def _check_index_values(self, tensors) -> None:
        """cache_seqlens in [0, capacity - T]; then (paged) every page a row needs
        (j·page_size < cache_seqlens + T) in [0, num_pages)."""
        p = self.problem
        lengths = tensors.get("cache_seqlens")
        if lengths is None:
            return
        check_each_at_most("cache_seqlens", lengths, [p.capacity - p.tokens] * p.batch,
                           f"room for the T = {p.tokens} new tokens in a capacity of {p.capacity}")
        table = tensors.get("block_table")
        if not p.paged or table is None:
            return
        rows = table.detach().to("cpu", torch.int64).tolist()
        for i, length in enumerate(_host(lengths)):
            for j in range(min(p.max_pages, -(-(length + p.tokens) // p.page_size))):
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
                k_scale=None, v_scale=None, workspace=None, status=None,
                current_stream=None) -> TupleDict:
        """Appends to the caches and writes ``o`` and ``lse``; returns TupleDict(o, lse)."""
        return self._execute(dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                                  cache_seqlens=cache_seqlens, o=o, lse=lse, block_table=block_table,
                                  k_scale=k_scale, v_scale=v_scale, workspace=workspace,
                                  status=status, current_stream=current_stream))


def gqa_attention_decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                         softmax_scale=None, k_scale=None, v_scale=None, num_splits=None,
                         status=None, check_inputs: bool | None = None, backend: str = "auto",
                         current_stream=None) -> TupleDict:
    """Eager decode step (see GQAAttentionDecode): updates k_cache, v_cache in place, allocates
    o, lse and the workspace; returns TupleDict(o, lse). ``check_inputs=True`` (or
    FUSEDOPS_CHECK_INPUTS=1) first checks cache_seqlens and block_table on the host (a
    synchronisation); ``status``: the optional status word the kernels report into."""
    return GQAAttentionDecode.eager(
        dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
             cache_seqlens=cache_seqlens, block_table=block_table, k_scale=k_scale, v_scale=v_scale,
             status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs,
        softmax_scale=softmax_scale, num_splits=num_splits)
