"""Mamba2 inference's registry entry: an update with snapshots, then a rollback (no backward)."""

from __future__ import annotations

import torch

from ..opinfo import OpInfo, Tolerance
from . import samples
from .oracle import oracle
from .plans import (Mamba2StateRollback, Mamba2StateUpdate, mamba2_replay, mamba2_rollback,
                    mamba2_state_update)

STORED_STATE = Tolerance(6e-3, 1.6e-2, "the samples store states in bf16, fp16 or fp32: every "
                         "write rounds to nearest or stochastically (within one ulp, up to 2^-7 "
                         "relative in bf16) and a snapshot or rolled-back state carries up to T "
                         "writes; y is computed from those states")
BF16_Y = Tolerance(8e-3, 1.6e-2, "y rounded once to bf16 (the CPU interpreter truncates: up to "
                   "one ulp) from states that carry the stored-state error")


def tolerance(name: str, dtype: torch.dtype) -> Tolerance:
    """Every result (y, snapshots, state), every backend, against the exact float64 recurrence:
    the error of storing the state, and y's rounding to x's dtype."""
    return BF16_Y if name == "y" and dtype == torch.bfloat16 else STORED_STATE


INFO = OpInfo(
    name="mamba2_inference", title="Mamba2 inference: state update, rollback, replay",
    doc="docs/mamba2_inference.md", plans=(Mamba2StateUpdate, Mamba2StateRollback),
    eager=(mamba2_state_update, mamba2_rollback, mamba2_replay), torch_ops=(),
    cases=samples.cases, production=samples.production, plan_calls=samples.plan_calls,
    run=samples.run, oracle=oracle, tolerance=tolerance,
    demo_limit=8e-3,   # fp32 recurrence, fp16 states, each bf16 y rounded once
    bench=("mamba2_inference", "mamba2_inference_state_storage"),
    demo_reference="oracle",   # the inference plans take no float64
    index_fuzz=samples.index_fuzz)
