"""The GQA attention contract: its problems, constants, option checks and math (docs/attention.md).

Nemotron's attention layers: h_q = 32, h_kv = 8 or 2, d = 128, no rotary embedding. Query head i
reads KV head i // (h_q / h_kv); K and V are never replicated per query head.

Training, per sequence (a batch row, or one packed sequence of cu_seqlens), per query head:

    S = scale · q kᵀ  (scale: softmax_scale, default 1/sqrt(d))
    P = softmax(S + mask) along the keys; o = P v; lse = log(sum_j exp(S_ij + mask_ij)) (natural log)

Masking follows FlashAttention, aligned bottom-right: with offset = s_k - s_q (per sequence),
query i sees key j when j <= i + offset (causal) and, with window_size = (left, right),
i + offset - left <= j <= i + offset + right (-1: unbounded on that side). A query row that sees
no key (a sequence without keys, or causal with s_q > s_k) gives o = 0, lse = -inf and zero
gradients, never NaN.

Backward: dP = do vᵀ, delta = rowsum(do ∘ o), dS = P ∘ (dP - delta), dq = scale · dS k,
dk = scale · dSᵀ q, dv = Pᵀ do; dk and dv of a KV head sum over its h_q / h_kv query heads.

Decode with a KV cache (row i of b, T new tokens, L = cache_seqlens[i]): the new tokens' k, v
are written at cache positions L .. L + T - 1 (positions >= capacity are skipped; an FP8 cache
holds fp32(value / scale) saturated to ±FP8_MAX and rounded to nearest-even e4m3); then new token
t attends to cache positions j <= L + t with j < min(L + T, capacity), reading an FP8 cache as
stored · scale. cache_seqlens is not advanced.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..core.options import expect_float
from ..errors import ValidationError

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""Activation dtypes (float64: reference precision, served by the torch backend)."""

MAX_HEAD_DIM = 256

FP8 = torch.float8_e4m3fn
"""The quantised KV-cache dtype (with fp32 k_scale, v_scale)."""

FP8_MAX = 448.0
"""Largest finite e4m3 magnitude: an FP8 cache saturates value / scale to ±FP8_MAX."""

PAGE_MULTIPLE = 16
"""A paged cache's page size is a multiple of this many positions."""

SPLIT_POSITIONS = 512
MAX_SPLITS = 32
"""Decode's default number of key ranges: one per SPLIT_POSITIONS cache positions, at most
MAX_SPLITS (``default_num_splits``)."""


@dataclass(frozen=True)
class AttentionProblem:
    """The plan-time facts of a training forward or backward."""

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


@dataclass(frozen=True)
class DecodeAttentionProblem:
    """The plan-time facts of a decode step."""

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


# -- option validators ---------------------------------------------------------------------------
def window_size(name: str, value) -> tuple[int, int]:
    """(left, right): a pair of ints (bool and float refused), each >= -1 (-1: unbounded)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        raise ValidationError(f"{name}: expected a pair (left, right) of ints, got {value!r}")
    left, right = int(value[0]), int(value[1])
    if left < -1 or right < -1:
        raise ValidationError(f"{name}: expected values >= -1 (-1: unbounded), got {value!r}")
    return left, right


def softmax_scale(name: str, value) -> float | None:
    """None (1/sqrt(d)) or a finite float > 0 (bool refused)."""
    return None if value is None else expect_float(name, value, positive=True)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale a problem uses: ``scale``, or 1/sqrt(head_dim) when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def default_num_splits(capacity: int) -> int:
    """Decode's key ranges when num_splits is None: one per SPLIT_POSITIONS positions, 1..32."""
    return max(1, min(MAX_SPLITS, -(-capacity // SPLIT_POSITIONS)))
