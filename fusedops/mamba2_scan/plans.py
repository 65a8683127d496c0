"""Mamba2 chunked selective scan (SSD): training forward and backward plans and eager wrappers
(the math: ``contract``, docs/mamba2_scan.md).

The names follow mamba_ssm's ``mamba_chunk_scan_combined``; the plans add caller-owned outputs,
saved state and workspace.
"""

from __future__ import annotations

from functools import partial

import torch

from ..core.checks import expect_dtype, expect_ndim, expect_shape
from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype, dtype_name
from ..core.options import Option, expect_bool, expect_dtype_choice, optional
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, indices, inputs, outputs, saved_buffer, status_word
from ..plan.layouts import check_activation_layouts
from .contract import (ACTIVATION_DTYPES, DEFAULT_CHUNK_SIZE, DEFAULT_DT_LIMIT, ScanProblem,
                       backward_floor, check_cu_seqlens_values, check_dt, check_gate, check_heads,
                       check_seq_idx, check_seq_idx_values, check_status, expect_chunk_size,
                       expect_dt_limit, forward_floor)

_OPTIONAL = ("D", "z", "dt_bias", "initial_states")
_PER_P = ("x", "z", "y", "dy", "dx", "dz")            # rows of p elements
_PER_N = ("B", "C", "dB", "dC")                       # rows of n elements
_PER_H = ("dt", "ddt")                                # rows of h elements


def scan_vectors(problem) -> dict[str, int]:
    """The stride unit (``row_vector``) of every activation operand of a scan plan."""
    return {**dict.fromkeys(_PER_P, problem.vector), **dict.fromkeys(_PER_N, problem.bc_vector),
            **dict.fromkeys(_PER_H, problem.dt_vector)}
_GRAD_OF = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
            "dt_bias": "ddt_bias", "initial_states": "dinitial_states"}
_SCAN_OPTIONS = (Option("chunk_size", expect_chunk_size, DEFAULT_CHUNK_SIZE),
                 Option("dt_softplus", expect_bool, False),
                 Option("dt_limit", expect_dt_limit, DEFAULT_DT_LIMIT),
                 Option("recompute_states", expect_bool, False),
                 Option("state_dtype", optional(partial(expect_dtype_choice, choices=ACTIVATION_DTYPES)),
                        None))


def resolve_state_dtype(x_dtype: torch.dtype, state_dtype: torch.dtype | None) -> torch.dtype:
    """The passed states' dtype: ``state_dtype``, which must be x's dtype or its accumulator
    dtype (fp32 for bf16/fp16 x); None: x's dtype."""
    allowed = tuple(dict.fromkeys((x_dtype, accumulator_dtype(x_dtype))))
    if state_dtype is None:
        return x_dtype
    if state_dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        raise ValidationError(f"state_dtype: expected None, {names} for x of dtype "
                              f"{dtype_name(x_dtype)}, got {state_dtype}")
    return state_dtype


