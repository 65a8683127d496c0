"""The operators as differentiable torch ops.

Every operator is a ``torch.library`` custom op (``torch.ops.fusedops.*``) with a fake
implementation (shapes from the plan, no computation), so it traces under
``torch.compile(fullgraph=True)``, and an autograd formula that calls the backward op, so it
works in eager mode and with activation checkpointing. The forward's ``saved`` buffer is kept
by reference for the backward (no copies). Inputs are made contiguous before the op; gradients
come back in the inputs' dtypes.

    o = fusedops.ops.gqa_attention(q, k, v, causal=True)
    o.sum().backward()
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._desc import TensorDesc
from .attention import GQAAttentionForward, gqa_attention_backward, gqa_attention_forward
from .engram import DEFAULT_EPS, EngramGateSavedForward, engram_gate_saved_backward, engram_gate_saved_forward
from .mamba2 import Mamba2ChunkScanForward, mamba2_chunk_scan_backward, mamba2_chunk_scan_forward
from .moe import (ReLU2MoEForward, moe_router as _moe_router, moe_router_backward,
                  relu2_moe_backward, relu2_moe_forward)


def _desc(t: Tensor | None) -> TensorDesc | None:
    return None if t is None else TensorDesc.from_tensor(t)


def _empty(plan, name: str, like: Tensor) -> Tensor:
    d = plan.desc(name)
    return torch.empty(d.shape, dtype=d.dtype, device=like.device)


def _contiguous(*tensors):
    return [None if t is None else t.contiguous() for t in tensors]


# -- Engram saved-state gate -------------------------------------------------------------------
@torch.library.custom_op("fusedops::engram_gate_fwd", mutates_args=())
def _gate_fwd(x: Tensor, kv: Tensor, weight: Tensor, mask: Tensor | None, eps: float,
              backend: str) -> tuple[Tensor, Tensor]:
    out, saved = engram_gate_saved_forward(x, kv, weight, mask, eps=eps, backend=backend)
    return out, saved


@_gate_fwd.register_fake
def _(x, kv, weight, mask, eps, backend):
    plan = EngramGateSavedForward(_desc(x), _desc(kv), _desc(weight), _desc(mask), eps=eps,
                                  backend=backend)
    return _empty(plan, "out", x), _empty(plan, "saved", x)


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
    gx, gkv, gw = _gate_bwd(x, kv, weight, saved, grad_out.contiguous(), ctx.backend)
    return gx, gkv, gw, None, None, None


_gate_fwd.register_autograd(_gate_backward, setup_context=_gate_setup)


def engram_gate(x: Tensor, kv: Tensor, weight: Tensor, mask: Tensor | None = None, *,
                eps: float = DEFAULT_EPS, backend: str = "auto") -> Tensor:
    """Differentiable Engram saved-state gate: out [N, S, D] (see EngramGateSavedForward)."""
    x, kv, weight, mask = _contiguous(x, kv, weight, mask)
    return _gate_fwd(x, kv, weight, mask, float(eps), backend)[0]


# -- Mamba2 chunked scan -----------------------------------------------------------------------
_SCAN_OPTIONAL = ("D", "z", "dt_bias", "initial_states")


@torch.library.custom_op("fusedops::mamba2_chunk_scan_fwd", mutates_args=())
def _scan_fwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
              z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None,
              cu_seqlens: Tensor | None, chunk_size: int, dt_softplus: bool,
              dt_limit: Sequence[float], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    y, final, saved = mamba2_chunk_scan_forward(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit), initial_states=initial_states, cu_seqlens=cu_seqlens,
        backend=backend)
    return y, final, saved


@_scan_fwd.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, chunk_size, dt_softplus,
      dt_limit, backend):
    plan = Mamba2ChunkScanForward(
        *map(_desc, (x, dt, A, B, C)), chunk_size=chunk_size, D=_desc(D), z=_desc(z),
        dt_bias=_desc(dt_bias), dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
        initial_states=_desc(initial_states), cu_seqlens=_desc(cu_seqlens), backend=backend)
    return _empty(plan, "y", x), _empty(plan, "final_states", x), _empty(plan, "saved", x)


@torch.library.custom_op("fusedops::mamba2_chunk_scan_bwd", mutates_args=())
def _scan_bwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, dy: Tensor, saved: Tensor,
              D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None,
              initial_states: Tensor | None, cu_seqlens: Tensor | None,
              dfinal_states: Tensor | None, chunk_size: int, dt_softplus: bool,
              dt_limit: Sequence[float], backend: str) -> list[Tensor]:
    grads = mamba2_chunk_scan_backward(
        x, dt, A, B, C, dy, saved, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit), initial_states=initial_states, cu_seqlens=cu_seqlens,
        dfinal_states=dfinal_states, backend=backend)
    return list(grads.values())


@_scan_bwd.register_fake
def _(x, dt, A, B, C, dy, saved, D, z, dt_bias, initial_states, cu_seqlens, dfinal_states,
      chunk_size, dt_softplus, dt_limit, backend):
    present = [x, dt, A, B, C] + [t for t in (D, z, dt_bias, initial_states) if t is not None]
    return [torch.empty_like(t) for t in present]


def _scan_setup(ctx, inputs, output):
    (x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, chunk_size, dt_softplus,
     dt_limit, backend) = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, output[2])
    ctx.options = (chunk_size, dt_softplus, dt_limit, backend)


def _scan_backward(ctx, dy, d_final, _d_saved):
    x, dt, A, B, C, D, z, dt_bias, h0, cu, saved = ctx.saved_tensors
    grads = iter(_scan_bwd(x, dt, A, B, C, dy.contiguous(), saved, D, z, dt_bias, h0, cu,
                           d_final.contiguous(), *ctx.options))
    core = [next(grads) for _ in range(5)]
    optional = [None if t is None else next(grads) for t in (D, z, dt_bias, h0)]
    return (*core, *optional, None, None, None, None, None)


_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup)


def mamba2_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 256,
                      *, D: Tensor | None = None, z: Tensor | None = None,
                      dt_bias: Tensor | None = None, dt_softplus: bool = False,
                      dt_limit=(0.0, math.inf), initial_states: Tensor | None = None,
                      cu_seqlens: Tensor | None = None,
                      backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Differentiable Mamba2 chunked scan: (y [b, l, h, p], final_states [nseq, h, p, n]), with
    gradients for x, dt, A, B, C and the optional D, z, dt_bias, initial_states."""
    args = _contiguous(x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens)
    y, final, _ = _scan_fwd(*args, int(chunk_size), bool(dt_softplus),
                            [float(v) for v in dt_limit], backend)
    return y, final


