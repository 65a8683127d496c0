"""Mamba2 inference's contract: the state update, its storage policies and the rollback
(docs/mamba2_inference.md). The dt transform, its dt_limit check and the checks of the per-token
and per-head operands are the scan's (fusedops.mamba2_scan.contract), so a scan over l tokens and l
one-token updates agree.

Per row (a request, whose state lives in ``state[slot]``) and head, for tokens t = 1..T:

    S <- exp(dt_t A) S + dt_t x_t ⊗ B_t          in fp32
    y_t = S C_t + D x_t   (· silu(z_t))
    after token t, if t % checkpoint_period == 0 or t == T: S <- store(S)   (the written state)

``store`` rounds to the state dtype: to nearest-even, or stochastically (up to the neighbour away
from the truncated value with probability equal to the remaining fraction: unbiased, always
within one ulp), the uniform number coming from Philox-4x32-10 keyed by the row's seed and
countered by (element index within [h, p, n], offset + t). Snapshot t is store(S) after token t
(snapshot 0: the state before the launch).

Index data (docs/plans.md, "Index data"; any values are memory-safe): a row whose slot is
negative (padding: valid, no status bit) or past the cache (Status.SLOT_INDEX) is skipped: no
slot is touched, and its y rows and snapshots are written as 0. Slots of the valid rows must be
distinct (checked on the host only: ``check_inputs``).

Operands: x, z, y (rows of p elements), B, C (rows of n) and dt (rows of h) take views whose last
dimension is contiguous when a row is a whole number of 16-byte vectors (``row_vector``: their
other strides are then any multiples of 16 bytes, e.g. the decode step's slices of the
in-projection and conv output); otherwise they are contiguous. B and C may be fp32 with 16-bit x
(mamba_ssm's own mix), read as they are. The state cache and the snapshots are contiguous.

Rollback: state[slot_i] = snapshots[i, accepted[i]] for rows with a valid slot and accepted in
[0, T]; the other rows are skipped (their slots unchanged). Status.ACCEPTED_COUNT is reported
for every accepted count outside [0, T] (padding rows included: keep theirs in range, e.g. 0)
and Status.SLOT_INDEX for a slot past the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.checks import expect_dtype, expect_ndim, expect_shape
from ..core.cost import Cost
from ..core.dtypes import element_size
from ..core.desc import TensorDesc
from ..core.index_checks import check_range
from ..errors import ValidationError
from ..mamba2_scan.contract import (DEFAULT_DT_LIMIT, SOFTPLUS_THRESHOLD, check_dt, check_gate,
                                    check_heads, check_status, expect_dt_limit, row_vector)

__all__ = ["ACTIVATION_DTYPES", "DEFAULT_DT_LIMIT", "DecodeProblem", "ROUNDINGS",
           "RollbackProblem", "SOFTPLUS_THRESHOLD", "STATE_DTYPES", "UPDATE_FLOPS_PER_ELEMENT",
           "check_accepted_values", "check_dt", "check_gate", "check_heads", "check_slot_indices",
           "check_slot_values", "check_status", "expect_dt_limit", "rollback_floor", "row_vector",
           "update_floor"]

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
    has_status: bool = False     # a status word is given: the kernel reports SLOT_INDEX into it
    bc_dtype: torch.dtype | None = None   # B and C: x's dtype (None) or fp32 with 16-bit x

    @property
    def b_dtype(self) -> torch.dtype:
        """The dtype of B and C."""
        return self.bc_dtype or self.dtype

    @property
    def vector(self) -> int:
        """Elements per stride unit of x, z, y (``row_vector`` of p)."""
        return row_vector(self.head_dim, self.dtype)

    @property
    def bc_vector(self) -> int:
        """Elements per stride unit of B and C (``row_vector`` of n)."""
        return row_vector(self.state, self.b_dtype)

    @property
    def dt_vector(self) -> int:
        """Elements per stride unit of dt (``row_vector`` of h)."""
        return row_vector(self.heads, self.dt_dtype)


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
    has_status: bool = False     # SLOT_INDEX and ACCEPTED_COUNT reported into the status word


def check_slot_indices(descs: dict[str, TensorDesc], batch: int) -> None:
    """The optional state_batch_indices: int32 [b]."""
    if "state_batch_indices" in descs:
        idx = descs["state_batch_indices"]
        expect_dtype("state_batch_indices", idx, (torch.int32,))
        expect_shape("state_batch_indices", idx, (batch,), "[b]")


def check_slot_values(tensors, slots: int) -> None:
    """Host check of state_batch_indices (check_inputs=True): every entry negative (padding) or
    in [0, slots), and the valid entries distinct."""
    idx = tensors.get("state_batch_indices")
    if not isinstance(idx, torch.Tensor):
        return
    name = "state_batch_indices"
    check_range(name, idx.clamp(min=-1), 0, slots, allowed=(-1,),
                meaning=" (any negative entry is padding)")
    first: dict[int, int] = {}
    for i, value in enumerate(idx.detach().reshape(-1).to("cpu", torch.int64).tolist()):
        if value < 0:
            continue
        if value in first:
            raise ValidationError(f"{name}: expected distinct slots among the valid rows, got "
                                  f"{name}[{i}] = {value} = {name}[{first[value]}]")
        first[value] = i


def check_accepted_values(tensors, tokens: int) -> None:
    """Host check of the rollback's accepted counts (check_inputs=True): every entry in [0, T]."""
    accepted = tensors.get("accepted")
    if isinstance(accepted, torch.Tensor):
        check_range("accepted", accepted, 0, tokens + 1, meaning=f" (at most T = {tokens} tokens)")


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


UPDATE_FLOPS_PER_ELEMENT = 5
"""Per state element and token: decay·S, + (dt·x)·B (2) and the S·C product's multiply-add."""


def update_floor(problem: DecodeProblem) -> Cost:
    """The least any state update does, every row valid: read the b rows' states and the
    tokens' x, dt, B, C (and z, D, dt_bias, the slot indices, the seeds and offsets) once; write
    the states, y and the snapshots once. FLOPs: 5 per state element and token
    (UPDATE_FLOPS_PER_ELEMENT), the dt transform per head and token, D and the gate per output;
    no tensor-core work. Stochastic rounding's Philox is integer work, not counted."""
    b, T, h, p, g, n = (problem.batch, problem.tokens, problem.heads, problem.head_dim,
                        problem.groups, problem.state)
    e, edt = element_size(problem.dtype), element_size(problem.dt_dtype)
    state = b * h * p * n * element_size(problem.state_dtype)
    xbytes = b * T * h * p * e
    params = 4 * (h + (h * p if problem.D_per_channel else h) * problem.has_D
                  + h * problem.has_dt_bias)
    read = (state + xbytes * (1 + problem.has_z) + b * T * h * edt
            + 2 * b * T * g * n * element_size(problem.b_dtype)
            + params + 4 * b * problem.has_indices + 16 * b * problem.stochastic)
    written = state + xbytes + (T + 1) * state * problem.has_snapshots
    flops = (UPDATE_FLOPS_PER_ELEMENT * b * T * h * p * n + b * T * h * 12
             + b * T * h * p * (2 * problem.has_D + 5 * problem.has_z))
    return Cost(flops, read, written)


def rollback_floor(problem: RollbackProblem) -> Cost:
    """The least any rollback does, every row valid: read its accepted count, slot and one
    snapshot (h·p·n elements) per row, write the slot's state."""
    row = problem.state_numel * element_size(problem.state_dtype)
    b = problem.batch
    return Cost(0, b * (row + 4 + 4 * problem.has_indices), b * row)
