"""Mamba2 chunked selective scan (SSD): training forward and backward plans and eager wrappers
(specs/mamba2.md).

Per batch row (or per sequence of a packed batch, through cu_seqlens) and head h, with groups of
B/C shared by h / g heads:

    dt_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, *dt_limit)
    h_t  = exp(dt_t · A) h_{t-1} + dt_t x_t ⊗ B_t             state [p, n], fp32
    y_t  = h_t C_t + D x_t,  then y_t · silu(z_t) when z is given

computed chunk-wise (chunk_size tokens per segment). The names follow mamba_ssm's
``mamba_chunk_scan_combined``; the plans add caller-owned outputs, saved state and workspace.
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

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CHUNK_SIZES = (16, 32, 64, 128, 256)
_IMPLEMENTATIONS = {"torch": "fusedops.backends.torch.mamba2",
                    "triton": "fusedops.backends.triton.mamba2"}


@dataclass(frozen=True)
class ScanProblem:
    """The plan-time facts a backend needs (shared by the forward and backward plans)."""

    dtype: torch.dtype          # x, B, C, z, y, dy
    dt_dtype: torch.dtype
    batch: int
    length: int
    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int
    num_sequences: int | None   # None: the batch rows are the sequences; else len(cu_seqlens)-1
    has_D: bool
    D_per_channel: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    dt_limit: tuple[float, float]
    has_initial_states: bool
    recompute_states: bool
    accumulate: bool
    has_dfinal_states: bool
    device: torch.device

    @property
    def sequences(self) -> int:
        return self.batch if self.num_sequences is None else self.num_sequences

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @property
    def max_segments(self) -> int:
        """Segments (pieces of at most ``chunk`` tokens of one sequence) the problem can have."""
        if self.num_sequences is None:
            return self.batch * math.ceil(self.length / self.chunk)
        return math.ceil(self.length / self.chunk) + self.num_sequences

    @property
    def states_bytes(self) -> int:
        """fp32 state at the start of every segment: max_segments·h·p·n·4 bytes."""
        return self.max_segments * self.heads * self.head_dim * self.state * 4


class _ScanPlan(Plan):
    implementations = _IMPLEMENTATIONS

    def _declare_scan(self, x, dt, A, B, C, *, chunk_size, D, z, dt_bias, dt_softplus, dt_limit,
                      initial_states, cu_seqlens):
        x = self._declare("x", x)
        expect_ndim("x", x, 4, "[b, l, h, p]")
        expect_dtype("x", x, ACTIVATION_DTYPES)
        b, l, h, p = x.shape
        if min(b, l, h, p) < 1:
            raise ValidationError(f"x: expected b, l, h, p >= 1 in [b, l, h, p], got {list(x.shape)}")
        param = torch.float64 if x.dtype == torch.float64 else torch.float32
        dt = self._declare("dt", dt)
        expect_dtype("dt", dt, (x.dtype,) if x.dtype in (torch.float32, torch.float64) else (x.dtype, torch.float32))
        expect_shape("dt", dt, (b, l, h), "[b, l, h]")
        A = self._declare("A", A)
        expect_dtype("A", A, (param,))
        expect_shape("A", A, (h,), "[h]")
        B = self._declare("B", B)
        expect_ndim("B", B, 4, "[b, l, g, n]")
        expect_dtype("B", B, (x.dtype,))
        g, n = B.shape[2], B.shape[3]
        if B.shape[:2] != (b, l) or g < 1 or n < 1 or h % g:
            raise ValidationError(
                f"B: expected shape [b, l, g, n] with b = {b}, l = {l}, g >= 1 dividing h = {h} and "
                f"n >= 1, got {list(B.shape)}")
        C = self._declare("C", C)
        expect_dtype("C", C, (x.dtype,))
        expect_shape("C", C, (b, l, g, n), "[b, l, g, n] like B")
        if chunk_size not in CHUNK_SIZES:
            raise ValidationError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size!r}")
        if D is not None:
            D = self._declare("D", D)
            expect_dtype("D", D, (param,))
            if tuple(D.shape) not in ((h,), (h, p)):
                raise ValidationError(f"D: expected shape [h] = [{h}] or [h, p] = [{h}, {p}], got {list(D.shape)}")
        if z is not None:
            z = self._declare("z", z)
            expect_dtype("z", z, (x.dtype,))
            expect_shape("z", z, (b, l, h, p), "[b, l, h, p] like x")
        if dt_bias is not None:
            dt_bias = self._declare("dt_bias", dt_bias)
            expect_dtype("dt_bias", dt_bias, (param,))
            expect_shape("dt_bias", dt_bias, (h,), "[h]")
        nseq = None
        if cu_seqlens is not None:
            cu = self._declare("cu_seqlens", cu_seqlens, alignment=4)
            expect_dtype("cu_seqlens", cu, (torch.int32,))
            expect_ndim("cu_seqlens", cu, 1, "[nseq + 1]")
            if cu.shape[0] < 2:
                raise ValidationError(f"cu_seqlens: expected [nseq + 1] with nseq >= 1, got {list(cu.shape)}")
            if b != 1:
                raise ValidationError(f"x: expected b == 1 with cu_seqlens (packed sequences), got b = {b}")
            nseq = cu.shape[0] - 1
        seqs = b if nseq is None else nseq
        if initial_states is not None:
            h0 = self._declare("initial_states", initial_states)
            expect_dtype("initial_states", h0, (param,))
            expect_shape("initial_states", h0, (seqs, h, p, n),
                         "[nseq, h, p, n]" if nseq is not None else "[b, h, p, n]")
        lo, hi = _check_dt_limit(dt_limit)
        if not isinstance(dt_softplus, bool):
            raise ValidationError(f"dt_softplus: expected a bool, got {dt_softplus!r}")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        return dict(dtype=x.dtype, dt_dtype=dt.dtype, batch=b, length=l, heads=h, head_dim=p,
                    groups=g, state=n, chunk=chunk_size, num_sequences=nseq,
                    has_D=D is not None, D_per_channel=D is not None and D.ndim == 2,
                    has_z=z is not None, has_dt_bias=dt_bias is not None, dt_softplus=dt_softplus,
                    dt_limit=(lo, hi), has_initial_states=initial_states is not None,
                    device=self.device)

    @property
    def saved_size(self) -> int:
        """Bytes of the ``saved`` buffer the forward writes and the backward reads."""
        return self._impl.saved_size(self.problem)

    def allocate_saved(self) -> torch.Tensor:
        return torch.empty(self.saved_size, dtype=torch.uint8, device=self.device)

    @property
    def saved_states_bytes(self) -> int:
        """Bytes the saved segment-start states take (0 with recompute_states=True):
        max_segments·h·p·n·4. With recompute_states=True the backward recomputes them instead."""
        return 0 if self.problem.recompute_states else self.problem.states_bytes


def _check_dt_limit(dt_limit) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValidationError(f"dt_limit: expected a pair (lo, hi) of floats, got {dt_limit!r}") from None
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValidationError(f"dt_limit: expected lo <= hi, neither NaN, got {dt_limit!r}")
    return lo, hi


class Mamba2ChunkScanForward(_ScanPlan):
    """Forward plan of the Mamba2 chunked scan.

    Args (tensors or TensorDescs; all contiguous):
        x: [b, l, h, p] bf16/fp16/fp32 (float64: reference precision, torch backend only).
        dt: [b, l, h], x's dtype or fp32: raw time steps (bias, softplus and clamp applied here).
        A: [h] fp32 (negative). B, C: [b, l, g, n], x's dtype; head i uses group i // (h / g).
        chunk_size: 16, 32, 64, 128 or 256 tokens per segment.
        D: [h] or [h, p] fp32. z: [b, l, h, p] gate, x's dtype. dt_bias: [h] fp32.
        dt_softplus, dt_limit=(lo, hi): the dt transform (softplus threshold 20; the clamp).
        initial_states: [nseq, h, p, n] fp32 (nseq = b, or len(cu_seqlens) - 1).
        cu_seqlens: [nseq + 1] int32 packed-sequence boundaries (b must be 1); every sequence
            starts from its initial state (or zero) and none mixes with another.
        recompute_states: do not save the segment-start states (saved_states_bytes); the
            backward recomputes them.

    execute(x, dt, A, B, C, y, final_states, saved, ...) writes y [b, l, h, p] (x's dtype),
    final_states [nseq, h, p, n] fp32 and ``saved`` (``saved_size`` bytes, for the backward:
    the segment-start states unless recomputed, and y before the z gate when z is given).
    Optional inputs are passed by keyword, exactly those the plan was built with.
    """

    op_name = "mamba2_chunk_scan_forward"

    def __init__(self, x, dt, A, B, C, *, chunk_size: int = 256, D=None, z=None, dt_bias=None,
                 dt_softplus: bool = False, dt_limit=(0.0, math.inf), initial_states=None,
                 cu_seqlens=None, recompute_states: bool = False, backend: str = "auto") -> None:
        super().__init__(backend)
        facts = self._declare_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z,
                                   dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                   initial_states=initial_states, cu_seqlens=cu_seqlens)
        if not isinstance(recompute_states, bool):
            raise ValidationError(f"recompute_states: expected a bool, got {recompute_states!r}")
        self.problem = ScanProblem(**facts, recompute_states=recompute_states, accumulate=False,
                                   has_dfinal_states=False)
        pr = self.problem
        self._declare_output("y", (pr.batch, pr.length, pr.heads, pr.head_dim), pr.dtype)
        self._declare_output("final_states", (pr.sequences, pr.heads, pr.head_dim, pr.state),
                             pr.param_dtype)
        self._select_backend(pr)
        self._declare_output("saved", (self.saved_size,), torch.uint8)
        self._workspace_bytes = self._impl.forward_workspace_size(pr)

    def _build_launcher(self):
        return self._impl.forward_launcher(self.problem)

    def execute(self, x, dt, A, B, C, y, final_states, saved, *, D=None, z=None, dt_bias=None,
                initial_states=None, cu_seqlens=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the forward; returns TupleDict(y, final_states, saved)."""
        inputs = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                      initial_states=initial_states, cu_seqlens=cu_seqlens)
        outputs = dict(y=y, final_states=final_states, saved=saved)
        stream = self._prepare_execute(inputs, outputs, workspace, current_stream)
        self._run(dict(inputs, **outputs, workspace=workspace), stream=stream)
        return TupleDict(y=y, final_states=final_states, saved=saved)


