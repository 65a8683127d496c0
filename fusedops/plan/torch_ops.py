"""Helpers for an operator's ``torch.library`` custom ops (``<family>/ops.py``): fake outputs
shaped by the plan, the TensorDesc of an optional tensor, and activations handed to the plans as
the views they are."""

from __future__ import annotations

import torch

from ..core.checks import ALIGNMENT, row_vector, rows_layout
from ..core.desc import TensorDesc


def describe(t: torch.Tensor | None) -> TensorDesc | None:
    """TensorDesc of a tensor (None stays None)."""
    return None if t is None else TensorDesc.from_tensor(t)


def empty_like_planned(plan, name: str, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped as the plan declares ``name``, on ``like``'s device (the
    fake implementations' outputs)."""
    d = plan.desc(name)
    return torch.empty(d.shape, dtype=d.dtype, device=like.device)


def as_planned(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` itself when the plans take it as a strided view: its rows (last dimension) a whole
    number of 16-byte vectors and contiguous, its other strides multiples of 16 bytes and, on
    real tensors, its data 16-byte aligned (q, k, v sliced from a fused QKV projection; x, B, C
    from Mamba2's in-projection). Otherwise a contiguous copy (none when ``t`` is contiguous
    already): a transposed gradient, an odd row width. Under torch.compile tracing the data
    pointer is not read; a misaligned view is then refused by name by the plan. None stays
    None."""
    if t is None:
        return None
    if (t.dim() >= 1 and row_vector(t.shape[-1], t.dtype) > 1
            and rows_layout(t.shape, t.stride(), t.element_size())
            and (torch.compiler.is_compiling() or t.data_ptr() % ALIGNMENT == 0)):
        return t
    return t.contiguous()


def contiguous(*tensors):
    """Each tensor made contiguous (None kept)."""
    return [None if t is None else t.contiguous() for t in tensors]
