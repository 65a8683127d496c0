"""Grouped-query attention: training forward/backward plans and KV-cache decode
(specs/attention.md). Nemotron's attention layers: h_q = 32, h_kv = 8 or 2, d = 128, no RoPE.

Query head i reads KV head i // (h_q / h_kv); K and V are never replicated per query head. Masks
follow FlashAttention: causal is aligned bottom-right (query i sees key j <= i + s_k - s_q), an
optional window (left, right) keeps i + s_k - s_q - left <= j <= i + s_k - s_q + right (-1:
unbounded), and a row that sees no key gives o = 0, lse = -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ._desc import TensorDesc
from ._plan import EAGER_PLANS, Plan, describe
from ._stream import allocation_stream
from ._tupledict import TupleDict
from .errors import ValidationError

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
MAX_HEAD_DIM = 256
_IMPLEMENTATIONS = {"torch": "fusedops.backends.torch.attention",
                    "triton": "fusedops.backends.triton.attention"}


@dataclass(frozen=True)
class AttentionProblem:
    dtype: torch.dtype
    batch: int                 # sequences (nseq when packed)
    seqlen_q: int              # s_q, or max_seqlen_q when packed
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    causal: bool
    window: tuple[int, int]
    scale: float
    packed: bool
    total_q: int               # tokens of q (b·s_q, or total_q when packed)
    total_k: int
    device: torch.device


def _check_window(window) -> tuple[int, int]:
    try:
        left, right = (int(w) for w in window)
    except (TypeError, ValueError):
        raise ValidationError(f"window_size: expected a pair (left, right) of ints, got {window!r}") from None
    if left < -1 or right < -1:
        raise ValidationError(f"window_size: expected values >= -1 (-1: unbounded), got {window!r}")
    return left, right


class _AttentionPlan(Plan):
    implementations = _IMPLEMENTATIONS

    def _declare_qkv(self, q, k, v, *, causal, softmax_scale, window_size, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> AttentionProblem:
        q = self._declare("q", q)
        packed = cu_seqlens_q is not None or cu_seqlens_k is not None
        layout = "[total, h, d]" if packed else "[b, s, h, d]"
        expect_ndim("q", q, 3 if packed else 4, layout)
        expect_dtype("q", q, DTYPES)
        k, v = self._declare("k", k), self._declare("v", v)
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
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ValidationError("cu_seqlens_q, cu_seqlens_k: expected both for packed sequences, got one")
            cq = self._declare("cu_seqlens_q", cu_seqlens_q, alignment=4)
            ck = self._declare("cu_seqlens_k", cu_seqlens_k, alignment=4)
            expect_dtype("cu_seqlens_q", cq, (torch.int32,))
            expect_ndim("cu_seqlens_q", cq, 1, "[nseq + 1]")
            expect_dtype("cu_seqlens_k", ck, (torch.int32,))
            expect_shape("cu_seqlens_k", ck, cq.shape, "[nseq + 1] like cu_seqlens_q")
            if cq.shape[0] < 2:
                raise ValidationError(f"cu_seqlens_q: expected [nseq + 1] with nseq >= 1, got {list(cq.shape)}")
            for name, value, total in (("max_seqlen_q", max_seqlen_q, q.shape[0]),
                                       ("max_seqlen_k", max_seqlen_k, k.shape[0])):
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= total:
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
        if not isinstance(causal, bool):
            raise ValidationError(f"causal: expected a bool, got {causal!r}")
        window = _check_window(window_size)
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValidationError(f"softmax_scale: expected a finite float > 0, got {softmax_scale!r}")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        return AttentionProblem(q.dtype, batch, sq, sk, hq, hkv, d, causal, window, float(scale),
                                packed, total_q, total_k, self.device)

    def _lse_shape(self) -> tuple[int, ...]:
        p = self.problem
        return (p.heads_q, p.total_q) if p.packed else (p.batch, p.heads_q, p.seqlen_q)


class GQAAttentionForward(_AttentionPlan):
    """Forward plan: o = softmax(scale·q kᵀ + mask) v per query head, and lse.

    Args (tensors or TensorDescs, contiguous): q [b, s_q, h_q, d], k and v [b, s_k, h_kv, d]
    (bf16/fp16; fp32; float64 reference precision on the torch backend), or packed q
    [total_q, h_q, d], k, v [total_k, h_kv, d] with cu_seqlens_q, cu_seqlens_k [nseq + 1] int32
    and static max_seqlen_q, max_seqlen_k. causal, window_size=(left, right), softmax_scale
    (default 1/sqrt(d)).

    execute(q, k, v, o, lse) writes o like q and lse fp32 ([b, h_q, s_q], or [h_q, total_q]
    packed: natural-log log-sum-exp of the scaled, masked scores; -inf for a row without keys).
    """

    op_name = "gqa_attention_forward"

    def __init__(self, q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 backend: str = "auto") -> None:
        super().__init__(backend)
        self.problem = self._declare_qkv(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                         window_size=window_size, cu_seqlens_q=cu_seqlens_q,
                                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                         max_seqlen_k=max_seqlen_k)
        self._declare_output("o", self._descs["q"].shape, self.problem.dtype)
        self._declare_output("lse", self._lse_shape(), _lse_dtype(self.problem.dtype))
        self._select_backend(self.problem)
        self._workspace_bytes = self._impl.forward_workspace_size(self.problem)

    def _build_launcher(self):
        return self._impl.forward_launcher(self.problem)

    def execute(self, q, k, v, o, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, workspace=None,
                current_stream=None) -> TupleDict:
        inputs = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
        stream = self._prepare_execute(inputs, dict(o=o, lse=lse), workspace, current_stream)
        self._run(dict(inputs, o=o, lse=lse, workspace=workspace), stream=stream)
        return TupleDict(o=o, lse=lse)


class GQAAttentionBackward(_AttentionPlan):
    """Backward plan: dq, dk, dv from q, k, v, o, lse (the forward's) and do, with the forward's
    options. dk and dv are accumulated over the h_q / h_kv query heads of each KV head inside the
    kernels (never per query head) and deterministically (no float atomics). Workspace: delta =
    rowsum(do ∘ o), fp32 per query row and head."""

    op_name = "gqa_attention_backward"

    def __init__(self, q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                 window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, backend: str = "auto") -> None:
        super().__init__(backend)
        self.problem = self._declare_qkv(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                         window_size=window_size, cu_seqlens_q=cu_seqlens_q,
                                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                         max_seqlen_k=max_seqlen_k)
        qd = self._descs["q"]
        for name, value in (("o", o), ("do", do)):
            desc = self._declare(name, value)
            expect_dtype(name, desc, (qd.dtype,))
            expect_shape(name, desc, qd.shape, "like q")
            expect_contiguous(name, desc)
        lse_desc = self._declare("lse", lse)
        expect_dtype("lse", lse_desc, (_lse_dtype(qd.dtype),))
        expect_shape("lse", lse_desc, self._lse_shape(), "[h_q, total_q]" if self.problem.packed else "[b, h_q, s_q]")
        expect_contiguous("lse", lse_desc)
        for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            self._declare_output(name, self._descs[src].shape, qd.dtype)
        self._select_backend(self.problem)
        self._workspace_bytes = self._impl.backward_workspace_size(self.problem)

    def _build_launcher(self):
        return self._impl.backward_launcher(self.problem)

    def execute(self, q, k, v, o, lse, do, dq, dk, dv, *, cu_seqlens_q=None, cu_seqlens_k=None,
                workspace=None, current_stream=None) -> TupleDict:
        inputs = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k)
        outputs = dict(dq=dq, dk=dk, dv=dv)
        stream = self._prepare_execute(inputs, outputs, workspace, current_stream)
        self._run(dict(inputs, **outputs, workspace=workspace), stream=stream)
        return TupleDict(dq=dq, dk=dk, dv=dv)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gqa_attention_forward(q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                          backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager forward; returns TupleDict(o, lse)."""
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size),
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend)
    plan = EAGER_PLANS.get(GQAAttentionForward, describe(q), describe(k), describe(v),
                           cu_seqlens_q=describe(cu_seqlens_q), cu_seqlens_k=describe(cu_seqlens_k),
                           **options)
    with allocation_stream(current_stream, plan.device):
        o = torch.empty_like(q)
        lse = torch.empty(plan.desc("lse").shape, dtype=plan.desc("lse").dtype, device=q.device)
        workspace = plan.allocate_workspace()
    return plan.execute(q, k, v, o, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                        workspace=workspace, current_stream=current_stream)