class _ScanPlan(Plan):
    backend_module = "mamba2_scan.program"
    backends = ("torch", "triton")

    def _validate_scan(self, descs) -> dict:
        """The checks both plans share; returns the ScanProblem fields of the inputs."""
        x = descs["x"]
        expect_ndim("x", x, 4, "[b, l, h, p]")
        expect_dtype("x", x, ACTIVATION_DTYPES)
        b, l, h, p = x.shape
        if min(b, l, h, p) < 1:
            raise ValidationError(f"x: expected b, l, h, p >= 1 in [b, l, h, p], got {list(x.shape)}")
        param = accumulator_dtype(x.dtype)
        check_dt(descs, x, (b, l, h), "[b, l, h]")
        B = descs["B"]
        expect_ndim("B", B, 4, "[b, l, g, n]")
        expect_dtype("B", B, (x.dtype,))
        g, n = B.shape[2], B.shape[3]
        if B.shape[:2] != (b, l) or g < 1 or n < 1 or h % g:
            raise ValidationError(
                f"B: expected shape [b, l, g, n] with b = {b}, l = {l}, g >= 1 dividing h = {h} and "
                f"n >= 1, got {list(B.shape)}")
        expect_dtype("C", descs["C"], (x.dtype,))
        expect_shape("C", descs["C"], (b, l, g, n), "[b, l, g, n] like B")
        check_heads(descs, h, p, param)
        check_gate(descs, x, "[b, l, h, p] like x")
        nseq = None
        if "cu_seqlens" in descs:
            cu = descs["cu_seqlens"]
            expect_dtype("cu_seqlens", cu, (torch.int32,))
            expect_ndim("cu_seqlens", cu, 1, "[nseq + 1]")
            if cu.shape[0] < 2:
                raise ValidationError(f"cu_seqlens: expected [nseq + 1] with nseq >= 1, got {list(cu.shape)}")
            if b != 1:
                raise ValidationError(f"x: expected b == 1 with cu_seqlens (packed sequences), got b = {b}")
            nseq = cu.shape[0] - 1
        seqs = b if nseq is None else nseq
        if "initial_states" in descs:
            h0 = descs["initial_states"]
            expect_dtype("initial_states", h0, (param,))
            expect_shape("initial_states", h0, (seqs, h, p, n),
                         "[nseq, h, p, n]" if nseq is not None else "[b, h, p, n]")
        has_status = check_status(descs)
        has_seq_idx = check_seq_idx(descs, b, l, "[b, l] like x's first two dims")
        D = descs.get("D")
        return dict(dtype=x.dtype, dt_dtype=descs["dt"].dtype, batch=b, length=l, heads=h,
                    head_dim=p, groups=g, state=n, num_sequences=nseq, has_D=D is not None,
                    D_per_channel=D is not None and D.ndim == 2, has_z="z" in descs,
                    has_dt_bias="dt_bias" in descs, has_initial_states="initial_states" in descs,
                    device=self.device, has_status=has_status, has_seq_idx=has_seq_idx)

    def _check_index_values(self, tensors) -> None:
        """cu_seqlens starts at 0, never decreases and ends at most at the l packed tokens;
        seq_idx is non-negative and non-decreasing along every row."""
        check_cu_seqlens_values(tensors, self.problem.length)
        check_seq_idx_values(tensors)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Packed sequences: valid cu_seqlens, the l tokens split as evenly as possible over the
        nseq sequences (the split the cost model assumes)."""
        if self.problem.num_sequences is None:
            return {}
        nseq, total = self.problem.num_sequences, self.problem.length
        cu = torch.arange(nseq + 1, dtype=torch.int64) * total // nseq
        return dict(cu_seqlens=cu.to(device=self.device, dtype=torch.int32))

    @property
    def saved_states_bytes(self) -> int:
        """Bytes the saved segment-start states take (0 with recompute_states=True):
        max_segments·h·p·n times state_dtype's size. With recompute_states=True the backward recomputes them instead."""
        return 0 if self.problem.recompute_states else self.problem.states_bytes


