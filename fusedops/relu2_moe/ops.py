"""The router and the experts as differentiable torch ops (``torch.ops.fusedops.moe_router_fwd/
bwd`` and ``torch.ops.fusedops.relu2_moe_fwd/bwd``).

The activations (logits, x and the incoming gradient d_out) go into the ops as they come. The
ops' implementations hand the plans a view whose rows the kernels read without a copy
(``as_planned``) and copy only a layout the plans refuse (a transposed tensor, rows not
16-byte aligned); the decision is made inside the custom ops, on the real tensors, so
torch.compile traces the wrappers without a graph break. The weights, the routing data and
d_topk_weights are made contiguous (a no-op for parameters). Every output is a new contiguous
tensor, as the fake implementations say."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype
from ..core.index_checks import check_inputs_requested
from ..errors import ValidationError
from ..plan import BACKENDS
from ..plan.torch_ops import as_planned, contiguous, describe, empty_like_planned
from .plans import (MoERouter, ReLU2MoEForward, moe_router as _moe_router, moe_router_backward,
                    relu2_moe_backward, relu2_moe_forward)


def _expect_backend(backend) -> str:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValidationError(
            f"backend: expected one of auto, {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def _as_planned(t: Tensor) -> TensorDesc:
    """A desc of what ``as_planned`` hands the plans, where only its shape matters (the
    fake implementations, the host check of the ids): contiguous."""
    return TensorDesc(tuple(t.shape), t.dtype, device=t.device)


# -- router ----------------------------------------------------------------------------------------
@torch.library.custom_op("fusedops::moe_router_fwd", mutates_args=())
def _router_fwd(logits: Tensor, correction_bias: Tensor | None, top_k: int, n_group: int,
                topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                backend: str) -> tuple[Tensor, Tensor]:
    w, ids = _moe_router(as_planned(logits), top_k, correction_bias=correction_bias,
                         n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                         routed_scaling_factor=routed_scaling_factor, backend=backend)
    return w, ids


@_router_fwd.register_fake
def _(logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
      backend):
    t = logits.shape[0]
    return (logits.new_empty((t, top_k), dtype=accumulator_dtype(logits.dtype)),
            logits.new_empty((t, top_k), dtype=torch.int32))


@torch.library.custom_op("fusedops::moe_router_bwd", mutates_args=())
def _router_bwd(logits: Tensor, topk_ids: Tensor, d_topk_weights: Tensor, norm_topk_prob: bool,
                routed_scaling_factor: float, backend: str) -> Tensor:
    return moe_router_backward(as_planned(logits), topk_ids, d_topk_weights,
                               norm_topk_prob=norm_topk_prob,
                               routed_scaling_factor=routed_scaling_factor, backend=backend)[0]


@_router_bwd.register_fake
def _(logits, topk_ids, d_topk_weights, norm_topk_prob, routed_scaling_factor, backend):
    return logits.new_empty(logits.shape)       # contiguous, whatever logits' strides


def _router_setup(ctx, inputs, output):
    logits, _, _, _, _, norm, scale, backend = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.options = (norm, scale, backend)
    ctx.mark_non_differentiable(output[1])


def _router_backward(ctx, d_w, _d_ids):
    logits, ids = ctx.saved_tensors
    return (_router_bwd(logits, ids, d_w.contiguous(), *ctx.options),
            None, None, None, None, None, None, None)


_router_fwd.register_autograd(_router_backward, setup_context=_router_setup)


def moe_router(logits: Tensor, top_k: int, *, correction_bias: Tensor | None = None,
               n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
               routed_scaling_factor: float = 1.0, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Differentiable router: (topk_weights [t, k] fp32, differentiable w.r.t. logits; topk_ids
    [t, k] int32). See MoERouter (NaN logits: NaN weights, ids still k distinct experts).
    logits may be a view (the router's columns of a fused projection): no copy where the plans
    take it (``as_planned``). The options are validated first (ValidationError naming the
    option: top_k=2.0 is refused, not truncated)."""
    o = MoERouter.normalise_options(dict(top_k=top_k, n_group=n_group, topk_group=topk_group,
                                         norm_topk_prob=norm_topk_prob,
                                         routed_scaling_factor=routed_scaling_factor))
    backend = _expect_backend(backend)
    bias, = contiguous(correction_bias)
    return _router_fwd(logits, bias, o["top_k"], o["n_group"], o["topk_group"],
                       o["norm_topk_prob"], o["routed_scaling_factor"], backend)


