"""Mamba2 inference's contract: the state update, its storage policies and the rollback
(docs/mamba2_inference.md). The dt transform, its dt_limit check and the checks of the per-token
and per-head operands are the scan's (fusedops.mamba2.contract), so a scan over l tokens and l
one-token updates agree.

Per row (a request, whose state lives in ``state[slot]``) and head, for tokens t = 1..T:

    S <- exp(dt_t A) S + dt_t x_t ⊗ B_t          in fp32
    y_t = S C_t + D x_t   (· silu(z_t))
    after token t, if t % checkpoint_period == 0 or t == T: S <- store(S)   (the written state)

``store`` rounds to the state dtype: to nearest-even, or stochastically (up to the neighbour away
from the truncated value with probability equal to the remaining fraction: unbiased, always
within one ulp), the uniform number coming from Philox-4x32-10 keyed by the row's seed and
countered by (element index within [h, p, n], offset + t). Snapshot t is store(S) after token t
(snapshot 0: the state before the launch). Rows whose slot is negative (padding) or past the
cache are skipped: their slots, y rows and snapshots are not touched.

Rollback: state[slot_i] = snapshots[i, accepted[i]] for rows with a valid slot and accepted in
[0, T]; the other rows are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.checks import expect_dtype, expect_ndim, expect_shape
from ..core.desc import TensorDesc
from ..errors import ValidationError
from ..mamba2.contract import (DEFAULT_DT_LIMIT, SOFTPLUS_THRESHOLD, check_dt, check_gate,
                               check_heads, expect_dt_limit)

__all__ = ["ACTIVATION_DTYPES", "DEFAULT_DT_LIMIT", "DecodeProblem", "ROUNDINGS",
           "RollbackProblem", "SOFTPLUS_THRESHOLD", "STATE_DTYPES", "check_dt", "check_gate",
           "check_heads", "check_slot_indices", "expect_dt_limit"]

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUNDINGS = ("nearest", "stochastic")
RNG_DTYPE = torch.int64
"""rng_seed and rng_offset: one int64 per row."""


@dataclass(frozen=True)
class DecodeProblem:
    """The plan-time facts of a state update."""

    dtype: torch.dtype
    dt_dtype: torch.dtype
    state_dtype: torch.dtype
    batch: int
    tokens: int
    slots: int
    heads: int
    head_dim: int
    groups: int
    state: int
    has_D: bool
    D_per_channel: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    dt_limit: tuple[float, float]
    has_indices: bool
    has_snapshots: bool
    stochastic: bool
    checkpoint_period: int
    device: torch.device


@dataclass(frozen=True)
class RollbackProblem:
    """The plan-time facts of a rollback (state_numel = h·p·n)."""

    state_dtype: torch.dtype
    batch: int
    tokens: int
    slots: int
    state_numel: int
    has_indices: bool
    device: torch.device


def check_slot_indices(descs: dict[str, TensorDesc], batch: int) -> None:
    """The optional state_batch_indices: int32 [b]."""
    if "state_batch_indices" in descs:
        idx = descs["state_batch_indices"]
        expect_dtype("state_batch_indices", idx, (torch.int32,))
        expect_shape("state_batch_indices", idx, (batch,), "[b]")


def check_state(descs: dict[str, TensorDesc]) -> TensorDesc:
    """state: [slots, h, p, n] in one of STATE_DTYPES."""
    state = descs["state"]
    expect_ndim("state", state, 4, "[slots, h, p, n]")
    expect_dtype("state", state, STATE_DTYPES)
    return state


def expect_rounding(name: str, value) -> str:
    """'nearest' or 'stochastic'."""
    if not isinstance(value, str) or value not in ROUNDINGS:
        raise ValidationError(f"{name}: expected 'nearest' or 'stochastic', got {value!r}")
    return value
