"""GQA attention: training forward/backward and KV-cache decode plans, and their eager wrappers
(the math and the masks: ``contract``)."""

from __future__ import annotations

import functools

import torch

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.dtypes import accumulator_dtype
from ..core.options import Option, expect_bool, expect_int, optional
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, indices, inputs, outputs, updated
from .contract import (DTYPES, FP8, MAX_HEAD_DIM, PAGE_MULTIPLE, AttentionProblem,
                       DecodeAttentionProblem, default_num_splits, resolve_scale, softmax_scale,
                       window_size)

_length = optional(functools.partial(expect_int, minimum=0))

TRAINING_OPTIONS = (Option("causal", expect_bool, False),
                    Option("softmax_scale", softmax_scale, None),
                    Option("window_size", window_size, (-1, -1)),
                    Option("max_seqlen_q", _length, None),
                    Option("max_seqlen_k", _length, None))


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
            for name, value, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]),
                                       ("max_seqlen_k", max_seqlen_k, k.shape[0])):
                if value is None or not value <= total:
                    raise ValidationError(f"{name}: expected an int in [0, {total}] (the longest "
                                          f"sequence) with packed sequences, got {value!r}")
            batch, sq, sk = cq.shape[0] - 1, max_seqlen_q, max_seqlen_k
            total_q, total_k = q.shape[0], k.shape[0]
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
                                self.device)

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

    execute(q, k, v, o, lse, cu_seqlens_q=, cu_seqlens_k=) writes o like q and lse fp32 (float64
    for float64 inputs) [b, h_q, s_q] (packed: [h_q, total_q]): the natural-log log-sum-exp of
    the scaled, masked scores, -inf for a row that sees no key (its o is 0). No workspace. o and
    lse must not overlap the inputs; keep them for the backward.
    """

    op_name = "gqa_attention_forward"
    program_name = "forward"
    operands = (*inputs("q", "k", "v"), *outputs("o", "lse"),
                *indices("cu_seqlens_q", "cu_seqlens_k", optional=True))
    returns = ("o", "lse")

    def __init__(self, q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k),
                         dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k), backend)

    def _validate(self, descs, **options) -> AttentionProblem:
        problem = self._validate_qkv(descs, **options)
        self._plan_tensor("o", descs["q"].shape, problem.dtype)
        self._plan_tensor("lse", self._lse_shape(problem), accumulator_dtype(problem.dtype))
        return problem

    def execute(self, q, k, v, o, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the forward into ``o`` and ``lse``; returns TupleDict(o, lse)."""
        return self._execute(dict(q=q, k=k, v=v, o=o, lse=lse, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, workspace=workspace,
                                  current_stream=current_stream))


class GQAAttentionBackward(_AttentionPlan):
    """Backward plan: dq, dk, dv from q, k, v, the forward's o and lse, and do, with the
    forward's options.

    Args (tensors or TensorDescs, contiguous): q, k, v, cu_seqlens as in the forward; o and do
    like q; lse as the forward writes it (fp32, or float64 for float64 inputs).

    execute(q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q=, cu_seqlens_k=, workspace=) writes dq
    like q and dk, dv like k (q's dtype). dk and dv are accumulated over the h_q / h_kv query heads
    of each KV head inside the kernels (never per query head) and deterministically (no float
    atomics). Workspace (Triton): delta = rowsum(do ∘ o), fp32 per query row and head. The
    gradients must not overlap the inputs or each other.
    """

    op_name = "gqa_attention_backward"
    program_name = "backward"
    operands = (*inputs("q", "k", "v", "o", "lse", "do"), *outputs("dq", "dk", "dv"),
                *indices("cu_seqlens_q", "cu_seqlens_k", optional=True))
    returns = ("dq", "dk", "dv")

    def __init__(self, q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                 window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, backend: str = "auto") -> None:
        super().__init__(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k),
                         dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k), backend)

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
                workspace=None, current_stream=None) -> TupleDict:
        """Runs the backward into ``dq``, ``dk``, ``dv``; returns TupleDict(dq, dk, dv)."""
        return self._execute(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  workspace=workspace, current_stream=current_stream))