class Mamba2ChunkScanForward(_ScanPlan):
    """Forward plan of the Mamba2 chunked scan.

    Args (tensors or TensorDescs; parameters, states and index data contiguous):
        x: [b, l, h, p] bf16/fp16/fp32 (float64: reference precision, torch backend only).
            x, z, dt, B, C and y may be views (slices of the in-projection or conv output) with
            their last dimension contiguous and the other strides multiples of 16 bytes, when
            a row (p, h or n elements) is a whole number of 16-byte vectors (else contiguous).
        dt: [b, l, h], x's dtype or fp32: raw time steps (bias, softplus and clamp applied here).
        A: [h] fp32 (negative). B, C: [b, l, g, n], x's dtype; head i uses group i // (h / g).
        chunk_size: 16, 32, 64, 128 or 256 tokens per segment.
        D: [h] or [h, p] fp32. z: [b, l, h, p] gate, x's dtype. dt_bias: [h] fp32.
        dt_softplus, dt_limit=(lo, hi): the dt transform (softplus threshold 20; the clamp).
        initial_states: [nseq, h, p, n] fp32 (nseq = b, or len(cu_seqlens) - 1).
        cu_seqlens: [nseq + 1] int32 packed-sequence boundaries (b must be 1); every sequence
            starts from its initial state (or zero) and none mixes with another. Any values are
            memory-safe: the kernels use the sanitised offsets (contract; tokens no sequence
            covers get y = 0) and report Status.CU_SEQLENS into ``status``.
        seq_idx: [b, l] int32 sequence ids (mamba_ssm's convention; not with cu_seqlens): the
            state restarts wherever the id changes along a row, initial_states[r] enters only
            a leading run of id 0, final_states[r] is the state after the row's last token.
            Valid ids are non-negative and non-decreasing along a row; any values are
            memory-safe (the rule applies to whatever they hold) and a row that decreases or
            holds a negative id reports Status.SEQ_IDX.
        recompute_states: do not save the segment-start states (saved_states_bytes); the
            backward recomputes them.
        state_dtype: the dtype the state entering every segment is passed and saved in: None
            (x's dtype, as mamba_ssm passes them) or fp32 for bf16/fp16 x. The state carried
            along a sequence stays fp32 (final_states, segment_states are exact); only the
            copies the output and the backward read are rounded (docs/mamba2_scan.md, Numerics).
        segment_states: an optional output [b·ceil(l / chunk_size), h, p, n] fp32 (not with
            cu_seqlens), declared here: the state entering every segment, row by row (mamba_ssm's
            chunk states, from which its varlen states are computed).
        status: optional int32 [1] status word (fusedops.core.status), ORed into, never
            cleared.

    execute(x, dt, A, B, C, y, final_states, saved, ...) writes y [b, l, h, p] (x's dtype),
    final_states [nseq, h, p, n] fp32 and ``saved`` (``saved_size`` bytes, for the backward:
    the segment-start states unless recomputed, and y before the z gate when z is given).
    Optional inputs are passed by keyword, exactly those the plan was built with.
    """

    op_name = "mamba2_chunk_scan_forward"
    program_name = "forward"
    operands = (*inputs("x", "dt", strided=True), *inputs("A"), *inputs("B", "C", strided=True),
                *outputs("y", strided=True), *outputs("final_states"), *saved_buffer("out"),
                *inputs("D", optional=True), *inputs("z", optional=True, strided=True),
                *inputs("dt_bias", "initial_states", optional=True),
                *indices("cu_seqlens", "seq_idx", optional=True),
                *outputs("segment_states", optional=True), *status_word())
    options = _SCAN_OPTIONS
    returns = ("y", "final_states", "saved", "segment_states")

    def __init__(self, x, dt, A, B, C, *, chunk_size: int = DEFAULT_CHUNK_SIZE, D=None, z=None,
                 dt_bias=None, dt_softplus: bool = False, dt_limit=DEFAULT_DT_LIMIT,
                 initial_states=None, cu_seqlens=None, seq_idx=None,
                 recompute_states: bool = False, segment_states=None, status=None,
                 state_dtype: torch.dtype | None = None, backend: str = "auto") -> None:
        super().__init__(dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                              initial_states=initial_states, cu_seqlens=cu_seqlens,
                              seq_idx=seq_idx, segment_states=segment_states, status=status),
                         dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit,
                              recompute_states=recompute_states, state_dtype=state_dtype), backend)

    def _validate(self, descs, *, chunk_size, dt_softplus, dt_limit, recompute_states,
                  state_dtype) -> ScanProblem:
        facts = self._validate_scan({k: v for k, v in descs.items() if k != "segment_states"})
        problem = ScanProblem(**facts, chunk=chunk_size, dt_softplus=dt_softplus,
                              dt_limit=dt_limit, recompute_states=recompute_states,
                              accumulate=False, has_dfinal_states=False,
                              has_segment_states="segment_states" in descs,
                              state_dtype=resolve_state_dtype(facts["dtype"], state_dtype))
        self._plan_tensor("y", (problem.batch, problem.length, problem.heads, problem.head_dim),
                          problem.dtype)
        self._plan_tensor("final_states", (problem.sequences, problem.heads, problem.head_dim,
                                           problem.state), problem.param_dtype)
        if "segment_states" in descs:
            if problem.num_sequences is not None:
                raise ValidationError("segment_states: expected None with cu_seqlens (the "
                                      "segments of packed sequences depend on their offsets)")
            expect_dtype("segment_states", descs["segment_states"], (problem.param_dtype,))
            expect_shape("segment_states", descs["segment_states"],
                         (problem.max_segments, problem.heads, problem.head_dim, problem.state),
                         "[b·ceil(l / chunk_size), h, p, n]")
        check_activation_layouts(self, descs, scan_vectors(problem))
        return problem

    def floor(self):
        """The forward's floor (``contract.forward_floor``): inputs read once, y and
        final_states written once; saved state is not part of it."""
        return forward_floor(self.problem)

    def execute(self, x, dt, A, B, C, y, final_states, saved, *, D=None, z=None, dt_bias=None,
                initial_states=None, cu_seqlens=None, seq_idx=None, segment_states=None,
                status=None, workspace=None, current_stream=None) -> TupleDict:
        """Runs the forward; returns TupleDict(y, final_states, saved[, segment_states])."""
        return self._execute(dict(x=x, dt=dt, A=A, B=B, C=C, y=y, final_states=final_states,
                                  saved=saved, D=D, z=z, dt_bias=dt_bias,
                                  initial_states=initial_states, cu_seqlens=cu_seqlens,
                                  seq_idx=seq_idx, segment_states=segment_states,
                                  status=status, workspace=workspace,
                                  current_stream=current_stream))