# -- routed ReLU2 experts --------------------------------------------------------------------------
@torch.library.custom_op("fusedops::relu2_moe_fwd", mutates_args=())
def _moe_fwd(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
             shared_w_up: Tensor | None, shared_w_down: Tensor | None,
             backend: str) -> tuple[Tensor, Tensor]:
    out, saved = relu2_moe_forward(as_planned(x), w_up, w_down, topk_ids, topk_weights,
                                   shared_w_up=shared_w_up, shared_w_down=shared_w_down,
                                   backend=backend)
    return out, saved


@_moe_fwd.register_fake
def _(x, w_up, w_down, topk_ids, topk_weights, shared_w_up, shared_w_down, backend):
    plan = ReLU2MoEForward(_as_planned(x), *map(describe, (w_up, w_down, topk_ids, topk_weights)),
                           shared_w_up=describe(shared_w_up), shared_w_down=describe(shared_w_down),
                           backend=backend)
    return empty_like_planned(plan, "out", x), empty_like_planned(plan, "saved", x)


@torch.library.custom_op("fusedops::relu2_moe_bwd", mutates_args=())
def _moe_bwd(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
             d_out: Tensor, saved: Tensor, shared_w_up: Tensor | None,
             shared_w_down: Tensor | None, backend: str) -> list[Tensor]:
    grads = relu2_moe_backward(as_planned(x), w_up, w_down, topk_ids, topk_weights,
                               as_planned(d_out), saved, shared_w_up=shared_w_up,
                               shared_w_down=shared_w_down, weight_grad_dtype=x.dtype,
                               backend=backend)
    return list(grads.values())


@_moe_bwd.register_fake
def _(x, w_up, w_down, topk_ids, topk_weights, d_out, saved, shared_w_up, shared_w_down, backend):
    present = [x, topk_weights, w_up, w_down] + [t for t in (shared_w_up, shared_w_down) if t is not None]
    return [t.new_empty(t.shape) for t in present]      # contiguous, as the plans allocate


def _moe_setup(ctx, inputs, output):
    x, w_up, w_down, ids, weights, su, sd, backend = inputs
    ctx.save_for_backward(x, w_up, w_down, ids, weights, output[1], su, sd)
    ctx.backend = backend


def _moe_backward(ctx, d_out, _d_saved):
    x, w_up, w_down, ids, weights, saved, su, sd = ctx.saved_tensors
    grads = _moe_bwd(x, w_up, w_down, ids, weights, d_out, saved, su, sd, ctx.backend)
    d_x, d_w, d_up, d_down = grads[:4]
    d_su, d_sd = grads[4:] if su is not None else (None, None)
    return d_x, d_up, d_down, None, d_w, d_su, d_sd, None


_moe_fwd.register_autograd(_moe_backward, setup_context=_moe_setup)


def relu2_moe(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor, *,
              shared_w_up: Tensor | None = None, shared_w_down: Tensor | None = None,
              backend: str = "auto", check_inputs: bool | None = None) -> Tensor:
    """Differentiable routed ReLU2 experts: out [t, H], gradients for x, the weights, the routing
    weights and the shared expert (weight gradients in the weights' dtype). See ReLU2MoEForward
    (an id outside [0, E) drops the assignment). x and the incoming gradient may be views (a
    slice of an in-projection): no copy where the plans take them (``as_planned``).
    ``check_inputs`` (default: FUSEDOPS_CHECK_INPUTS) checks topk_ids on the host before the op
    (a synchronisation) and raises a ValidationError naming the first id outside [0, E) other
    than -1."""
    backend = _expect_backend(backend)
    check = check_inputs_requested(check_inputs)
    args = [x, *contiguous(w_up, w_down, topk_ids, topk_weights, shared_w_up, shared_w_down)]
    if check:
        names = ("x", "w_up", "w_down", "topk_ids", "topk_weights", "shared_w_up", "shared_w_down")
        plan = ReLU2MoEForward.cached(dict(zip(names, [_as_planned(x), *args[1:]])),
                                      backend=backend)
        plan.check_index_values(topk_ids=args[3])
    return _moe_fwd(*args, backend)[0]
