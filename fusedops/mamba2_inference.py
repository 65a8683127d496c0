"""Mamba2 inference: the recurrent-state update for a batch of cached states (one or T tokens
per row, in place), speculative-decoding snapshots and rollback, and checkpoint replay
(specs/mamba2.md, Inference; docs/mamba2_inference.md).

The dt transform is the scan's (bias, softplus with threshold 20, dt_limit clamp), so a scan over
l tokens and l one-token updates agree. The state is stored as fp32, bf16 or fp16; between the
tokens of one launch it stays fp32 and is written (rounded) every ``checkpoint_period`` tokens
and after the last, to nearest-even or stochastically (unbiased, Philox keyed by a per-row seed
and countered by offset + token), so the same seeds and offsets reproduce every decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ._desc import TensorDesc
from ._plan import EAGER_PLANS, Plan, describe
from ._stream import allocation_stream
from ._tupledict import TupleDict
from .errors import ValidationError
from .mamba2 import _check_dt_limit

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUNDINGS = ("nearest", "stochastic")
_IMPLEMENTATIONS = {"torch": "fusedops.backends.torch.mamba2_inference",
                    "triton": "fusedops.backends.triton.mamba2_inference"}


@dataclass(frozen=True)
class DecodeProblem:
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


class Mamba2StateUpdate(Plan):
    """T >= 1 tokens for a batch of cached Mamba2 states, in place.

    Args (tensors or TensorDescs; all contiguous):
        state: [slots, h, p, n] fp32, bf16 or fp16: the state cache, updated in place.
        x: [b, T, h, p] bf16/fp16/fp32; dt: [b, T, h] x's dtype or fp32; A: [h] fp32;
        B, C: [b, T, g, n] x's dtype; D: [h] or [h, p] fp32; z: [b, T, h, p]; dt_bias: [h] fp32.
        dt_softplus, dt_limit: the scan's dt transform.
        state_batch_indices: [b] int32 slot of each row (default: row i uses slot i); a
            negative index (padding) or one past the cache skips the row: its slot and y rows
            are not touched. Slots of the valid rows must be distinct.
        snapshots: [b, T+1, h, p, n] in the state dtype: the stored state after each prefix of
            the launch (0 = the initial state), for rollback after speculative decoding.
        rounding: "nearest" or "stochastic" (bf16/fp16 states); checkpoint_period: the state is
            written (rounded) after every checkpoint_period-th token and after the last one.

    execute(state, x, dt, A, B, C, y, ...) writes y [b, T, h, p] (x's dtype), the state and the
    snapshots. Stochastic rounding takes rng_seed and rng_offset, int64 [b] device tensors: token
    t (1-based) of the launch draws from counter rng_offset + t, so successive launches advance
    the offset by their T, and a replay with the same seeds and offsets repeats every decision.
    """

    op_name = "mamba2_state_update"
    implementations = _IMPLEMENTATIONS

    def __init__(self, state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                 dt_softplus: bool = False, dt_limit=(0.0, math.inf), state_batch_indices=None,
                 snapshots=None, rounding: str = "nearest", checkpoint_period: int = 1,
                 backend: str = "auto") -> None:
        super().__init__(backend)
        x = self._declare("x", x)
        expect_ndim("x", x, 4, "[b, T, h, p]")
        expect_dtype("x", x, ACTIVATION_DTYPES)
        b, T, h, p = x.shape
        if min(b, T, h, p) < 1:
            raise ValidationError(f"x: expected b, T, h, p >= 1 in [b, T, h, p], got {list(x.shape)}")
        state = self._declare("state", state)
        expect_ndim("state", state, 4, "[slots, h, p, n]")
        expect_dtype("state", state, STATE_DTYPES)
        slots, n = state.shape[0], state.shape[3]
        if state.shape[1:3] != (h, p) or n < 1 or slots < 1:
            raise ValidationError(f"state: expected shape [slots, h, p, n] with h = {h}, p = {p}, got "
                                  f"{list(state.shape)}")
        dt = self._declare("dt", dt)
        expect_dtype("dt", dt, (x.dtype,) if x.dtype == torch.float32 else (x.dtype, torch.float32))
        expect_shape("dt", dt, (b, T, h), "[b, T, h]")
        A = self._declare("A", A)
        expect_dtype("A", A, (torch.float32,))
        expect_shape("A", A, (h,), "[h]")
        B = self._declare("B", B)
        expect_dtype("B", B, (x.dtype,))
        expect_ndim("B", B, 4, "[b, T, g, n]")
        g = B.shape[2]
        if B.shape[:2] != (b, T) or B.shape[3] != n or g < 1 or h % g:
            raise ValidationError(f"B: expected shape [b, T, g, n] = [{b}, {T}, g, {n}] with g dividing "
                                  f"h = {h}, got {list(B.shape)}")
        C = self._declare("C", C)
        expect_dtype("C", C, (x.dtype,))
        expect_shape("C", C, (b, T, g, n), "[b, T, g, n] like B")
        if D is not None:
            D = self._declare("D", D)
            expect_dtype("D", D, (torch.float32,))
            if tuple(D.shape) not in ((h,), (h, p)):
                raise ValidationError(f"D: expected shape [h] = [{h}] or [h, p] = [{h}, {p}], got {list(D.shape)}")
        if z is not None:
            expect_shape("z", self._declare("z", z), (b, T, h, p), "[b, T, h, p] like x")
            expect_dtype("z", self._descs["z"], (x.dtype,))
        if dt_bias is not None:
            expect_dtype("dt_bias", self._declare("dt_bias", dt_bias), (torch.float32,))
            expect_shape("dt_bias", self._descs["dt_bias"], (h,), "[h]")
        if state_batch_indices is not None:
            idx = self._declare("state_batch_indices", state_batch_indices, alignment=4)
            expect_dtype("state_batch_indices", idx, (torch.int32,))
            expect_shape("state_batch_indices", idx, (b,), "[b]")
        elif slots < b:
            raise ValidationError(f"state: expected at least b = {b} slots without "
                                  f"state_batch_indices, got {slots}")
        if snapshots is not None:
            snap = self._declare("snapshots", snapshots)
            expect_dtype("snapshots", snap, (state.dtype,))
            expect_shape("snapshots", snap, (b, T + 1, h, p, n), "[b, T+1, h, p, n]")
        if rounding not in ROUNDINGS:
            raise ValidationError(f"rounding: expected 'nearest' or 'stochastic', got {rounding!r}")
        if rounding == "stochastic" and state.dtype == torch.float32:
            raise ValidationError("rounding: 'stochastic' needs a bf16 or fp16 state; an fp32 state "
                                  "is stored exactly")
        if not isinstance(checkpoint_period, int) or isinstance(checkpoint_period, bool) or checkpoint_period < 1:
            raise ValidationError(f"checkpoint_period: expected an int >= 1, got {checkpoint_period!r}")
        if not isinstance(dt_softplus, bool):
            raise ValidationError(f"dt_softplus: expected a bool, got {dt_softplus!r}")
        lo, hi = _check_dt_limit(dt_limit)
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        stochastic = rounding == "stochastic"
        if stochastic:
            for name in ("rng_seed", "rng_offset"):
                self._declare_output(name, (b,), torch.int64, alignment=8)
        self._rng_names = ("rng_seed", "rng_offset") if stochastic else ()
        self._declare_output("y", (b, T, h, p), x.dtype)
        self.problem = DecodeProblem(x.dtype, dt.dtype, state.dtype, b, T, slots, h, p, g, n,
                                     D is not None, D is not None and D.ndim == 2, z is not None,
                                     dt_bias is not None, dt_softplus, (lo, hi),
                                     state_batch_indices is not None, snapshots is not None,
                                     stochastic, checkpoint_period, self.device)
        self._select_backend(self.problem)

    def _build_launcher(self):
        return self._impl.update_launcher(self.problem)

    def execute(self, state, x, dt, A, B, C, y, *, D=None, z=None, dt_bias=None,
                state_batch_indices=None, snapshots=None, rng_seed=None, rng_offset=None,
                current_stream=None) -> TupleDict:
        """Runs the update; returns TupleDict(y[, snapshots])."""
        inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                      state_batch_indices=state_batch_indices, rng_seed=rng_seed,
                      rng_offset=rng_offset)
        outputs = dict(state=state, y=y, snapshots=snapshots)
        stream = self._prepare_execute(inputs, outputs, None, current_stream)
        self._run(dict(inputs, **outputs), stream=stream)
        return TupleDict(y=y, snapshots=snapshots) if snapshots is not None else TupleDict(y=y)


class Mamba2StateRollback(Plan):
    """After speculative decoding: state[slot_i] = snapshots[i, accepted[i]], the state after
    the accepted prefix of row i (0 accepted: the state before the launch).

    Args: state [slots, h, p, n]; snapshots [b, T+1, h, p, n] (state's dtype, from
    Mamba2StateUpdate); accepted [b] int32 on the device (no host synchronisation); optional
    state_batch_indices [b] int32 (negative: skip). Rows with accepted outside [0, T] are skipped.
    """

    op_name = "mamba2_state_rollback"
    implementations = _IMPLEMENTATIONS

    def __init__(self, state, snapshots, accepted, *, state_batch_indices=None,
                 backend: str = "auto") -> None:
        super().__init__(backend)
        state = self._declare("state", state)
        expect_ndim("state", state, 4, "[slots, h, p, n]")
        expect_dtype("state", state, STATE_DTYPES)
        snap = self._declare("snapshots", snapshots)
        expect_ndim("snapshots", snap, 5, "[b, T+1, h, p, n]")
        expect_dtype("snapshots", snap, (state.dtype,))
        b = snap.shape[0]
        if snap.shape[2:] != state.shape[1:] or snap.shape[1] < 1:
            raise ValidationError(f"snapshots: expected shape [b, T+1, h, p, n] with [h, p, n] = "
                                  f"{list(state.shape[1:])}, got {list(snap.shape)}")
        acc = self._declare("accepted", accepted, alignment=4)
        expect_dtype("accepted", acc, (torch.int32,))
        expect_shape("accepted", acc, (b,), "[b]")
        if state_batch_indices is not None:
            idx = self._declare("state_batch_indices", state_batch_indices, alignment=4)
            expect_dtype("state_batch_indices", idx, (torch.int32,))
            expect_shape("state_batch_indices", idx, (b,), "[b]")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        self.problem = RollbackProblem(state.dtype, b, snap.shape[1] - 1, state.shape[0],
                                       state.shape[1] * state.shape[2] * state.shape[3],
                                       state_batch_indices is not None, self.device)
        self._select_backend(self.problem)

    def _build_launcher(self):
        return self._impl.rollback_launcher(self.problem)

    def execute(self, state, snapshots, accepted, *, state_batch_indices=None,
                current_stream=None) -> torch.Tensor:
        inputs = dict(snapshots=snapshots, accepted=accepted, state_batch_indices=state_batch_indices)
        stream = self._prepare_execute(inputs, dict(state=state), None, current_stream)
        self._run(dict(inputs, state=state), stream=stream)
        return state


@dataclass(frozen=True)
class RollbackProblem:
    state_dtype: torch.dtype
    batch: int
    tokens: int
    slots: int
    state_numel: int
    has_indices: bool
    device: torch.device


def _rng_tensor(name, value, b, device):
    if value is None:
        raise ValidationError(f"{name}: rounding='stochastic' needs a seed and an offset per row")
    if isinstance(value, torch.Tensor):
        return value
    return torch.full((b,), int(value), dtype=torch.int64, device=device)


def mamba2_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                        dt_softplus: bool = False, dt_limit=(0.0, math.inf),
                        state_batch_indices=None, rounding: str = "nearest",
                        checkpoint_period: int = 1, rng_seed=None, rng_offset=None,
                        return_snapshots: bool = False, backend: str = "auto",
                        current_stream=None) -> TupleDict:
    """Eager update, in place on ``state``. x may be [b, h, p] (one token; dt [b, h], B and C
    [b, g, n], z [b, h, p], and y comes back [b, h, p]) or [b, T, h, p]. rng_seed/rng_offset: ints
    or int64 [b] tensors. Returns TupleDict(y[, snapshots])."""
    single = x.dim() == 3
    if single:
        x, dt, B, C = x[:, None], dt[:, None], B[:, None], C[:, None]
        z = z[:, None] if z is not None else None
    b, T = x.shape[:2]
    snap_desc = (TensorDesc((b, T + 1, *state.shape[1:]), state.dtype, device=state.device)
                 if return_snapshots else None)
    optional = dict(D=D, z=z, dt_bias=dt_bias, state_batch_indices=state_batch_indices)
    plan = EAGER_PLANS.get(Mamba2StateUpdate, describe(state), describe(x), describe(dt), describe(A),
                           describe(B), describe(C), **{k: describe(v) for k, v in optional.items()},
                           snapshots=snap_desc, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                           rounding=rounding, checkpoint_period=checkpoint_period, backend=backend)
    with allocation_stream(current_stream, plan.device):
        y = torch.empty(plan.desc("y").shape, dtype=x.dtype, device=x.device)
        snapshots = (torch.empty(snap_desc.shape, dtype=state.dtype, device=state.device)
                     if return_snapshots else None)
        rng = {}
        if rounding == "stochastic":
            rng = dict(rng_seed=_rng_tensor("rng_seed", rng_seed, b, x.device),
                       rng_offset=_rng_tensor("rng_offset", rng_offset, b, x.device))
    res = plan.execute(state, x, dt, A, B, C, y, **optional, snapshots=snapshots, **rng,
                       current_stream=current_stream)
    if single:
        return TupleDict(y=y[:, 0], **({"snapshots": snapshots} if return_snapshots else {}))
    return res


def mamba2_replay(checkpoint, x, dt, A, B, C, **options) -> TupleDict:
    """Recovers a state from an older checkpoint and the prepared inputs consumed since then:
    runs the same update on a copy of ``checkpoint`` (x, dt, B, C, z as they were fed, with the
    same options, seeds and offsets). Returns TupleDict(state, y), bit for bit the state and the
    outputs of the original run."""
    state = checkpoint.clone()
    y = mamba2_state_update(state, x, dt, A, B, C, **options)["y"]
    return TupleDict(state=state, y=y)


def mamba2_rollback(state, snapshots, accepted, *, state_batch_indices=None, backend: str = "auto",
                    current_stream=None) -> torch.Tensor:
    """Eager rollback (see Mamba2StateRollback); returns ``state``."""
    plan = EAGER_PLANS.get(Mamba2StateRollback, describe(state), describe(snapshots),
                           describe(accepted), state_batch_indices=describe(state_batch_indices),
                           backend=backend)
    return plan.execute(state, snapshots, accepted, state_batch_indices=state_batch_indices,
                        current_stream=current_stream)