class Mamba2ChunkScanBackward(_ScanPlan):
    """Backward plan of the Mamba2 chunked scan.

    Takes the forward's inputs and options (the same chunk_size, dt transform, cu_seqlens or
    seq_idx, recompute_states, state_dtype and backend), dy [b, l, h, p] and optionally dfinal_states [nseq, h, p, n]
    fp32, and the forward's ``saved`` buffer (``saved_size`` bytes, not verified on the device).
    Writes dx, ddt (w.r.t. the raw dt, dt's dtype), dA [h] fp32, dB and dC (summed over the
    heads of each group in fp32, rounded once) and, for the optional inputs the plan was built
    with, dD, dz, ddt_bias and dinitial_states. dA, dD and ddt_bias are fp32 sums over every
    token in fixed order (deterministic); with ``accumulate=True`` they are added to the
    caller's buffers. ``workspace``: ``workspace_size`` bytes. cu_seqlens is sanitised as in the
    forward (tokens no sequence covers get zero gradients); ``status``: the optional int32 [1]
    status word. dy, dx, ddt, dB, dC and dz may be views like the forward's activations (dx, dB,
    dC, ddt and dz written straight into slices of a fused gradient buffer).
    """

    op_name = "mamba2_chunk_scan_backward"
    program_name = "backward"
    operands = (*inputs("x", "dt", strided=True), *inputs("A"), *inputs("B", "C", "dy", strided=True),
                *saved_buffer("in"), *outputs("dx", "ddt", strided=True), *outputs("dA"),
                *outputs("dB", "dC", strided=True), *inputs("D", optional=True),
                *inputs("z", optional=True, strided=True),
                *inputs("dt_bias", "initial_states", optional=True),
                *indices("cu_seqlens", "seq_idx", optional=True),
                *inputs("dfinal_states", optional=True), *outputs("dD", optional=True),
                *outputs("dz", optional=True, strided=True),
                *outputs("ddt_bias", "dinitial_states", optional=True), *status_word())
    options = (*_SCAN_OPTIONS, Option("accumulate", expect_bool, False))
    returns = tuple(_GRAD_OF.values())

    def __init__(self, x, dt, A, B, C, dy, *, chunk_size: int = DEFAULT_CHUNK_SIZE, D=None, z=None,
                 dt_bias=None, dt_softplus: bool = False, dt_limit=DEFAULT_DT_LIMIT,
                 initial_states=None, cu_seqlens=None, seq_idx=None, dfinal_states=None,
                 recompute_states: bool = False, accumulate: bool = False, status=None,
                 state_dtype: torch.dtype | None = None, backend: str = "auto") -> None:
        super().__init__(dict(x=x, dt=dt, A=A, B=B, C=C, dy=dy, D=D, z=z, dt_bias=dt_bias,
                              initial_states=initial_states, cu_seqlens=cu_seqlens,
                              seq_idx=seq_idx, dfinal_states=dfinal_states, status=status),
                         dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit,
                              recompute_states=recompute_states, accumulate=accumulate,
                              state_dtype=state_dtype), backend)

    def _validate(self, descs, *, chunk_size, dt_softplus, dt_limit, recompute_states,
                  accumulate, state_dtype) -> ScanProblem:
        scan = {k: v for k, v in descs.items() if k not in ("dy", "dfinal_states")}
        facts = self._validate_scan(scan)
        x = descs["x"]
        expect_dtype("dy", descs["dy"], (x.dtype,))
        expect_shape("dy", descs["dy"], tuple(x.shape), "[b, l, h, p] like x")
        problem = ScanProblem(**facts, chunk=chunk_size, dt_softplus=dt_softplus,
                              dt_limit=dt_limit, recompute_states=recompute_states,
                              accumulate=accumulate, has_dfinal_states="dfinal_states" in descs,
                              state_dtype=resolve_state_dtype(facts["dtype"], state_dtype))
        if "dfinal_states" in descs:
            df = descs["dfinal_states"]
            expect_dtype("dfinal_states", df, (problem.param_dtype,))
            expect_shape("dfinal_states", df, (problem.sequences, problem.heads, problem.head_dim,
                                               problem.state), "[nseq, h, p, n]")
        for name, grad in _GRAD_OF.items():
            if name in descs:
                self._plan_tensor(grad, descs[name].shape, descs[name].dtype)
        check_activation_layouts(self, descs, scan_vectors(problem))
        return problem

    def floor(self):
        """The backward's floor (``contract.backward_floor``): inputs and dy read once, every
        gradient written once, no recomputation."""
        return backward_floor(self.problem)

    @property
    def gradient_names(self) -> tuple[str, ...]:
        """The gradients execute() writes, in TupleDict order."""
        return tuple(g for g in _GRAD_OF.values() if g in self._descs)

    def execute(self, x, dt, A, B, C, dy, saved, dx, ddt, dA, dB, dC, *, D=None, z=None,
                dt_bias=None, initial_states=None, cu_seqlens=None, seq_idx=None,
                dfinal_states=None, dD=None, dz=None, ddt_bias=None, dinitial_states=None,
                status=None, workspace=None, current_stream=None) -> TupleDict:
        """Runs the backward; returns a TupleDict of the gradients (``gradient_names``)."""
        return self._execute(dict(x=x, dt=dt, A=A, B=B, C=C, dy=dy, saved=saved, dx=dx, ddt=ddt,
                                  dA=dA, dB=dB, dC=dC, D=D, z=z, dt_bias=dt_bias,
                                  initial_states=initial_states, cu_seqlens=cu_seqlens,
                                  seq_idx=seq_idx, dfinal_states=dfinal_states, dD=dD, dz=dz, ddt_bias=ddt_bias,
                                  dinitial_states=dinitial_states, status=status,
                                  workspace=workspace, current_stream=current_stream))


