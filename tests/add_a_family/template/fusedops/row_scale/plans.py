"""Row scale: plans and eager wrappers (the math: ``contract``)."""

from __future__ import annotations

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.dtypes import accumulator_dtype
from ..core.tupledict import TupleDict
from ..plan import Plan, inputs, outputs
from .contract import DTYPES, RowScaleProblem


class _RowScalePlan(Plan):
    backend_module = "row_scale.program"

    def _rows(self, descs):
        x = descs["x"]
        expect_ndim("x", x, 2, "[N, D]")
        expect_dtype("x", x, DTYPES)
        expect_dtype("weight", descs["weight"], (accumulator_dtype(x.dtype),))
        expect_shape("weight", descs["weight"], (x.shape[1],), "[D]")
        for name, desc in descs.items():
            expect_contiguous(name, desc)
        return x


class RowScaleForward(_RowScalePlan):
    """y [N, D] (x's dtype, rounded once) = x [N, D] · weight [D] (fp32; float64 for float64 x).
    No workspace; y must not overlap x or weight."""

    op_name = "row_scale_forward"
    backends = ("torch", "triton")
    operands = (*inputs("x", "weight"), *outputs("y"))
    returns = ("y",)

    def __init__(self, x, weight, *, backend: str = "auto") -> None:
        super().__init__(dict(x=x, weight=weight), {}, backend)

    def _validate(self, descs) -> RowScaleProblem:
        x = self._rows(descs)
        self._plan_tensor("y", tuple(x.shape), x.dtype)
        return RowScaleProblem(x.dtype, x.shape[0], x.shape[1], self.device)

    def execute(self, x, weight, y, *, workspace=None, current_stream=None) -> TupleDict:
        """Writes y; returns TupleDict(y)."""
        return self._execute(dict(x=x, weight=weight, y=y, workspace=workspace,
                                  current_stream=current_stream))


class RowScaleBackward(_RowScalePlan):
    """grad_x [N, D] (x's dtype) = grad_y · weight; grad_weight [D] (weight's dtype) = Σ_n
    grad_y · x. No workspace; the gradients must not overlap the inputs or each other."""

    op_name = "row_scale_backward"
    program_name = "backward"
    backends = ("torch",)
    auto_order = ("torch",)
    operands = (*inputs("x", "weight", "grad_y"), *outputs("grad_x", "grad_weight"))
    returns = ("grad_x", "grad_weight")

    def __init__(self, x, weight, grad_y, *, backend: str = "auto") -> None:
        super().__init__(dict(x=x, weight=weight, grad_y=grad_y), {}, backend)

    def _validate(self, descs) -> RowScaleProblem:
        x = self._rows(descs)
        expect_dtype("grad_y", descs["grad_y"], (x.dtype,))
        expect_shape("grad_y", descs["grad_y"], tuple(x.shape), "[N, D]")
        self._plan_tensor("grad_x", tuple(x.shape), x.dtype)
        self._plan_tensor("grad_weight", (x.shape[1],), accumulator_dtype(x.dtype))
        return RowScaleProblem(x.dtype, x.shape[0], x.shape[1], self.device)

    def execute(self, x, weight, grad_y, grad_x, grad_weight, *, workspace=None,
                current_stream=None) -> TupleDict:
        """Writes the gradients; returns TupleDict(grad_x, grad_weight)."""
        return self._execute(dict(x=x, weight=weight, grad_y=grad_y, grad_x=grad_x,
                                  grad_weight=grad_weight, workspace=workspace,
                                  current_stream=current_stream))


def row_scale_forward(x, weight, *, backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager forward: allocates y, returns TupleDict(y)."""
    return RowScaleForward.eager(dict(x=x, weight=weight), backend=backend,
                                 current_stream=current_stream)


def row_scale_backward(x, weight, grad_y, *, backend: str = "auto",
                       current_stream=None) -> TupleDict:
    """Eager backward: allocates the gradients, returns TupleDict(grad_x, grad_weight)."""
    return RowScaleBackward.eager(dict(x=x, weight=weight, grad_y=grad_y), backend=backend,
                                  current_stream=current_stream)
