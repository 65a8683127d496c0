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