_GRAD_OF = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
            "dt_bias": "ddt_bias", "initial_states": "dinitial_states"}


class Mamba2ChunkScanBackward(_ScanPlan):
    """Backward plan of the Mamba2 chunked scan.

    Takes the forward's inputs and options (the same chunk_size, dt transform, cu_seqlens,
    recompute_states and backend), dy [b, l, h, p] and optionally dfinal_states [nseq, h, p, n]
    fp32, and the forward's ``saved`` buffer. Writes dx, ddt (w.r.t. the raw dt, dt's dtype),
    dA [h] fp32, dB and dC (summed over the heads of each group in fp32, rounded once) and, for
    the optional inputs the plan was built with, dD, dz, ddt_bias and dinitial_states. dA, dD
    and ddt_bias are fp32 sums over every token in fixed order (deterministic); with
    ``accumulate=True`` they are added to the caller's buffers.
    """

    op_name = "mamba2_chunk_scan_backward"

    def __init__(self, x, dt, A, B, C, dy, *, chunk_size: int = 256, D=None, z=None, dt_bias=None,
                 dt_softplus: bool = False, dt_limit=(0.0, math.inf), initial_states=None,
                 cu_seqlens=None, dfinal_states=None, recompute_states: bool = False,
                 accumulate: bool = False, backend: str = "auto") -> None:
        super().__init__(backend)
        facts = self._declare_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z,
                                   dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                   initial_states=initial_states, cu_seqlens=cu_seqlens)
        for name, value in (("recompute_states", recompute_states), ("accumulate", accumulate)):
            if not isinstance(value, bool):
                raise ValidationError(f"{name}: expected a bool, got {value!r}")
        b, l, h, p = (facts[k] for k in ("batch", "length", "heads", "head_dim"))
        dy = self._declare("dy", dy)
        expect_dtype("dy", dy, (facts["dtype"],))
        expect_shape("dy", dy, (b, l, h, p), "[b, l, h, p] like x")
        expect_contiguous("dy", dy)
        self.problem = ScanProblem(**facts, recompute_states=recompute_states,
                                   accumulate=accumulate,
                                   has_dfinal_states=dfinal_states is not None)
        pr = self.problem
        if dfinal_states is not None:
            df = self._declare("dfinal_states", dfinal_states)
            expect_dtype("dfinal_states", df, (pr.param_dtype,))
            expect_shape("dfinal_states", df, (pr.sequences, h, p, pr.state), "[nseq, h, p, n]")
            expect_contiguous("dfinal_states", df)
        self._select_backend(pr)
        self._declare("saved", TensorDesc((self.saved_size,), torch.uint8, device=self.device))
        for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"):
            if name in self._descs:
                src = self._descs[name]
                self._declare_output(_GRAD_OF[name], src.shape, src.dtype)
        self._workspace_bytes = self._impl.backward_workspace_size(pr)

    @property
    def gradient_names(self) -> tuple[str, ...]:
        """The gradients execute() writes, in TupleDict order."""
        return tuple(_GRAD_OF[k] for k in _GRAD_OF if _GRAD_OF[k] in self._descs)

    def _build_launcher(self):
        return self._impl.backward_launcher(self.problem)

    def execute(self, x, dt, A, B, C, dy, saved, dx, ddt, dA, dB, dC, *, D=None, z=None,
                dt_bias=None, initial_states=None, cu_seqlens=None, dfinal_states=None, dD=None,
                dz=None, ddt_bias=None, dinitial_states=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the backward; returns a TupleDict of the gradients (``gradient_names``)."""
        inputs = dict(x=x, dt=dt, A=A, B=B, C=C, dy=dy, saved=saved, D=D, z=z, dt_bias=dt_bias,
                      initial_states=initial_states, cu_seqlens=cu_seqlens,
                      dfinal_states=dfinal_states)
        grads = dict(dx=dx, ddt=ddt, dA=dA, dB=dB, dC=dC, dD=dD, dz=dz, ddt_bias=ddt_bias,
                     dinitial_states=dinitial_states)
        stream = self._prepare_execute(inputs, grads, workspace, current_stream)
        self._run(dict(inputs, **grads, workspace=workspace), stream=stream)
        return TupleDict(**{k: grads[k] for k in self.gradient_names})


def mamba2_chunk_scan_forward(x, dt, A, B, C, chunk_size: int = 256, *, D=None, z=None,
                              dt_bias=None, dt_softplus: bool = False, dt_limit=(0.0, math.inf),
                              initial_states=None, cu_seqlens=None, recompute_states: bool = False,
                              backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager forward: allocates y, final_states and saved; returns TupleDict(y, final_states,
    saved). Pass ``saved`` and the same options to ``mamba2_chunk_scan_backward``.

    Example::

        y, final_states, saved = fusedops.mamba2_chunk_scan_forward(x, dt, A, B, C, 64, D=D)
    """
    options = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                   recompute_states=recompute_states, backend=backend)
    optional = dict(D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, cu_seqlens=cu_seqlens)
    plan = EAGER_PLANS.get(Mamba2ChunkScanForward, describe(x), describe(dt), describe(A),
                           describe(B), describe(C),
                           **{k: describe(v) for k, v in optional.items()}, **options)
    with allocation_stream(current_stream, plan.device):
        y = torch.empty(plan.desc("y").shape, dtype=plan.desc("y").dtype, device=x.device)
        fin = torch.empty(plan.desc("final_states").shape, dtype=plan.desc("final_states").dtype,
                          device=x.device)
        saved = plan.allocate_saved()
        workspace = plan.allocate_workspace()
    return plan.execute(x, dt, A, B, C, y, fin, saved, **optional, workspace=workspace,
                        current_stream=current_stream)