# -- GQA attention -----------------------------------------------------------------------------
@torch.library.custom_op("fusedops::gqa_attention_fwd", mutates_args=())
def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None,
              cu_seqlens_k: Tensor | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
              causal: bool, softmax_scale: float | None, window_size: Sequence[int],
              backend: str) -> tuple[Tensor, Tensor]:
    o, lse = gqa_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   window_size=tuple(window_size), cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                   max_seqlen_k=max_seqlen_k, backend=backend)
    return o, lse


@_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_size, backend):
    plan = GQAAttentionForward(_desc(q), _desc(k), _desc(v), causal=causal,
                               softmax_scale=softmax_scale, window_size=tuple(window_size),
                               cu_seqlens_q=_desc(cu_seqlens_q), cu_seqlens_k=_desc(cu_seqlens_k),
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, backend=backend)
    return _empty(plan, "o", q), _empty(plan, "lse", q)


@torch.library.custom_op("fusedops::gqa_attention_bwd", mutates_args=())
def _attn_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
              cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int | None,
              max_seqlen_k: int | None, causal: bool, softmax_scale: float | None,
              window_size: Sequence[int], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = gqa_attention_backward(q, k, v, o, lse, do, causal=causal,
                                        softmax_scale=softmax_scale, window_size=tuple(window_size),
                                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                        backend=backend)
    return dq, dk, dv


@_attn_bwd.register_fake
def _(q, k, v, o, lse, do, *options):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attn_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.options = options
    ctx.mark_non_differentiable(output[1])