def gqa_attention_forward(q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                          backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager forward (see GQAAttentionForward): allocates o and lse, returns TupleDict(o, lse).

    Example::

        o, lse = fusedops.gqa_attention_forward(q, k, v, causal=True)
    """
    return GQAAttentionForward.eager(
        dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k),
        backend=backend, current_stream=current_stream, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def gqa_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                           window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, backend: str = "auto",
                           current_stream=None) -> TupleDict:
    """Eager backward (see GQAAttentionBackward): allocates the gradients and the workspace,
    returns TupleDict(dq, dk, dv)."""
    return GQAAttentionBackward.eager(
        dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
             cu_seqlens_k=cu_seqlens_k),
        backend=backend, current_stream=current_stream, causal=causal, softmax_scale=softmax_scale,
        window_size=window_size, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


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
            go to positions cache_seqlens .. cache_seqlens + T - 1 (not past the capacity);
            cache_seqlens itself is not advanced (the caller does, as with flash_attn_with_kvcache).
        softmax_scale: a finite float > 0 (default 1/sqrt(d)).
        num_splits: the fixed number of key ranges (flash-decoding), an int >= 1; default one
            per 512 positions of the capacity, at most 32.

    execute(q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse, block_table=, k_scale=,
    v_scale=, workspace=) updates k_cache, v_cache and writes o [b, T, h_q, d] (q's dtype) and
    lse [b, h_q, T] fp32; returns TupleDict(o, lse). Workspace (Triton): the splits' fp32
    partial outputs and lse. Nothing depends on host-side lengths, so a decode step can be
    captured in a CUDA Graph once and replayed as the cache grows. o, lse and the caches must
    not overlap each other or the inputs.
    """

    op_name = "gqa_attention_decode"
    backend_module = "attention"
    program_name = "decode"
    backends = ("torch", "triton")
    operands = (*inputs("q", "k_new", "v_new"), *updated("k_cache", "v_cache"),
                *indices("cache_seqlens"), *outputs("o", "lse"),
                *indices("block_table", optional=True),
                *inputs("k_scale", "v_scale", optional=True))
    options = (Option("softmax_scale", softmax_scale, None),
               Option("num_splits", optional(functools.partial(expect_int, minimum=1)), None))
    returns = ("o", "lse")

    def __init__(self, q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                 softmax_scale=None, k_scale=None, v_scale=None, num_splits=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                              cache_seqlens=cache_seqlens, block_table=block_table,
                              k_scale=k_scale, v_scale=v_scale),
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
        for name, desc in descs.items():
            expect_contiguous(name, desc)
        self._plan_tensor("o", (b, T, hq, d), q.dtype)
        self._plan_tensor("lse", (b, hq, T), accumulator_dtype(q.dtype))
        return DecodeAttentionProblem(
            q.dtype, kc.dtype, b, T, hq, hkv, d, table is not None, page_size, max_pages, capacity,
            resolve_scale(softmax_scale, d), per_head,
            default_num_splits(capacity) if num_splits is None else num_splits, self.device)

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
                k_scale=None, v_scale=None, workspace=None, current_stream=None) -> TupleDict:
        """Appends to the caches and writes ``o`` and ``lse``; returns TupleDict(o, lse)."""
        return self._execute(dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
                                  cache_seqlens=cache_seqlens, o=o, lse=lse, block_table=block_table,
                                  k_scale=k_scale, v_scale=v_scale, workspace=workspace,
                                  current_stream=current_stream))


def gqa_attention_decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                         softmax_scale=None, k_scale=None, v_scale=None, num_splits=None,
                         backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager decode step (see GQAAttentionDecode): updates k_cache, v_cache in place, allocates
    o, lse and the workspace; returns TupleDict(o, lse)."""
    return GQAAttentionDecode.eager(
        dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache,
             cache_seqlens=cache_seqlens, block_table=block_table, k_scale=k_scale, v_scale=v_scale),
        backend=backend, current_stream=current_stream, softmax_scale=softmax_scale,
        num_splits=num_splits)
