"""Mamba2 inference: the recurrent-state update for a batch of cached states (one or T tokens
per row, in place), speculative-decoding snapshots and rollback, and checkpoint replay (the
math and the storage policies: ``contract``, docs/mamba2_inference.md)."""

from __future__ import annotations

import numbers

import torch

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.desc import TensorDesc
from ..core.options import Option, expect_bool, expect_int
from ..core.stream import allocation_stream
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan.layouts import check_activation_layouts
from ..plan import Plan, indices, inputs, outputs, status_word, updated
from .contract import (ACTIVATION_DTYPES, DEFAULT_DT_LIMIT, RNG_DTYPE, DecodeProblem,
                       RollbackProblem, check_accepted_values, check_dt, check_gate, check_heads,
                       check_slot_indices, check_slot_values, check_state, check_status,
                       expect_dt_limit, expect_rounding, rollback_floor, update_floor)


def _period(name: str, value) -> int:
    return expect_int(name, value, minimum=1)


class Mamba2StateUpdate(Plan):
    """T >= 1 tokens for a batch of cached Mamba2 states, in place.

    Args (tensors or TensorDescs; the state, parameters and index data contiguous):
        state: [slots, h, p, n] fp32, bf16 or fp16: the state cache, updated in place.
        x: [b, T, h, p] bf16/fp16/fp32; dt: [b, T, h] x's dtype or fp32; A: [h] fp32;
        B, C: [b, T, g, n] x's dtype, or both fp32 with 16-bit x (read as they are); D: [h] or
        [h, p] fp32; z: [b, T, h, p] x's dtype; dt_bias: [h] fp32. x, dt, B, C, z and y may be
        views (last dimension contiguous, other strides multiples of 16 bytes) when their rows
        (p, h or n elements) are whole 16-byte vectors, else contiguous.
        dt_softplus, dt_limit: the scan's dt transform.
        state_batch_indices: [b] int32 slot of each row (default: row i uses slot i); a
            negative index (padding) or one past the cache (Status.SLOT_INDEX) skips the row:
            no slot is touched, its y rows and snapshots are written as 0. Slots of the valid
            rows must be distinct.
        snapshots: [b, T+1, h, p, n] in the state dtype (an output, declared here): the stored
            state after each prefix of the launch (0 = the initial state), for rollback after
            speculative decoding.
        rounding: "nearest" or "stochastic" (bf16/fp16 states); checkpoint_period: the state is
            written (rounded) after every checkpoint_period-th token and after the last one.
        status: optional int32 [1] status word (fusedops.core.status), ORed into, never
            cleared.

    execute(state, x, dt, A, B, C, y, ...) writes y [b, T, h, p] (x's dtype), the state and the
    snapshots; returns TupleDict(y[, snapshots]). Stochastic rounding reads rng_seed and
    rng_offset, int64 [b] device tensors the plan sizes itself: token t (1-based) of the launch
    draws from counter rng_offset + t, so successive launches advance the offset by their T, and
    a replay with the same seeds and offsets repeats every decision. No workspace.
    """

    op_name = "mamba2_state_update"
    backend_module = "mamba2_inference.program"
    program_name = "update"
    backends = ("torch", "triton")
    operands = (*updated("state"), *inputs("x", "dt", strided=True), *inputs("A"),
                *inputs("B", "C", strided=True), *outputs("y", strided=True),
                *inputs("D", optional=True), *inputs("z", optional=True, strided=True),
                *inputs("dt_bias", optional=True),
                *indices("state_batch_indices", optional=True),
                *outputs("snapshots", optional=True),
                *inputs("rng_seed", "rng_offset", optional=True, alignment=8), *status_word())
    options = (Option("dt_softplus", expect_bool, False),
               Option("dt_limit", expect_dt_limit, DEFAULT_DT_LIMIT),
               Option("rounding", expect_rounding, "nearest"),
               Option("checkpoint_period", _period, 1))
    returns = ("y", "snapshots")

    def __init__(self, state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                 dt_softplus: bool = False, dt_limit=DEFAULT_DT_LIMIT, state_batch_indices=None,
                 snapshots=None, rounding: str = "nearest", checkpoint_period: int = 1,
                 status=None, backend: str = "auto") -> None:
        super().__init__(dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                              state_batch_indices=state_batch_indices, snapshots=snapshots,
                              status=status),
                         dict(dt_softplus=dt_softplus, dt_limit=dt_limit, rounding=rounding,
                              checkpoint_period=checkpoint_period), backend)

    def _validate(self, descs, *, dt_softplus, dt_limit, rounding, checkpoint_period) -> DecodeProblem:
        x = descs["x"]
        expect_ndim("x", x, 4, "[b, T, h, p]")
        expect_dtype("x", x, ACTIVATION_DTYPES)
        b, T, h, p = x.shape
        if min(b, T, h, p) < 1:
            raise ValidationError(f"x: expected b, T, h, p >= 1 in [b, T, h, p], got {list(x.shape)}")
        state = check_state(descs)
        slots, n = state.shape[0], state.shape[3]
        if state.shape[1:3] != (h, p) or n < 1 or slots < 1:
            raise ValidationError(f"state: expected shape [slots, h, p, n] with h = {h}, p = {p}, got "
                                  f"{list(state.shape)}")
        check_dt(descs, x, (b, T, h), "[b, T, h]")
        B = descs["B"]
        expect_dtype("B", B, (x.dtype,) if x.dtype == torch.float32 else (x.dtype, torch.float32))
        expect_ndim("B", B, 4, "[b, T, g, n]")
        g = B.shape[2]
        if B.shape[:2] != (b, T) or B.shape[3] != n or g < 1 or h % g:
            raise ValidationError(f"B: expected shape [b, T, g, n] = [{b}, {T}, g, {n}] with g dividing "
                                  f"h = {h}, got {list(B.shape)}")
        expect_dtype("C", descs["C"], (B.dtype,))
        expect_shape("C", descs["C"], (b, T, g, n), "[b, T, g, n] like B")
        check_heads(descs, h, p, torch.float32)
        check_gate(descs, x, "[b, T, h, p] like x")
        check_slot_indices(descs, b)
        if "state_batch_indices" not in descs and slots < b:
            raise ValidationError(f"state: expected at least b = {b} slots without "
                                  f"state_batch_indices, got {slots}")
        if "snapshots" in descs:
            expect_dtype("snapshots", descs["snapshots"], (state.dtype,))
            expect_shape("snapshots", descs["snapshots"], (b, T + 1, h, p, n), "[b, T+1, h, p, n]")
        stochastic = rounding == "stochastic"
        if stochastic and state.dtype == torch.float32:
            raise ValidationError("rounding: 'stochastic' needs a bf16 or fp16 state; an fp32 state "
                                  "is stored exactly")
        has_status = check_status(descs)
        if stochastic:
            for name in ("rng_seed", "rng_offset"):
                self._plan_tensor(name, (b,), RNG_DTYPE)
        self._plan_tensor("y", (b, T, h, p), x.dtype)
        D = descs.get("D")
        problem = DecodeProblem(x.dtype, descs["dt"].dtype, state.dtype, b, T, slots, h, p, g, n,
                                D is not None, D is not None and D.ndim == 2, "z" in descs,
                                "dt_bias" in descs, dt_softplus, dt_limit,
                                "state_batch_indices" in descs, "snapshots" in descs, stochastic,
                                checkpoint_period, self.device, has_status,
                                None if B.dtype == x.dtype else B.dtype)
        check_activation_layouts(self, descs, {**dict.fromkeys(("x", "z", "y"), problem.vector),
                                    **dict.fromkeys(("B", "C"), problem.bc_vector),
                                    "dt": problem.dt_vector})
        return problem

    def _check_index_values(self, tensors) -> None:
        """state_batch_indices: negative (padding) or in [0, slots), valid slots distinct."""
        check_slot_values(tensors, self.problem.slots)

    def floor(self):
        """``contract.update_floor``: states, tokens and parameters read once, states, y and
        snapshots written once."""
        return update_floor(self.problem)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Distinct valid slots for the rows (every b-th slot of a shuffled pool)."""
        return _distinct_slots(self.problem, self.device)

    def execute(self, state, x, dt, A, B, C, y, *, D=None, z=None, dt_bias=None,
                state_batch_indices=None, snapshots=None, rng_seed=None, rng_offset=None,
                status=None, workspace=None, current_stream=None) -> TupleDict:
        """Runs the update (in place on ``state``); returns TupleDict(y[, snapshots])."""
        return self._execute(dict(state=state, x=x, dt=dt, A=A, B=B, C=C, y=y, D=D, z=z,
                                  dt_bias=dt_bias, state_batch_indices=state_batch_indices,
                                  snapshots=snapshots, rng_seed=rng_seed, rng_offset=rng_offset,
                                  status=status, workspace=workspace,
                                  current_stream=current_stream))


class Mamba2StateRollback(Plan):
    """After speculative decoding: state[slot_i] = snapshots[i, accepted[i]], the state after
    the accepted prefix of row i (0 accepted: the state before the launch).

    Args: state [slots, h, p, n] (updated in place); snapshots [b, T+1, h, p, n] (state's dtype,
    from Mamba2StateUpdate); accepted [b] int32 on the device (no host synchronisation); optional
    state_batch_indices [b] int32 (negative: padding, skipped; without it row i uses slot i and
    the cache needs at least b slots). Rows with accepted outside [0, T]
    (Status.ACCEPTED_COUNT) or a slot past the cache (Status.SLOT_INDEX) are skipped: their slots
    are unchanged. ``status``: the optional int32 [1] status word. execute() returns ``state``.
    No workspace.
    """

    op_name = "mamba2_state_rollback"
    backend_module = "mamba2_inference.program"
    program_name = "rollback"
    backends = ("torch", "triton")
    operands = (*updated("state"), *inputs("snapshots"), *indices("accepted"),
                *indices("state_batch_indices", optional=True), *status_word())
    returns = ("state",)

    def __init__(self, state, snapshots, accepted, *, state_batch_indices=None, status=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(state=state, snapshots=snapshots, accepted=accepted,
                              state_batch_indices=state_batch_indices, status=status), {}, backend)

    def _validate(self, descs) -> RollbackProblem:
        state = check_state(descs)
        snap = descs["snapshots"]
        expect_ndim("snapshots", snap, 5, "[b, T+1, h, p, n]")
        expect_dtype("snapshots", snap, (state.dtype,))
        b = snap.shape[0]
        if snap.shape[2:] != state.shape[1:] or snap.shape[1] < 1:
            raise ValidationError(f"snapshots: expected shape [b, T+1, h, p, n] with [h, p, n] = "
                                  f"{list(state.shape[1:])}, got {list(snap.shape)}")
        expect_dtype("accepted", descs["accepted"], (torch.int32,))
        expect_shape("accepted", descs["accepted"], (b,), "[b]")
        check_slot_indices(descs, b)
        if "state_batch_indices" not in descs and state.shape[0] < b:
            raise ValidationError(f"state: expected at least b = {b} slots without "
                                  f"state_batch_indices, got {state.shape[0]}")
        has_status = check_status(descs)
        for name, desc in descs.items():
            expect_contiguous(name, desc)
        return RollbackProblem(state.dtype, b, snap.shape[1] - 1, state.shape[0],
                               state.shape[1] * state.shape[2] * state.shape[3],
                               "state_batch_indices" in descs, self.device, has_status)

    def _check_index_values(self, tensors) -> None:
        """accepted in [0, T]; state_batch_indices negative (padding) or in [0, slots), valid
        slots distinct."""
        check_accepted_values(tensors, self.problem.tokens)
        check_slot_values(tensors, self.problem.slots)

    def floor(self):
        """``contract.rollback_floor``: one snapshot read and one state written per row."""
        return rollback_floor(self.problem)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Distinct valid slots and accepted counts in [0, T] (row i accepts i mod (T + 1))."""
        b, T = self.problem.batch, self.problem.tokens
        accepted = (torch.arange(b) % (T + 1)).to(device=self.device, dtype=torch.int32)
        return dict(_distinct_slots(self.problem, self.device), accepted=accepted)

    def _result(self, binding) -> torch.Tensor:
        return binding["state"]

    def execute(self, state, snapshots, accepted, *, state_batch_indices=None, status=None,
                workspace=None, current_stream=None) -> torch.Tensor:
        """Restores the accepted snapshot of every row into its slot; returns ``state``."""
        return self._execute(dict(state=state, snapshots=snapshots, accepted=accepted,
                                  state_batch_indices=state_batch_indices, status=status,
                                  workspace=workspace, current_stream=current_stream))


