"""The gate as a differentiable torch op (``torch.ops.fusedops.engram_gate_fwd/bwd``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..plan.torch_ops import as_planned, contiguous, describe, empty_like_planned
from .contract import DEFAULT_EPS
from .plans import EngramGateSavedForward, engram_gate_saved_backward, engram_gate_saved_forward


@torch.library.custom_op("fusedops::engram_gate_fwd", mutates_args=())
def _gate_fwd(x: Tensor, kv: Tensor, weight: Tensor, mask: Tensor | None, eps: float,
              backend: str) -> tuple[Tensor, Tensor]:
    out, saved = engram_gate_saved_forward(x, kv, weight, mask, eps=eps, backend=backend)
    return out, saved


@_gate_fwd.register_fake
def _(x, kv, weight, mask, eps, backend):
    plan = EngramGateSavedForward(describe(x), describe(kv), describe(weight), describe(mask),
                                  eps=eps, backend=backend)
    return empty_like_planned(plan, "out", x), empty_like_planned(plan, "saved", x)


@torch.library.custom_op("fusedops::engram_gate_bwd", mutates_args=())
def _gate_bwd(x: Tensor, kv: Tensor, weight: Tensor, saved: Tensor, grad_out: Tensor,
              backend: str) -> tuple[Tensor, Tensor, Tensor]:
    gx, gkv, gw = engram_gate_saved_backward(x, kv, weight, saved, grad_out, backend=backend)
    return gx, gkv, gw


@_gate_bwd.register_fake
def _(x, kv, weight, saved, grad_out, backend):
    return torch.empty_like(x), torch.empty_like(kv), torch.empty_like(weight)


def _gate_setup(ctx, inputs, output):
    x, kv, weight, _, _, backend = inputs
    ctx.save_for_backward(x, kv, weight, output[1])
    ctx.backend = backend


def _gate_backward(ctx, grad_out, _grad_saved):
    x, kv, weight, saved = ctx.saved_tensors
    gx, gkv, gw = _gate_bwd(x, kv, weight, saved, as_planned(grad_out), ctx.backend)
    return gx, gkv, gw, None, None, None


_gate_fwd.register_autograd(_gate_backward, setup_context=_gate_setup)


def engram_gate(x: Tensor, kv: Tensor, weight: Tensor, mask: Tensor | None = None, *,
                eps: float = DEFAULT_EPS, backend: str = "auto") -> Tensor:
    """Differentiable Engram saved-state gate: out [N, S, D] (see EngramGateSavedForward). x and kv
    may be strided views (last dimension contiguous, rows 16-byte aligned): they go in without a
    copy; weight and mask are made contiguous (parameters, small)."""
    weight, mask = contiguous(weight, mask)
    return _gate_fwd(as_planned(x), as_planned(kv), weight, mask, float(eps), backend)[0]
