"""The GQA attention contract: its problems, constants, option checks and math (docs/gqa_attention.md).

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

softcap c > 0 (0: off) caps the scaled scores before the mask, as FlashAttention does:
S = c · tanh(scale · q kᵀ / c); its backward multiplies dS by 1 - tanh² (one tanh per score).

Backward: dP = do vᵀ, delta = rowsum(do ∘ o), dS = P ∘ (dP - delta) (∘ (1 - tanh²) with a
softcap), dq = scale · dS k, dk = scale · dSᵀ q, dv = Pᵀ do; dk and dv of a KV head sum over its
h_q / h_kv query heads.

Paged prefill (forward only): k, v are pages [num_pages, page_size, h_kv, d] and sequence i's
key j is row j % page_size of page block_table[i, j // page_size] (flash-attn's
flash_attn_varlen_func(block_table=...)); cu_seqlens_k gives the key lengths. A sequence whose
needed pages (j < its key length) are not all in [0, num_pages) sees no key: its queries get
o = 0, lse = -inf (Status.BLOCK_TABLE).

Packed sequences take their offsets sanitised (docs/plans.md, "Index data"): c'[0] =
clamp(c[0], 0, total), c'[i] = clamp(c[i], c'[i-1], total); sequence i covers its first
min(c'[i+1] - c'[i], max_seqlen) tokens (queries and keys alike) and is computed as if those were
the whole sequence. Tokens no sequence covers get o = 0, lse = -inf, dq = 0 (queries) and
dk = dv = 0 (keys). Offsets that needed sanitising set Status.CU_SEQLENS.

Decode with a KV cache (row i of b, T queries, N appended tokens: N = T, or 0 to attend
only, L = cache_seqlens[i], its cache row c = cache_batch_idx[i] (default i), its first key
lp = cache_leftpad[i] (default 0)): a row is valid when 0 <= L <= capacity - N, 0 <= lp <= L,
(paged) every page it needs, j·page_size < L + N, is in [0, pages), c < the cache's rows (a
negative c is padding: invalid, not reported), no earlier row appends to the same c, and (rotary)
its query positions fit the table. A valid row's new tokens' k, v are written at cache positions
L .. L + N - 1 (an FP8 cache holds fp32(value / scale) saturated to ±FP8_MAX and rounded to
nearest-even e4m3); then query t attends to cache positions lp <= j < L + N, bottom-right
aligned like training (offset = L + N - T: causal j <= t + offset, window_size as in training),
reading an FP8 cache as stored · scale. Rotary (rotary_cos/sin [seqlen_ro, r/2], r <= d even):
the appended k at position L + t and q at L + t (causal or windowed; L for every query
otherwise, as flash-attn) are rotated on their first r features, interleaved pairs (x0, x1), ...
or halves (x[:r/2], x[r/2:r]): (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos). An invalid row
writes nothing and gets o = 0, lse = -inf (Status.CACHE_SEQLENS / BLOCK_TABLE / SLOT_INDEX).
cache_seqlens is not advanced.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch

from ..core.cost import Cost
from ..core.dtypes import accumulator_dtype, element_size
from ..core.machines import wave_efficiency
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
SPLIT_EFFICIENCY = 0.9
"""Decode's default number of key ranges (``default_num_splits``): at most one per
SPLIT_POSITIONS cache positions and MAX_SPLITS; the fewest whose last wave is filled to within
SPLIT_EFFICIENCY of the best count's."""


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
    has_status: bool = False   # a status word is given (invalid offsets are reported)
    softcap: float = 0.0       # c > 0: S = c·tanh(scale·q kᵀ / c); 0: off
    paged: bool = False        # paged prefill: k, v are pages read through a block table
    page_size: int = 0
    max_pages: int = 0
    pages: int = 0             # pages in the pool (paged)


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
    pages: int = 0             # pages in the pool (paged), or the cache's rows (contiguous)
    has_status: bool = False   # a status word is given (invalid rows are reported)
    new_tokens: int | None = None   # N appended tokens (0: attend only; None: = tokens)
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    batch_idx: bool = False    # cache_batch_idx maps rows to cache rows
    leftpad: bool = False      # cache_leftpad gives each row's first key
    rotary_dim: int = 0        # r: features rotated (0: no rotary)
    rotary_interleaved: bool = False
    rotary_len: int = 0        # seqlen_ro: positions in rotary_cos/sin
    rotary_dtype: torch.dtype | None = None

    @property
    def appended(self) -> int:
        """N: the tokens each row appends (0: attend only)."""
        return self.tokens if self.new_tokens is None else self.new_tokens

    @property
    def rotary_queries(self) -> int:
        """Query positions rotary uses past L: T (causal or windowed), else 1 (every query at
        L, as flash-attn)."""
        return self.tokens if self.causal or self.window != (-1, -1) else 1


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