def gqa_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                           window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, backend: str = "auto",
                           current_stream=None) -> TupleDict:
    """Eager backward; returns TupleDict(dq, dk, dv)."""
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size),
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend)
    plan = EAGER_PLANS.get(GQAAttentionBackward, describe(q), describe(k), describe(v), describe(o),
                           describe(lse), describe(do), cu_seqlens_q=describe(cu_seqlens_q),
                           cu_seqlens_k=describe(cu_seqlens_k), **options)
    with allocation_stream(current_stream, plan.device):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        workspace = plan.allocate_workspace()
    return plan.execute(q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, workspace=workspace, current_stream=current_stream)


@dataclass(frozen=True)
class DecodeAttentionProblem:
    dtype: torch.dtype
    cache_dtype: torch.dtype
    batch: int
    tokens: int
    heads_q: int
    heads_kv: int
    head_dim: int
    paged: bool
    page_size: int             # rows per cache page (the contiguous cache counts as one page)
    max_pages: int
    capacity: int              # key positions a row can hold
    scale: float
    scale_per_head: bool
    num_splits: int
    device: torch.device


FP8 = torch.float8_e4m3fn


class GQAAttentionDecode(Plan):
    """Decode step with a KV cache: append the new tokens' k, v in place at cache_seqlens, then
    attend the new queries to the cache (causally among the new tokens), split-KV.

    Args (tensors or TensorDescs, contiguous):
        q: [b, T, h_q, d] bf16/fp16/fp32 (T >= 1 new tokens per row). k_new, v_new: [b, T, h_kv, d].
        k_cache, v_cache: contiguous [b, capacity, h_kv, d], or paged [num_pages, page_size,
            h_kv, d] (page_size a multiple of 16) with block_table [b, max_pages] int32; q's dtype,
            or float8_e4m3fn with k_scale, v_scale fp32 [1] (per tensor) or [h_kv] (per KV head):
            the cache holds value / scale, saturated to +-448.
        cache_seqlens: [b] int32 on the device: keys already in each row's cache. The new tokens
            go to positions cache_seqlens .. cache_seqlens + T - 1 (not past the capacity);
            cache_seqlens itself is not advanced (the caller does, as with flash_attn_with_kvcache).
        num_splits: the fixed number of key ranges (flash-decoding); default from the capacity.

    execute(q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse, ..., workspace) writes
    o [b, T, h_q, d] and lse [b, h_q, T] fp32. Nothing depends on host-side lengths, so a decode
    step can be captured in a CUDA Graph once and replayed as the cache grows.
    """

    op_name = "gqa_attention_decode"
    implementations = _IMPLEMENTATIONS

    def __init__(self, q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                 softmax_scale=None, k_scale=None, v_scale=None, num_splits=None,
                 backend: str = "auto") -> None:
        super().__init__(backend)
        q = self._declare("q", q)
        expect_ndim("q", q, 4, "[b, T, h_q, d]")
        expect_dtype("q", q, DTYPES)
        b, T, hq, d = q.shape
        if min(b, T) < 1 or not 1 <= d <= MAX_HEAD_DIM:
            raise ValidationError(f"q: expected b, T >= 1 and d in [1, {MAX_HEAD_DIM}], got {list(q.shape)}")
        kn, vn = self._declare("k_new", k_new), self._declare("v_new", v_new)
        expect_ndim("k_new", kn, 4, "[b, T, h_kv, d]")
        hkv = kn.shape[2]
        if hkv < 1 or hq % hkv:
            raise ValidationError(f"k_new: expected h_kv >= 1 dividing h_q = {hq}, got {hkv}")
        for name, desc in (("k_new", kn), ("v_new", vn)):
            expect_dtype(name, desc, (q.dtype,))
            expect_shape(name, desc, (b, T, hkv, d), "[b, T, h_kv, d]")
        kc, vc = self._declare("k_cache", k_cache), self._declare("v_cache", v_cache)
        expect_ndim("k_cache", kc, 4, "[b, capacity, h_kv, d] or [num_pages, page_size, h_kv, d]")
        expect_dtype("k_cache", kc, (q.dtype, FP8))
        expect_dtype("v_cache", vc, (kc.dtype,))
        expect_shape("v_cache", vc, kc.shape, "like k_cache")
        if kc.shape[2:] != (hkv, d):
            raise ValidationError(f"k_cache: expected [..., h_kv, d] = [..., {hkv}, {d}], got {list(kc.shape)}")
        paged = block_table is not None
        if paged:
            table = self._declare("block_table", block_table, alignment=4)
            expect_dtype("block_table", table, (torch.int32,))
            expect_ndim("block_table", table, 2, "[b, max_pages]")
            if table.shape[0] != b:
                raise ValidationError(f"block_table: expected [b, max_pages] with b = {b}, got {list(table.shape)}")
            page_size, max_pages = kc.shape[1], table.shape[1]
            if page_size % 16:
                raise ValidationError(f"k_cache: expected a page size that is a multiple of 16, got {page_size}")
            capacity = page_size * max_pages
        else:
            if kc.shape[0] != b:
                raise ValidationError(f"k_cache: expected [b, capacity, h_kv, d] with b = {b} (or pass "
                                      f"block_table for a paged cache), got {list(kc.shape)}")
            capacity = kc.shape[1]
            page_size, max_pages = capacity, 1
        seqlens = self._declare("cache_seqlens", cache_seqlens, alignment=4)
        expect_dtype("cache_seqlens", seqlens, (torch.int32,))
        expect_shape("cache_seqlens", seqlens, (b,), "[b]")
        per_head = False
        if kc.dtype == FP8:
            for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
                if value is None:
                    raise ValidationError(f"{name}: expected an fp32 tensor [1] or [h_kv] with an FP8 cache, got None")
                desc = self._declare(name, value, alignment=4)
                expect_dtype(name, desc, (torch.float32,))
                if tuple(desc.shape) not in ((1,), (hkv,)):
                    raise ValidationError(f"{name}: expected shape [1] or [h_kv] = [{hkv}], got {list(desc.shape)}")
            per_head = self._descs["k_scale"].shape == (hkv,) and hkv > 1
            if self._descs["v_scale"].shape != self._descs["k_scale"].shape:
                raise ValidationError("v_scale: expected the shape of k_scale")
        elif k_scale is not None or v_scale is not None:
            raise ValidationError("k_scale, v_scale: only for a float8_e4m3fn cache")
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValidationError(f"softmax_scale: expected a finite float > 0, got {softmax_scale!r}")
        if num_splits is None:
            num_splits = max(1, min(32, -(-capacity // 512)))
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise ValidationError(f"num_splits: expected an int >= 1, got {num_splits!r}")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        self._declare_output("o", (b, T, hq, d), q.dtype)
        self._declare_output("lse", (b, hq, T), _lse_dtype(q.dtype))
        self.problem = DecodeAttentionProblem(q.dtype, kc.dtype, b, T, hq, hkv, d, paged, page_size,
                                              max_pages, capacity, float(scale), per_head, num_splits,
                                              self.device)
        self._select_backend(self.problem)
        self._workspace_bytes = self._impl.decode_workspace_size(self.problem)

    def _build_launcher(self):
        return self._impl.decode_launcher(self.problem)

    def execute(self, q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse, *, block_table=None,
                k_scale=None, v_scale=None, workspace=None, current_stream=None) -> TupleDict:
        inputs = dict(q=q, k_new=k_new, v_new=v_new, cache_seqlens=cache_seqlens,
                      block_table=block_table, k_scale=k_scale, v_scale=v_scale)
        outputs = dict(k_cache=k_cache, v_cache=v_cache, o=o, lse=lse)
        stream = self._prepare_execute(inputs, outputs, workspace, current_stream)
        self._run(dict(inputs, **outputs, workspace=workspace), stream=stream)
        return TupleDict(o=o, lse=lse)


def gqa_attention_decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
                         softmax_scale=None, k_scale=None, v_scale=None, num_splits=None,
                         backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager decode step (see GQAAttentionDecode); returns TupleDict(o, lse)."""
    plan = EAGER_PLANS.get(GQAAttentionDecode, describe(q), describe(k_new), describe(v_new),
                           describe(k_cache), describe(v_cache), describe(cache_seqlens),
                           block_table=describe(block_table), softmax_scale=softmax_scale,
                           k_scale=describe(k_scale), v_scale=describe(v_scale), num_splits=num_splits,
                           backend=backend)
    with allocation_stream(current_stream, plan.device):
        o = torch.empty_like(q)
        lse = torch.empty(plan.desc("lse").shape, dtype=plan.desc("lse").dtype, device=q.device)
        workspace = plan.allocate_workspace()
    return plan.execute(q, k_new, v_new, k_cache, v_cache, cache_seqlens, o, lse,
                        block_table=block_table, k_scale=k_scale, v_scale=v_scale,
                        workspace=workspace, current_stream=current_stream)
