"""The chunked scan as a differentiable torch op (``torch.ops.fusedops.mamba2_chunk_scan_fwd/bwd``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.index_checks import check_inputs_requested
from ..errors import ValidationError
from ..plan import BACKENDS
from ..plan.torch_ops import as_planned, contiguous, describe, empty_like_planned
from .contract import DEFAULT_CHUNK_SIZE, DEFAULT_DT_LIMIT
from .plans import Mamba2ChunkScanForward, mamba2_chunk_scan_backward, mamba2_chunk_scan_forward


@torch.library.custom_op("fusedops::mamba2_chunk_scan_fwd", mutates_args=())
def _scan_fwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
              z: Tensor | None, dt_bias: Tensor | None, initial_states: Tensor | None,
              cu_seqlens: Tensor | None, seq_idx: Tensor | None, chunk_size: int,
              dt_softplus: bool, dt_limit: Sequence[float],
              backend: str) -> tuple[Tensor, Tensor, Tensor]:
    y, final, saved = mamba2_chunk_scan_forward(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit), initial_states=initial_states, cu_seqlens=cu_seqlens,
        seq_idx=seq_idx, backend=backend)
    return y, final, saved


@_scan_fwd.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, seq_idx, chunk_size,
      dt_softplus, dt_limit, backend):
    plan = Mamba2ChunkScanForward(
        *map(describe, (x, dt, A, B, C)), chunk_size=chunk_size, D=describe(D), z=describe(z),
        dt_bias=describe(dt_bias), dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
        initial_states=describe(initial_states), cu_seqlens=describe(cu_seqlens),
        seq_idx=describe(seq_idx), backend=backend)
    return (empty_like_planned(plan, "y", x), empty_like_planned(plan, "final_states", x),
            empty_like_planned(plan, "saved", x))


@torch.library.custom_op("fusedops::mamba2_chunk_scan_bwd", mutates_args=())
def _scan_bwd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, dy: Tensor, saved: Tensor,
              D: Tensor | None, z: Tensor | None, dt_bias: Tensor | None,
              initial_states: Tensor | None, cu_seqlens: Tensor | None,
              seq_idx: Tensor | None, dfinal_states: Tensor | None, chunk_size: int,
              dt_softplus: bool, dt_limit: Sequence[float], backend: str) -> list[Tensor]:
    grads = mamba2_chunk_scan_backward(
        x, dt, A, B, C, dy, saved, chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit), initial_states=initial_states, cu_seqlens=cu_seqlens,
        seq_idx=seq_idx, dfinal_states=dfinal_states, backend=backend)
    return list(grads.values())


@_scan_bwd.register_fake
def _(x, dt, A, B, C, dy, saved, D, z, dt_bias, initial_states, cu_seqlens, seq_idx,
      dfinal_states, chunk_size, dt_softplus, dt_limit, backend):
    present = [x, dt, A, B, C] + [t for t in (D, z, dt_bias, initial_states) if t is not None]
    # the plans allocate every gradient contiguous, whatever the layout of its input
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in present]


def _scan_setup(ctx, inputs, output):
    (x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, seq_idx, chunk_size,
     dt_softplus, dt_limit, backend) = inputs
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, cu_seqlens, seq_idx,
                          output[2])
    ctx.options = (chunk_size, dt_softplus, dt_limit, backend)


def _scan_backward(ctx, dy, d_final, _d_saved):
    x, dt, A, B, C, D, z, dt_bias, h0, cu, seq_idx, saved = ctx.saved_tensors
    grads = iter(_scan_bwd(x, dt, A, B, C, as_planned(dy), saved, D, z, dt_bias, h0,
                           cu, seq_idx, d_final.contiguous(), *ctx.options))
    core = [next(grads) for _ in range(5)]
    optional = [None if t is None else next(grads) for t in (D, z, dt_bias, h0)]
    return (*core, *optional, None, None, None, None, None, None)


_scan_fwd.register_autograd(_scan_backward, setup_context=_scan_setup)


def _expect_backend(backend) -> str:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValidationError(f"backend: expected one of auto, {', '.join(BACKENDS)}, got {backend!r}")
    return backend


def mamba2_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                      chunk_size: int = DEFAULT_CHUNK_SIZE, *, D: Tensor | None = None,
                      z: Tensor | None = None, dt_bias: Tensor | None = None,
                      dt_softplus: bool = False, dt_limit=DEFAULT_DT_LIMIT,
                      initial_states: Tensor | None = None, cu_seqlens: Tensor | None = None,
                      seq_idx: Tensor | None = None, backend: str = "auto",
                      check_inputs: bool | None = None) -> tuple[Tensor, Tensor]:
    """Differentiable Mamba2 chunked scan: (y [b, l, h, p], final_states [nseq, h, p, n]), with
    gradients for x, dt, A, B, C and the optional D, z, dt_bias, initial_states (see
    Mamba2ChunkScanForward; ``seq_idx``: sequence ids, mamba_ssm's convention). x, z, dt, B and
    C go in as they are when the plans take their layout (slices of a projection whose rows are
    whole 16-byte vectors: no copy); any other layout is copied once (``as_planned``). The
    options are validated first (ValidationError naming the option: chunk_size=64.0 is
    refused, not truncated); ``check_inputs`` (default: FUSEDOPS_CHECK_INPUTS) checks
    cu_seqlens and seq_idx on the host before the op (a synchronisation)."""
    options = Mamba2ChunkScanForward.normalise_options(
        dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit))
    backend = _expect_backend(backend)
    check = check_inputs_requested(check_inputs)
    args = [as_planned(x), as_planned(dt), *contiguous(A), as_planned(B), as_planned(C),
            *contiguous(D), as_planned(z), *contiguous(dt_bias, initial_states, cu_seqlens,
                                                      seq_idx)]
    if check and (cu_seqlens is not None or seq_idx is not None):
        names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "cu_seqlens",
                 "seq_idx")
        plan = Mamba2ChunkScanForward.cached(dict(zip(names, args)), backend=backend, **options)
        plan.check_index_values(cu_seqlens=args[-2], seq_idx=args[-1])
    y, final, _ = _scan_fwd(*args, options["chunk_size"], options["dt_softplus"],
                            list(options["dt_limit"]), backend)
    return y, final