def softcap(name: str, value) -> float:
    """0 (off) or a finite float > 0 (bool refused)."""
    value = expect_float(name, value, minimum=0.0)
    return value


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale a problem uses: ``scale``, or 1/sqrt(head_dim) when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def default_num_splits(capacity: int, programs: int, sms: int) -> int:
    """Decode's key ranges when num_splits is None, from the SM count and the step's
    b·h_kv (``programs`` without a split) and cache capacity: of 1 to min(MAX_SPLITS,
    ceil(capacity / SPLIT_POSITIONS)) splits (a split streams at least SPLIT_POSITIONS positions,
    so its fp32 partial stays small against its cache read), the fewest whose programs·splits
    fill their waves of ``sms`` (``wave_efficiency``) to within SPLIT_EFFICIENCY of the best
    count's. On 132 SMs with 8192 positions: b·h_kv = 8 takes 15 splits (120 programs), 64
    takes 2, 512 (3.9 waves, 97% full) takes 1; a short cache takes 1 whatever the batch."""
    most = max(1, min(MAX_SPLITS, -(-capacity // SPLIT_POSITIONS)))
    efficiency = [wave_efficiency(max(1, programs) * s, sms) for s in range(1, most + 1)]
    best = max(efficiency)
    return next(s for s, e in enumerate(efficiency, 1) if e >= SPLIT_EFFICIENCY * best)


# -- the floors (fusedops.core.cost): the least any implementation moves and computes ----------
def sequence_lengths(problem: AttentionProblem) -> list[tuple[int, int]]:
    """(queries, keys) of each sequence the models count. Dense: b sequences of (s_q, s_k).
    Packed: the offsets are runtime data, so the models take the longest sequences the plan
    allows, as many as the packed tokens fill: sequence i covers min(max_seqlen, what is left
    of the tokens) queries (keys), the rest are empty (16K tokens, 8 sequences, max_seqlen 4096:
    four sequences of 4096 and four empty ones)."""
    p = problem
    if not p.packed:
        return [(p.seqlen_q, p.seqlen_k)] * p.batch
    return [(max(0, min(p.seqlen_q, p.total_q - i * p.seqlen_q)),
             max(0, min(p.seqlen_k, p.total_k - i * p.seqlen_k))) for i in range(p.batch)]


@functools.lru_cache(maxsize=256)
def visible_pairs(len_q: int, len_k: int, causal: bool, window: tuple[int, int]) -> int:
    """(query, key) pairs the bottom-right aligned mask keeps in one sequence (causal, square:
    s(s + 1)/2, half the scores and the diagonal)."""
    if len_q <= 0 or len_k <= 0:
        return 0
    i = torch.arange(len_q, dtype=torch.int64) + (len_k - len_q)   # each query's diagonal key
    hi = torch.full_like(i, len_k - 1)
    lo = torch.zeros_like(i)
    left, right = window
    if causal:
        hi = torch.minimum(hi, i)
    if right >= 0:
        hi = torch.minimum(hi, i + right)
    if left >= 0:
        lo = torch.maximum(lo, i - left)
    return int((hi - lo + 1).clamp_min(0).sum())


def forward_flops(problem: AttentionProblem) -> float:
    """4·d FLOPs per visible score per query head (q kᵀ and P v): 4·b·h_q·s_q·s_k·d, half of it
    causal."""
    pairs = sum(visible_pairs(lq, lk, problem.causal, problem.window)
                for lq, lk in sequence_lengths(problem))
    return 4.0 * problem.head_dim * problem.heads_q * pairs


def _index_bytes(problem: AttentionProblem) -> int:
    return 2 * 4 * (problem.batch + 1) if problem.packed else 0


def forward_floor(problem: AttentionProblem) -> Cost:
    """The least any forward does: q, k, v (and the packed offsets) read once, o and lse written
    once; ``forward_flops`` on tensor cores."""
    p = problem
    e, a = element_size(p.dtype), element_size(accumulator_dtype(p.dtype))
    q = p.total_q * p.heads_q * p.head_dim
    kv = p.total_k * p.heads_kv * p.head_dim
    flops = forward_flops(p)
    return Cost(flops, (q + 2 * kv) * e + _index_bytes(p), q * e + p.total_q * p.heads_q * a,
                mma_flops=flops)


def backward_floor(problem: AttentionProblem) -> Cost:
    """The least any backward does: q, k, v, o, do, lse (and the offsets) read once, dq, dk, dv
    written once; the five products of the standard backward (S = q kᵀ, dP = do vᵀ, dv = Pᵀ do,
    dq = dS k, dk = dSᵀ q), 2.5x the forward's FLOPs, on tensor cores."""
    p = problem
    e, a = element_size(p.dtype), element_size(accumulator_dtype(p.dtype))
    q = p.total_q * p.heads_q * p.head_dim
    kv = p.total_k * p.heads_kv * p.head_dim
    flops = 2.5 * forward_flops(p)
    return Cost(flops, (3 * q + 2 * kv) * e + p.total_q * p.heads_q * a + _index_bytes(p),
                (q + 2 * kv) * e, mma_flops=flops)


def decode_context(problem: DecodeAttentionProblem) -> int:
    """The cache length L the decode models take: cache_seqlens is runtime data, so every row at
    the fullest valid context, capacity - N (8192 - T at the production shape; the capacity when
    attending only)."""
    return max(0, problem.capacity - problem.appended)


def decode_floor(problem: DecodeAttentionProblem) -> Cost:
    """The least a decode step does at context L = ``decode_context``: the L cached positions of
    k and v read once (the N new ones come from k_new, v_new), q, k_new, v_new, cache_seqlens (and
    cache_batch_idx, cache_leftpad), the block-table entries the rows use, the scales and (rotary)
    the cos/sin rows of the new positions read once; the new k, v written to the cache, o and lse
    written once; 4·d FLOPs per (query head, query, visible position: L + t + 1 causal with
    N = T) on tensor cores."""
    p = problem
    e, ce = element_size(p.dtype), element_size(p.cache_dtype)
    L, T, N, b = decode_context(p), p.tokens, p.appended, p.batch
    row = p.heads_kv * p.head_dim
    read = (b * T * p.heads_q * p.head_dim + 2 * b * N * row) * e + 2 * b * L * row * ce + 4 * b
    read += 4 * b * (p.batch_idx + p.leftpad)
    if p.paged:
        read += 4 * b * min(p.max_pages, -(-(L + N) // p.page_size))
    if p.cache_dtype == FP8:
        read += 2 * 4 * (p.heads_kv if p.scale_per_head else 1)
    if p.rotary_dim:
        read += 2 * b * max(N, p.rotary_queries) * (p.rotary_dim // 2) * e
    a = element_size(accumulator_dtype(p.dtype))
    written = 2 * b * N * row * ce + b * T * p.heads_q * p.head_dim * e + a * b * p.heads_q * T
    flops = 4.0 * p.head_dim * p.heads_q * b * visible_pairs(T, L + N, p.causal, p.window)
    return Cost(flops, read, written, mma_flops=flops)
