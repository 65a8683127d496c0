"""Engram saved-state gate: plans and eager wrappers (the math: ``contract``).

The names, argument order and result order match cuDNN frontend's SM100 saved-state gate, so
fusedops can stand in for it; fusedops serves any N >= 1, S >= 1 and D with 16-byte rows, in
bf16/fp16/fp32 (and float64 for reference checks), on CPU (torch) and SM80+ GPUs (Triton, and
CuTe DSL on sm_90a/sm_100a).
"""

from __future__ import annotations

import torch

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype, dtype_name
from ..core.options import Option, expect_bool, expect_float
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, inputs, outputs
from .contract import (ACTIVATION_DTYPES, DEFAULT_EPS, MIN_EPS, GateProblem, backward_floor,
                       forward_floor)


def _eps(name: str, value) -> float:
    return expect_float(name, value, minimum=MIN_EPS)


class _GatePlan(Plan):
    backend_module = "engram_gate.program"
    backends = ("torch", "triton", "cute")

    def _validate_gate(self, descs) -> tuple[int, int, int, TensorDesc]:
        x = descs["x"]
        expect_ndim("x", x, 3, "[N, S, D]")
        expect_dtype("x", x, ACTIVATION_DTYPES)
        n, s, d = x.shape
        if n < 1 or s < 1 or d < 1:
            raise ValidationError(f"x: expected N, S and D >= 1 in [N, S, D], got {list(x.shape)}")
        if (d * x.element_size) % 16:
            raise ValidationError(
                f"x: expected rows of a multiple of 16 bytes (D * {x.element_size} bytes per "
                f"{dtype_name(x.dtype)} element), got D = {d}")
        expect_dtype("kv", descs["kv"], (x.dtype,))
        expect_shape("kv", descs["kv"], (n, (s + 1) * d), "[N, (S+1)*D]")
        expect_dtype("weight", descs["weight"], (accumulator_dtype(x.dtype),))
        expect_shape("weight", descs["weight"], (s, d), "[S, D]")
        return n, s, d, x

    def _check_contiguous(self, descs) -> None:
        """The operands that are not strided views (weight, saved, mask) are contiguous."""
        strided = {o.name for o in self.operands if o.strided}
        for name, desc in descs.items():
            if name not in strided:
                expect_contiguous(name, desc)


