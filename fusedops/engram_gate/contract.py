"""The Engram saved-state gate's contract: its problem, constants and math (docs/engram_gate.md).

For every token n and stream s the gate decides how much of the token's retrieved memory value v
to add to the residual stream x (all arithmetic fp32, float64 in a reference plan):

    rx = 1/sqrt(mean(x^2) + eps), rk = 1/sqrt(mean(k^2) + eps)
    dot = sum(x * w * k) * rx * rk / sqrt(D); gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))
    out = x + gate * v        (gate = 0 and out == x bit for bit where mask is false)

Backward (g = grad_out): dgate = sum(g * v); ddot = dgate * gate * (1 - gate) * 0.5 / sqrt(|dot|)
where |dot| >= 1e-6 and gate != 0, else 0; coef = ddot * rx * rk / sqrt(D);
grad_x = g + coef * w * k - ddot * dot * rx^2 / D * x; grad_k = coef * w * x - ddot * dot * rk^2
/ D * k; grad_v = sum_s gate_s * g_s; grad_weight = sum_n coef * x * k (fixed order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.cost import Cost
from ..core.dtypes import accumulator_dtype, element_size

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
DEFAULT_EPS = 1e-20
MIN_EPS = torch.finfo(torch.float32).tiny     # eps must be a normal fp32 number
DOT_CLAMP = float(torch.tensor(1e-6, dtype=torch.float32))
"""The clamp of the signed square root, as the fp32 value the kernels compare against (the
gradient passes at equality, as torch.clamp_min does)."""

MIN_TOKENS_PER_BLOCK = 4
"""Backward: fewer tokens per grad_weight partial row would make the partials dominate."""


@dataclass(frozen=True)
class GateProblem:
    """The plan-time facts a backend needs (forward and backward)."""

    dtype: torch.dtype
    tokens: int
    streams: int
    hidden: int
    eps: float
    has_mask: bool
    accumulate: bool
    device: torch.device


def token_blocks(tokens: int, max_blocks: int) -> tuple[int, int]:
    """(tokens per block, blocks): the fixed partition of the tokens into at most ``max_blocks``
    blocks of at least MIN_TOKENS_PER_BLOCK tokens. The backward kernels write one fp32
    grad_weight partial row per block and sum the rows in order: deterministic."""
    per_block = max(MIN_TOKENS_PER_BLOCK, math.ceil(tokens / max(1, max_blocks)))
    return per_block, math.ceil(tokens / per_block)


FORWARD_FLOPS_PER_ELEMENT = 9     # x·x, k·k, x·w·k (2, 2, 3) and x + gate·v (2), per (n, s, d)
BACKWARD_FLOPS_PER_ELEMENT = 13   # g·v, gate·g, grad_x (4), grad_k (3), the grad_weight term (2)


def forward_floor(problem: GateProblem) -> Cost:
    """The least any forward can do: read x, kv, weight and the mask once, write out and saved
    once; 9 FLOPs per element of x."""
    n, s, d = problem.tokens, problem.streams, problem.hidden
    e, a = element_size(problem.dtype), element_size(accumulator_dtype(problem.dtype))
    read = n * (2 * s + 1) * d * e + s * d * a + (n if problem.has_mask else 0)
    written = n * s * d * e + n * s * 4 * a
    return Cost(FORWARD_FLOPS_PER_ELEMENT * n * s * d, read, written)


def backward_floor(problem: GateProblem) -> Cost:
    """The least any backward can do: read x, kv, weight, saved and grad_out once, write
    grad_x, grad_kv and grad_weight once (read it too when accumulating)."""
    n, s, d = problem.tokens, problem.streams, problem.hidden
    e, a = element_size(problem.dtype), element_size(accumulator_dtype(problem.dtype))
    read = n * (3 * s + 1) * d * e + n * s * 4 * a + s * d * a * (2 if problem.accumulate else 1)
    written = n * (2 * s + 1) * d * e + s * d * a
    return Cost(BACKWARD_FLOPS_PER_ELEMENT * n * s * d, read, written)
