"""The gate's registry entry."""

from __future__ import annotations

import torch

from ..core.dtypes import accumulator_dtype
from ..opinfo import ROUNDED_ONCE, OpInfo, Tolerance
from . import samples
from .oracle import oracle
from .ops import engram_gate
from .plans import (EngramGateSavedBackward, EngramGateSavedForward, engram_gate_saved_backward,
                    engram_gate_saved_forward)


GRAD_WEIGHT = Tolerance(1e-4, 1e-4, "fp32 sums over tokens of terms that go through "
                        "1/sqrt(|dot|): one fp32 ulp of the forward's dot, which each backend "
                        "reduces in its own tree, moves them by up to ~4e-5 on the drawn cases")


def tolerance(name: str, dtype: torch.dtype):
    """out, grad_x, grad_kv: rounded once to x's dtype; saved and grad_weight: fp32 (fp64)
    accumulators, grad_weight summed over tokens in another order than the oracle's and
    sensitive to the saved dot (``GRAD_WEIGHT``)."""
    if name == "grad_weight":
        acc = accumulator_dtype(dtype)
        return ROUNDED_ONCE[acc] if acc == torch.float64 else GRAD_WEIGHT
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
    bench=("engram_gate",),
    emulated_cases=("small:1",))
