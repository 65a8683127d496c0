"""Engram saved-state gate: plans and eager wrappers (specs/engram_gate.md).

For every token n and stream s the gate decides how much of the token's retrieved memory value v
to add to the residual stream x:

    rx = 1/sqrt(mean(x^2) + eps), rk = 1/sqrt(mean(k^2) + eps)
    dot = sum(x * w * k) * rx * rk / sqrt(D); gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))
    out = x + gate * v        (gate = 0 and out == x bit for bit where mask is false)

The names, argument order and result order match cuDNN frontend's SM100 saved-state gate, so
fusedops can stand in for it; fusedops serves any N >= 1, S >= 1 and D with 16-byte rows, in
bf16/fp16/fp32 (and float64 for reference checks), on CPU (torch) and SM80+ GPUs (Triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import (expect_contiguous, expect_dtype, expect_ndim, expect_positive_finite,
                      expect_shape)
from ._desc import TensorDesc
from ._plan import EAGER_PLANS, Plan, describe
from ._stream import allocation_stream
from ._tupledict import TupleDict
from .errors import ValidationError

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
DEFAULT_EPS = 1e-20
_IMPLEMENTATIONS = {"torch": "fusedops.backends.torch.engram",
                    "triton": "fusedops.backends.triton.engram",
                    "cute": "fusedops.backends.cute.engram"}


@dataclass(frozen=True)
class GateProblem:
    """The plan-time facts a backend needs."""

    dtype: torch.dtype
    tokens: int
    streams: int
    hidden: int
    eps: float
    has_mask: bool
    accumulate: bool
    device: torch.device


def fp32_or_fp64(dtype: torch.dtype) -> torch.dtype:
    """weight, saved and grad_weight are fp32; fp64 in a float64 (reference-precision) plan."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _GatePlan(Plan):
    implementations = _IMPLEMENTATIONS

    def _declare_gate_inputs(self, x, kv, weight) -> tuple[int, int, int, torch.dtype]:
        x = self._declare("x", x)
        expect_ndim("x", x, 3, "[N, S, D]")
        expect_dtype("x", x, ACTIVATION_DTYPES)
        n, s, d = x.shape
        if n < 1 or s < 1 or d < 1:
            raise ValidationError(f"x: expected N, S and D >= 1 in [N, S, D], got {list(x.shape)}")
        if (d * x.element_size) % 16:
            raise ValidationError(
                f"x: expected rows of a multiple of 16 bytes (D * {x.element_size} bytes per "
                f"{str(x.dtype).removeprefix('torch.')} element), got D = {d}")
        kv = self._declare("kv", kv)
        weight = self._declare("weight", weight)
        expect_dtype("kv", kv, (x.dtype,))
        expect_shape("kv", kv, (n, (s + 1) * d), "[N, (S+1)*D]")
        expect_dtype("weight", weight, (fp32_or_fp64(x.dtype),))
        expect_shape("weight", weight, (s, d), "[S, D]")
        return n, s, d, x.dtype

    def _check_contiguous(self) -> None:
        for name, desc in self._descs.items():
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
        backend: "auto" (default), "triton" or "torch".

    execute(x, kv, weight, mask, out, saved) writes out [N, S, D] (x's dtype, rounded once) and
    saved [N, S, 4] fp32 = (gate, dot, rstd_x, rstd_k), which the backward plan consumes. Keep
    x, kv, weight and saved unchanged until the backward has run. No workspace. out and saved
    must not overlap the inputs or each other; all tensors contiguous, floating ones 16-byte
    aligned.
    """

    op_name = "engram_gate_saved_forward"

    def __init__(self, x, kv, weight, mask=None, *, eps: float = DEFAULT_EPS,
                 backend: str = "auto") -> None:
        super().__init__(backend)
        n, s, d, dtype = self._declare_gate_inputs(x, kv, weight)
        if mask is not None:
            mask = self._declare("mask", mask, alignment=1)
            expect_dtype("mask", mask, (torch.bool,))
            expect_shape("mask", mask, (n,), "[N]")
        self._check_contiguous()
        self.eps = expect_positive_finite("eps", eps, minimum=torch.finfo(torch.float32).tiny)
        self._declare_output("out", (n, s, d), dtype)
        self._declare_output("saved", (n, s, 4), fp32_or_fp64(dtype))
        self.problem = GateProblem(dtype, n, s, d, self.eps, mask is not None, False, self.device)
        self._select_backend(self.problem)

    @property
    def out_desc(self) -> TensorDesc:
        return self.desc("out")

    @property
    def saved_desc(self) -> TensorDesc:
        """[N, S, 4] fp32: what execute() writes for the backward pass."""
        return self.desc("saved")

    def _build_launcher(self):
        return self._impl.forward_launcher(self.problem)

    def execute(self, x, kv, weight, mask, out, saved, *, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the forward into ``out`` and ``saved``; returns TupleDict(out, saved)."""
        stream = self._prepare_execute(dict(x=x, kv=kv, weight=weight, mask=mask),
                                       dict(out=out, saved=saved), workspace, current_stream)
        self._run(x, kv, weight, mask, out, saved, stream=stream)
        return TupleDict(out=out, saved=saved)


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
    """

    op_name = "engram_gate_saved_backward"

    def __init__(self, x, kv, weight, saved, grad_out, *, accumulate: bool = False,
                 backend: str = "auto") -> None:
        super().__init__(backend)
        n, s, d, dtype = self._declare_gate_inputs(x, kv, weight)
        saved = self._declare("saved", saved)
        grad_out = self._declare("grad_out", grad_out)
        expect_dtype("saved", saved, (fp32_or_fp64(dtype),))
        expect_shape("saved", saved, (n, s, 4), "[N, S, 4]")
        expect_dtype("grad_out", grad_out, (dtype,))
        expect_shape("grad_out", grad_out, (n, s, d), "[N, S, D]")
        self._check_contiguous()
        if not isinstance(accumulate, bool):
            raise ValidationError(f"accumulate: expected a bool, got {accumulate!r}")
        self.accumulate = accumulate
        self._declare_output("grad_x", (n, s, d), dtype)
        self._declare_output("grad_kv", (n, (s + 1) * d), dtype)
        self._declare_output("grad_weight", (s, d), fp32_or_fp64(dtype))
        self.problem = GateProblem(dtype, n, s, d, DEFAULT_EPS, False, accumulate, self.device)
        self._select_backend(self.problem)
        self._workspace_bytes = self._impl.backward_workspace_size(self.problem)

    def _build_launcher(self):
        return self._impl.backward_launcher(self.problem)

    def execute(self, x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight,
                workspace=None, *, current_stream=None) -> TupleDict:
        """Runs the backward; returns TupleDict(grad_x, grad_kv, grad_weight)."""
        stream = self._prepare_execute(
            dict(x=x, kv=kv, weight=weight, saved=saved, grad_out=grad_out),
            dict(grad_x=grad_x, grad_kv=grad_kv, grad_weight=grad_weight), workspace,
            current_stream)
        self._run(x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight, workspace,
                  stream=stream)
        return TupleDict(grad_x=grad_x, grad_kv=grad_kv, grad_weight=grad_weight)


def engram_gate_saved_forward(x, kv, weight, mask=None, *, eps: float = DEFAULT_EPS,
                              backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager forward: allocates out and saved, returns TupleDict(out, saved).

    Example::

        fwd = fusedops.engram_gate_saved_forward(x, kv, weight, mask)
        out, saved = fwd
    """
    plan = EAGER_PLANS.get(EngramGateSavedForward, describe(x), describe(kv), describe(weight),
                           describe(mask), eps=eps, backend=backend)
    with allocation_stream(current_stream, plan.device):
        out = torch.empty_like(x)
        saved = torch.empty(plan.saved_desc.shape, dtype=plan.saved_desc.dtype, device=x.device)
    return plan.execute(x, kv, weight, mask, out, saved, current_stream=current_stream)


def engram_gate_saved_backward(x, kv, weight, saved, grad_out, *, backend: str = "auto",
                               current_stream=None) -> TupleDict:
    """Eager backward: allocates the gradients and workspace, returns
    TupleDict(grad_x, grad_kv, grad_weight)."""
    plan = EAGER_PLANS.get(EngramGateSavedBackward, describe(x), describe(kv), describe(weight),
                           describe(saved), describe(grad_out), backend=backend)
    with allocation_stream(current_stream, plan.device):
        grad_x, grad_kv = torch.empty_like(x), torch.empty_like(kv)
        grad_weight = torch.empty_like(weight)
        workspace = plan.allocate_workspace()
    return plan.execute(x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight, workspace,
                        current_stream=current_stream)