def _distinct_slots(problem, device) -> dict[str, torch.Tensor]:
    """state_batch_indices for timing: b distinct slots of the cache (a fixed permutation; rows
    beyond a smaller cache are padding, -1), or nothing without indices."""
    if not problem.has_indices:
        return {}
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(problem.slots, generator=gen)[:problem.batch]
    slots = torch.cat([slots, torch.full((problem.batch - len(slots),), -1, dtype=slots.dtype)])
    return dict(state_batch_indices=slots.to(device=device, dtype=torch.int32))


def _rng_tensor(name, value, b, device):
    if value is None:
        raise ValidationError(f"{name}: rounding='stochastic' needs a seed and an offset per row")
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValidationError(f"{name}: expected an int or an int64 [b] tensor, got {value!r}")
    return torch.full((b,), int(value), dtype=RNG_DTYPE, device=device)


def mamba2_state_update(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                        dt_softplus: bool = False, dt_limit=DEFAULT_DT_LIMIT,
                        state_batch_indices=None, rounding: str = "nearest",
                        checkpoint_period: int = 1, rng_seed=None, rng_offset=None,
                        return_snapshots: bool = False, status=None, backend: str = "auto",
                        current_stream=None, check_inputs: bool | None = None) -> TupleDict:
    """Eager update, in place on ``state``. x may be [b, h, p] (one token; dt [b, h], B and C
    [b, g, n], z [b, h, p], and y comes back [b, h, p]) or [b, T, h, p]; x, dt, B, C and z may
    be views (see Mamba2StateUpdate), B and C fp32 with 16-bit x. rng_seed/rng_offset: ints
    or int64 [b] tensors. Returns TupleDict(y[, snapshots]); snapshots (return_snapshots=True)
    [b, T+1, h, p, n] in the state dtype. ``status``: the optional status word;
    ``check_inputs`` (default: FUSEDOPS_CHECK_INPUTS) checks state_batch_indices on the host
    first (a synchronisation)."""
    options = Mamba2StateUpdate.normalise_options(
        dict(dt_softplus=dt_softplus, dt_limit=dt_limit, rounding=rounding,
             checkpoint_period=checkpoint_period))
    return_snapshots = expect_bool("return_snapshots", return_snapshots)
    if not isinstance(x, torch.Tensor):
        raise ValidationError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    single = x.dim() == 3
    if single:
        x, dt, B, C = x[:, None], dt[:, None], B[:, None], C[:, None]
        z = z[:, None] if z is not None else None
    b, T = x.shape[:2]
    snapshots = (TensorDesc((b, T + 1, *state.shape[1:]), state.dtype, device=state.device)
                 if return_snapshots else None)
    rng = {}
    if options["rounding"] == "stochastic":
        with allocation_stream(current_stream, x.device):
            rng = dict(rng_seed=_rng_tensor("rng_seed", rng_seed, b, x.device),
                       rng_offset=_rng_tensor("rng_offset", rng_offset, b, x.device))
    result = Mamba2StateUpdate.eager(
        dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
             state_batch_indices=state_batch_indices, snapshots=snapshots, status=status, **rng),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs, **options)
    if single:
        return TupleDict(y=result["y"][:, 0], **({"snapshots": result["snapshots"]}
                                                 if return_snapshots else {}))
    return result


def mamba2_replay(checkpoint, x, dt, A, B, C, **options) -> TupleDict:
    """Recovers a state from an older checkpoint and the prepared inputs consumed since then:
    runs the same update on a copy of ``checkpoint`` (x, dt, B, C, z as they were fed, with the
    same options, seeds and offsets). Returns TupleDict(state, y), bit for bit the state and the
    outputs of the original run."""
    state = checkpoint.clone()
    y = mamba2_state_update(state, x, dt, A, B, C, **options)["y"]
    return TupleDict(state=state, y=y)


def mamba2_rollback(state, snapshots, accepted, *, state_batch_indices=None, status=None,
                    backend: str = "auto", current_stream=None,
                    check_inputs: bool | None = None) -> torch.Tensor:
    """Eager rollback (see Mamba2StateRollback); returns ``state``. ``status``: the optional
    status word; ``check_inputs`` (default: FUSEDOPS_CHECK_INPUTS) checks accepted and
    state_batch_indices on the host first (a synchronisation)."""
    return Mamba2StateRollback.eager(
        dict(state=state, snapshots=snapshots, accepted=accepted,
             state_batch_indices=state_batch_indices, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs)