def mamba2_chunk_scan_backward(x, dt, A, B, C, dy, saved, chunk_size: int = 256, *, D=None, z=None,
                               dt_bias=None, dt_softplus: bool = False, dt_limit=(0.0, math.inf),
                               initial_states=None, cu_seqlens=None, dfinal_states=None,
                               recompute_states: bool = False, backend: str = "auto",
                               current_stream=None) -> TupleDict:
    """Eager backward: allocates the gradients and workspace; returns TupleDict(dx, ddt, dA, dB,
    dC[, dD][, dz][, ddt_bias][, dinitial_states])."""
    options = dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                   recompute_states=recompute_states, backend=backend)
    optional = dict(D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, cu_seqlens=cu_seqlens,
                    dfinal_states=dfinal_states)
    plan = EAGER_PLANS.get(Mamba2ChunkScanBackward, describe(x), describe(dt), describe(A),
                           describe(B), describe(C), describe(dy),
                           **{k: describe(v) for k, v in optional.items()}, **options)
    with allocation_stream(current_stream, plan.device):
        grads = {name: torch.empty(plan.desc(name).shape, dtype=plan.desc(name).dtype,
                                   device=x.device) for name in plan.gradient_names}
        workspace = plan.allocate_workspace()
    return plan.execute(x, dt, A, B, C, dy, saved, **grads, **optional, workspace=workspace,
                        current_stream=current_stream)
