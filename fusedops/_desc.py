"""TensorDesc: a tensor's dtype, shape, strides and device, without storage."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import ValidationError


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class TensorDesc:
    """Declares a tensor for plan construction without allocating it.

    ``TensorDesc((n, 4, 5120), torch.bfloat16)`` declares a contiguous CUDA tensor; a declaration
    with ``device="cuda"`` (no index) binds to the current CUDA device when a plan is constructed
    from it. ``stride=None`` means contiguous. Plans accept a TensorDesc wherever they accept a
    tensor; execute() then takes real tensors that match it.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None
    device: torch.device | str = "cuda"

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if any(s < 0 for s in shape):
            raise ValidationError(f"TensorDesc.shape: expected non-negative sizes, got {shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValidationError(f"TensorDesc.dtype: expected a torch.dtype, got {self.dtype!r}")
        stride = contiguous_strides(shape) if self.stride is None else tuple(int(s) for s in self.stride)
        if len(stride) != len(shape):
            raise ValidationError(
                f"TensorDesc.stride: expected {len(shape)} strides for shape {shape}, got {stride}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "stride", stride)
        object.__setattr__(self, "device", torch.device(self.device))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDesc:
        return cls(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()), tensor.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def is_contiguous(self) -> bool:
        expected = contiguous_strides(self.shape)
        return all(size <= 1 or s == e for size, s, e in zip(self.shape, self.stride, expected))

    def bound(self, device: torch.device) -> TensorDesc:
        return TensorDesc(self.shape, self.dtype, self.stride, device)
