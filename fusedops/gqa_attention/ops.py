"""GQA attention as a differentiable torch op (``torch.ops.fusedops.gqa_attention_fwd/bwd``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.index_checks import check_inputs_requested
from ..errors import ValidationError
from ..plan.selection import BACKENDS
from ..plan.torch_ops import as_planned, contiguous, describe, empty_like_planned
from .plans import GQAAttentionForward, gqa_attention_backward, gqa_attention_forward


@torch.library.custom_op("fusedops::gqa_attention_fwd", mutates_args=())
def _attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None,
              cu_seqlens_k: Tensor | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
              causal: bool, softmax_scale: float | None, window_size: Sequence[int],
              backend: str, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    o, lse = gqa_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   window_size=tuple(window_size), cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                   max_seqlen_k=max_seqlen_k, softcap=softcap, backend=backend)
    return o, lse


@_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_size, backend, softcap=0.0):
    plan = GQAAttentionForward(describe(q), describe(k), describe(v), causal=causal,
                               softmax_scale=softmax_scale, window_size=tuple(window_size),
                               cu_seqlens_q=describe(cu_seqlens_q), cu_seqlens_k=describe(cu_seqlens_k),
                               max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                               softcap=softcap, backend=backend)
    return empty_like_planned(plan, "o", q), empty_like_planned(plan, "lse", q)


@torch.library.custom_op("fusedops::gqa_attention_bwd", mutates_args=())
def _attn_bwd(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
              cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, max_seqlen_q: int | None,
              max_seqlen_k: int | None, causal: bool, softmax_scale: float | None,
              window_size: Sequence[int], backend: str,
              softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = gqa_attention_backward(q, k, v, o, lse, do, causal=causal,
                                        softmax_scale=softmax_scale, window_size=tuple(window_size),
                                        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                        softcap=softcap, backend=backend)
    return dq, dk, dv


@_attn_bwd.register_fake
def _(q, k, v, o, lse, do, *options):
    # the plan allocates the gradients contiguous, whatever the layout of q, k, v
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _attn_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *options = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.options = options
    ctx.mark_non_differentiable(output[1])


def _attn_backward(ctx, do, _d_lse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _attn_bwd(q, k, v, o, lse, as_planned(do), cu_q, cu_k, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_attn_fwd.register_autograd(_attn_backward, setup_context=_attn_setup)


def gqa_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                  softmax_scale: float | None = None, window_size=(-1, -1),
                  cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                  max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                  softcap: float = 0.0, return_lse: bool = False,
                  check_inputs: bool | None = None, backend: str = "auto"):
    """Differentiable GQA attention: o like q (see GQAAttentionForward; the options, softcap
    included, are validated as the plan validates them). ``return_lse=True``: (o, lse), lse as
    the forward writes it and not differentiable (flash-attn's softmax_lse). q, k, v (and the
    incoming gradient of o) go in without a copy when their last dimension is contiguous and
    their other strides 16-byte aligned (slices of a fused QKV projection); other layouts are
    copied. ``check_inputs=True`` (or FUSEDOPS_CHECK_INPUTS=1) checks the packed offsets on the
    host first (a synchronisation; not under torch.compile tracing)."""
    check = check_inputs_requested(check_inputs)
    if not isinstance(backend, str) or backend not in ("auto", *BACKENDS):
        raise ValidationError(f"backend: expected one of auto, {', '.join(BACKENDS)}, got {backend!r}")
    if not isinstance(return_lse, bool):
        raise ValidationError(f"return_lse: expected a bool, got {return_lse!r}")
    options = GQAAttentionForward.normalise_options(dict(
        causal=causal, softmax_scale=softmax_scale, window_size=window_size,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softcap=softcap))
    q, k, v = (as_planned(t) if isinstance(t, Tensor) else t for t in (q, k, v))
    cu_q, cu_k = contiguous(cu_seqlens_q, cu_seqlens_k)
    if check:
        GQAAttentionForward.cached(dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
                                   backend=backend, **options).check_index_values(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o, lse = _attn_fwd(q, k, v, cu_q, cu_k, options["max_seqlen_q"], options["max_seqlen_k"],
                       options["causal"], options["softmax_scale"], list(options["window_size"]),
                       backend, options["softcap"])
    return (o, lse) if return_lse else o