def mamba2_chunk_scan_forward(x, dt, A, B, C, chunk_size: int = DEFAULT_CHUNK_SIZE, *, D=None,
                              z=None, dt_bias=None, dt_softplus: bool = False,
                              dt_limit=DEFAULT_DT_LIMIT, initial_states=None, cu_seqlens=None,
                              seq_idx=None, recompute_states: bool = False,
                              return_segment_states: bool = False, status=None,
                              state_dtype: torch.dtype | None = None, backend: str = "auto", current_stream=None,
                              check_inputs: bool | None = None) -> TupleDict:
    """Eager forward: allocates y, final_states, saved and the workspace; returns
    TupleDict(y, final_states, saved[, segment_states]) (``return_segment_states``: the state
    entering every segment, see Mamba2ChunkScanForward). Pass ``saved`` and the same options
    to ``mamba2_chunk_scan_backward``. ``status``: the optional status word; ``check_inputs``
    (default: FUSEDOPS_CHECK_INPUTS) checks cu_seqlens and seq_idx on the host first (a
    synchronisation).

    Example::

        y, final_states, saved = fusedops.mamba2_chunk_scan_forward(x, dt, A, B, C, 64, D=D)
    """
    segment_states = None
    if expect_bool("return_segment_states", return_segment_states):
        if not isinstance(x, torch.Tensor):
            raise ValidationError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        b, l, h, p = x.shape
        chunks = -(-l // Mamba2ChunkScanForward.normalise_options(
            dict(chunk_size=chunk_size))["chunk_size"])
        segment_states = TensorDesc((b * chunks, h, p, B.shape[-1]), accumulator_dtype(x.dtype),
                                    device=x.device)
    return Mamba2ChunkScanForward.eager(
        dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
             cu_seqlens=cu_seqlens, seq_idx=seq_idx, segment_states=segment_states,
             status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs,
        chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit,
        recompute_states=recompute_states, state_dtype=state_dtype)


def mamba2_chunk_scan_backward(x, dt, A, B, C, dy, saved, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                               D=None, z=None, dt_bias=None, dt_softplus: bool = False,
                               dt_limit=DEFAULT_DT_LIMIT, initial_states=None, cu_seqlens=None,
                               seq_idx=None, dfinal_states=None, recompute_states: bool = False,
                               status=None, state_dtype: torch.dtype | None = None,
                               backend: str = "auto", current_stream=None,
                               check_inputs: bool | None = None) -> TupleDict:
    """Eager backward: allocates the gradients and workspace; returns TupleDict(dx, ddt, dA, dB,
    dC[, dD][, dz][, ddt_bias][, dinitial_states]). ``status`` and ``check_inputs`` as in the
    forward."""
    return Mamba2ChunkScanBackward.eager(
        dict(x=x, dt=dt, A=A, B=B, C=C, dy=dy, saved=saved, D=D, z=z, dt_bias=dt_bias,
             initial_states=initial_states, cu_seqlens=cu_seqlens, seq_idx=seq_idx,
             dfinal_states=dfinal_states, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs,
        chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit,
        recompute_states=recompute_states, state_dtype=state_dtype)

