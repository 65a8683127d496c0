"""The gate's registry entry."""

from __future__ import annotations

import torch

from ..core.dtypes import accumulator_dtype
from ..opinfo import ROUNDED_ONCE, OpInfo, accumulated
from . import samples
from .oracle import oracle
from .ops import engram_gate
from .plans import (EngramGateSavedBackward, EngramGateSavedForward, engram_gate_saved_backward,
                    engram_gate_saved_forward)


def tolerance(name: str, dtype: torch.dtype):
    """out, grad_x, grad_kv: rounded once to x's dtype; saved and grad_weight: fp32 (fp64)
    accumulators, grad_weight summed over tokens in another order than the oracle's."""
    if name == "grad_weight":
        return accumulated(dtype)
    if name == "saved":
        return ROUNDED_ONCE[accumulator_dtype(dtype)]
    return ROUNDED_ONCE[dtype]


INFO = OpInfo(
    name="engram_gate", title="Engram saved-state gate", doc="docs/engram_gate.md",
    plans=(EngramGateSavedForward, EngramGateSavedBackward),
    eager=(engram_gate_saved_forward, engram_gate_saved_backward), torch_ops=(engram_gate,),
    cases=samples.cases, production=samples.production, plan_calls=samples.plan_calls,
    run=samples.run, oracle=oracle, tolerance=tolerance,
    demo_limit=8e-3,   # fp32 math, each bf16 output rounded once
    bench=("engram_gate",))
