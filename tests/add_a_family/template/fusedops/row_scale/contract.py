"""Row scale: y[n, d] = x[n, d] · w[d]; the backward dx = dy · w and dw[d] = Σ_n dy[n, d] ·
x[n, d], summed in fp32 (float64 for float64 inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class RowScaleProblem:
    """Plan-time facts: x's dtype, rows N, width D, the device."""

    dtype: torch.dtype
    rows: int
    width: int
    device: torch.device