class EngramGateSavedForward(_GatePlan):
    """Forward plan of the Engram saved-state gate.

    Args (tensors or TensorDescs):
        x: [N, S, D] bf16/fp16/fp32, the residual streams (float64 selects reference precision,
           served by the torch backend only; weight and saved are then float64 too).
        kv: [N, (S+1)*D], x's dtype: S keys then the shared value, per token.
        weight: [S, D] fp32, the product of the source q/k RMSNorm weights.
        mask: [N] bool or None (all true); false means "no memory for this token".
        eps: RMS epsilon, finite and >= the smallest normal fp32 (default 1e-20).
        backend: "auto" (default), "triton", "cute" or "torch".

    execute(x, kv, weight, mask, out, saved) writes out [N, S, D] (x's dtype, rounded once) and
    saved [N, S, 4] fp32 = (gate, dot, rstd_x, rstd_k), which the backward plan consumes. Keep
    x, kv, weight and saved unchanged until the backward has run. No workspace. out and saved
    must not overlap the inputs or each other. x, kv and out may be strided views (last
    dimension contiguous, other strides multiples of 16 bytes: slices of a larger buffer go in
    and out without a copy); weight, mask and saved are contiguous; floating tensors 16-byte
    aligned.
    """

    op_name = "engram_gate_saved_forward"
    program_name = "forward"
    operands = (*inputs("x", "kv", strided=True), *inputs("weight"),
                *inputs("mask", optional=True, alignment=1), *outputs("out", strided=True),
                *outputs("saved"))
    options = (Option("eps", _eps, DEFAULT_EPS),)
    returns = ("out", "saved")

    def __init__(self, x, kv, weight, mask=None, *, eps: float = DEFAULT_EPS,
                 backend: str = "auto") -> None:
        super().__init__(dict(x=x, kv=kv, weight=weight, mask=mask), dict(eps=eps), backend)

    def _validate(self, descs, *, eps) -> GateProblem:
        n, s, d, x = self._validate_gate(descs)
        if "mask" in descs:
            expect_dtype("mask", descs["mask"], (torch.bool,))
            expect_shape("mask", descs["mask"], (n,), "[N]")
        self._check_contiguous(descs)
        self._plan_tensor("out", (n, s, d), x.dtype)
        self._plan_tensor("saved", (n, s, 4), accumulator_dtype(x.dtype))
        return GateProblem(x.dtype, n, s, d, eps, "mask" in descs, False, self.device)

    def floor(self):
        return forward_floor(self.problem)

    @property
    def out_desc(self) -> TensorDesc:
        return self.desc("out")

    @property
    def saved_desc(self) -> TensorDesc:
        """[N, S, 4] fp32: what execute() writes for the backward pass."""
        return self.desc("saved")

    def execute(self, x, kv, weight, mask, out, saved, *, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the forward into ``out`` and ``saved``; returns TupleDict(out, saved)."""
        return self._execute(dict(x=x, kv=kv, weight=weight, mask=mask, out=out, saved=saved,
                                  workspace=workspace, current_stream=current_stream))


class EngramGateSavedBackward(_GatePlan):
    """Backward plan of the Engram saved-state gate.

    Args (tensors or TensorDescs): x, kv, weight as in the forward; saved [N, S, 4] fp32 from the
    matching forward (not verified on the device); grad_out [N, S, D] in x's dtype.
    accumulate: grad_weight ``+=`` the result instead of ``=`` (micro-batch accumulation).

    execute(x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight, workspace) writes
    grad_x [N, S, D] and grad_kv [N, (S+1)*D] (x's dtype, packed like kv: key gradients, then
    grad_v = sum over streams summed in fp32 and rounded once) and grad_weight [S, D] fp32. The
    grad_weight reduction over tokens is fp32 and fixed-order through ``workspace``
    (``workspace_size`` bytes, see docs/engram_gate.md), so results are bitwise reproducible.
    x, kv, grad_out, grad_x and grad_kv may be strided views (as in the forward).
    """

    op_name = "engram_gate_saved_backward"
    program_name = "backward"
    operands = (*inputs("x", "kv", strided=True), *inputs("weight", "saved"),
                *inputs("grad_out", strided=True), *outputs("grad_x", "grad_kv", strided=True),
                *outputs("grad_weight"))
    options = (Option("accumulate", expect_bool, False),)
    returns = ("grad_x", "grad_kv", "grad_weight")

    def __init__(self, x, kv, weight, saved, grad_out, *, accumulate: bool = False,
                 backend: str = "auto") -> None:
        super().__init__(dict(x=x, kv=kv, weight=weight, saved=saved, grad_out=grad_out),
                         dict(accumulate=accumulate), backend)

    def _validate(self, descs, *, accumulate) -> GateProblem:
        n, s, d, x = self._validate_gate(descs)
        expect_dtype("saved", descs["saved"], (accumulator_dtype(x.dtype),))
        expect_shape("saved", descs["saved"], (n, s, 4), "[N, S, 4]")
        expect_dtype("grad_out", descs["grad_out"], (x.dtype,))
        expect_shape("grad_out", descs["grad_out"], (n, s, d), "[N, S, D]")
        self._check_contiguous(descs)
        self._plan_tensor("grad_x", (n, s, d), x.dtype)
        self._plan_tensor("grad_kv", (n, (s + 1) * d), x.dtype)
        self._plan_tensor("grad_weight", (s, d), accumulator_dtype(x.dtype))
        return GateProblem(x.dtype, n, s, d, DEFAULT_EPS, False, accumulate, self.device)

    def floor(self):
        return backward_floor(self.problem)

    def execute(self, x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight,
                workspace=None, *, current_stream=None) -> TupleDict:
        """Runs the backward; returns TupleDict(grad_x, grad_kv, grad_weight)."""
        return self._execute(dict(x=x, kv=kv, weight=weight, saved=saved, grad_out=grad_out,
                                  grad_x=grad_x, grad_kv=grad_kv, grad_weight=grad_weight,
                                  workspace=workspace, current_stream=current_stream))


def engram_gate_saved_forward(x, kv, weight, mask=None, *, eps: float = DEFAULT_EPS,
                              backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager forward: allocates out and saved, returns TupleDict(out, saved).

    Example::

        fwd = fusedops.engram_gate_saved_forward(x, kv, weight, mask)
        out, saved = fwd
    """
    return EngramGateSavedForward.eager(dict(x=x, kv=kv, weight=weight, mask=mask), eps=eps,
                                        backend=backend, current_stream=current_stream)


def engram_gate_saved_backward(x, kv, weight, saved, grad_out, *, backend: str = "auto",
                               current_stream=None) -> TupleDict:
    """Eager backward: allocates the gradients and workspace, returns
    TupleDict(grad_x, grad_kv, grad_weight)."""
    return EngramGateSavedBackward.eager(
        dict(x=x, kv=kv, weight=weight, saved=saved, grad_out=grad_out), backend=backend,
        current_stream=current_stream)
