"""Helpers for an operator's ``torch.library`` custom ops (``<family>/ops.py``): fake outputs
shaped by the plan, and the TensorDesc of an optional tensor."""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc


def describe(t: torch.Tensor | None) -> TensorDesc | None:
    """TensorDesc of a tensor (None stays None)."""
    return None if t is None else TensorDesc.from_tensor(t)


def empty_like_planned(plan, name: str, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped as the plan declares ``name``, on ``like``'s device (the
    fake implementations' outputs)."""
    d = plan.desc(name)
    return torch.empty(d.shape, dtype=d.dtype, device=like.device)


def contiguous(*tensors):
    """Each tensor made contiguous (None kept)."""
    return [None if t is None else t.contiguous() for t in tensors]
