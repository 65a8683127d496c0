"""The row scale's registry entry."""

from __future__ import annotations

import torch

from ..opinfo import ROUNDED_ONCE, OpInfo
from . import samples
from .oracle import oracle
from .plans import RowScaleBackward, RowScaleForward, row_scale_backward, row_scale_forward


def tolerance(name: str, dtype: torch.dtype):
    """y and grad_x: rounded once to x's dtype; grad_weight: an fp32 (fp64) sum."""
    return ROUNDED_ONCE[torch.float32 if name == "grad_weight" and dtype != torch.float64
                        else dtype]


INFO = OpInfo(
    name="row_scale", title="Row scale", doc="docs/row_scale.md",
    plans=(RowScaleForward, RowScaleBackward), eager=(row_scale_forward, row_scale_backward),
    torch_ops=(), cases=samples.cases, production=samples.production,
    plan_calls=samples.plan_calls, run=samples.run, oracle=oracle, tolerance=tolerance,
    demo_limit=8e-3, bench=("row_scale",), emulated_cases=("small:0",))