def _attn_backward(ctx, do, _d_lse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _attn_bwd(q, k, v, o, lse, do.contiguous(), cu_q, cu_k, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_attn_fwd.register_autograd(_attn_backward, setup_context=_attn_setup)


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                  softmax_scale: float | None = None, window_size=(-1, -1),
                  cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                  backend: str = "auto") -> Tensor:
    """Differentiable GQA attention: o like q (see GQAAttentionForward); lse is not returned
    (use gqa_attention_forward for it)."""
    q, k, v, cu_q, cu_k = _contiguous(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _attn_fwd(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, bool(causal),
                     None if softmax_scale is None else float(softmax_scale),
                     [int(w) for w in window_size], backend)[0]


# -- MoE router --------------------------------------------------------------------------------
@torch.library.custom_op("fusedops::moe_router_fwd", mutates_args=())
def _router_fwd(logits: Tensor, correction_bias: Tensor | None, top_k: int, n_group: int,
                topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float,
                backend: str) -> tuple[Tensor, Tensor]:
    w, ids = _moe_router(logits, top_k, correction_bias=correction_bias, n_group=n_group,
                         topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                         routed_scaling_factor=routed_scaling_factor, backend=backend)
    return w, ids


@_router_fwd.register_fake
def _(logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor,
      backend):
    t = logits.shape[0]
    wdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return (logits.new_empty((t, top_k), dtype=wdt), logits.new_empty((t, top_k), dtype=torch.int32))


@torch.library.custom_op("fusedops::moe_router_bwd", mutates_args=())
def _router_bwd(logits: Tensor, topk_ids: Tensor, d_topk_weights: Tensor, norm_topk_prob: bool,
                routed_scaling_factor: float, backend: str) -> Tensor:
    return moe_router_backward(logits, topk_ids, d_topk_weights, norm_topk_prob=norm_topk_prob,
                               routed_scaling_factor=routed_scaling_factor, backend=backend)[0]


@_router_bwd.register_fake
def _(logits, topk_ids, d_topk_weights, norm_topk_prob, routed_scaling_factor, backend):
    return torch.empty_like(logits)


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
    [t, k] int32). See MoERouter."""
    logits, bias = _contiguous(logits, correction_bias)
    return _router_fwd(logits, bias, int(top_k), int(n_group), int(topk_group),
                       bool(norm_topk_prob), float(routed_scaling_factor), backend)


# -- routed ReLU2 experts ----------------------------------------------------------------------
@torch.library.custom_op("fusedops::relu2_moe_fwd", mutates_args=())
def _moe_fwd(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
             shared_w_up: Tensor | None, shared_w_down: Tensor | None,
             backend: str) -> tuple[Tensor, Tensor]:
    out, saved = relu2_moe_forward(x, w_up, w_down, topk_ids, topk_weights, shared_w_up=shared_w_up,
                                   shared_w_down=shared_w_down, backend=backend)
    return out, saved


@_moe_fwd.register_fake
def _(x, w_up, w_down, topk_ids, topk_weights, shared_w_up, shared_w_down, backend):
    plan = ReLU2MoEForward(*map(_desc, (x, w_up, w_down, topk_ids, topk_weights)),
                           shared_w_up=_desc(shared_w_up), shared_w_down=_desc(shared_w_down),
                           backend=backend)
    return _empty(plan, "out", x), _empty(plan, "saved", x)


@torch.library.custom_op("fusedops::relu2_moe_bwd", mutates_args=())
def _moe_bwd(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor,
             d_out: Tensor, saved: Tensor, shared_w_up: Tensor | None,
             shared_w_down: Tensor | None, backend: str) -> list[Tensor]:
    grads = relu2_moe_backward(x, w_up, w_down, topk_ids, topk_weights, d_out, saved,
                               shared_w_up=shared_w_up, shared_w_down=shared_w_down,
                               weight_grad_dtype=x.dtype, backend=backend)
    return list(grads.values())


@_moe_bwd.register_fake
def _(x, w_up, w_down, topk_ids, topk_weights, d_out, saved, shared_w_up, shared_w_down, backend):
    present = [x, topk_weights, w_up, w_down] + [t for t in (shared_w_up, shared_w_down) if t is not None]
    return [torch.empty_like(t) for t in present]


def _moe_setup(ctx, inputs, output):
    x, w_up, w_down, ids, weights, su, sd, backend = inputs
    ctx.save_for_backward(x, w_up, w_down, ids, weights, output[1], su, sd)
    ctx.backend = backend


def _moe_backward(ctx, d_out, _d_saved):
    x, w_up, w_down, ids, weights, saved, su, sd = ctx.saved_tensors
    grads = _moe_bwd(x, w_up, w_down, ids, weights, d_out.contiguous(), saved, su, sd, ctx.backend)
    d_x, d_w, d_up, d_down = grads[:4]
    d_su, d_sd = grads[4:] if su is not None else (None, None)
    return d_x, d_up, d_down, None, d_w, d_su, d_sd, None


_moe_fwd.register_autograd(_moe_backward, setup_context=_moe_setup)


def relu2_moe(x: Tensor, w_up: Tensor, w_down: Tensor, topk_ids: Tensor, topk_weights: Tensor, *,
              shared_w_up: Tensor | None = None, shared_w_down: Tensor | None = None,
              backend: str = "auto") -> Tensor:
    """Differentiable routed ReLU2 experts: out [t, H], gradients for x, the weights, the routing
    weights and the shared expert (weight gradients in the weights' dtype). See ReLU2MoEForward."""
    args = _contiguous(x, w_up, w_down, topk_ids, topk_weights, shared_w_up, shared_w_down)
    return _moe_fwd(*args, backend)[0]
