"""TensorDesc: a tensor's dtype, shape, strides and device, without storage."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from ..errors import ValidationError
from .dtypes import element_size


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (in elements)."""
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _ints(field: str, values, minimum: int | None) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise ValidationError(f"TensorDesc.{field}: expected a sequence of ints, got {values!r}") from None
    out = []
    for value in items:
        if isinstance(value, bool):
            raise ValidationError(f"TensorDesc.{field}: expected ints, got {value!r} in {items}")
        try:
            value = operator.index(value)
        except TypeError:
            raise ValidationError(f"TensorDesc.{field}: expected ints, got {value!r} in {items}") from None
        if minimum is not None and value < minimum:
            raise ValidationError(f"TensorDesc.{field}: expected non-negative sizes, got {items}")
        out.append(value)
    return tuple(out)


@dataclass(frozen=True)
class TensorDesc:
    """Declares a tensor for plan construction without allocating it.

    ``TensorDesc((n, 4, 5120), torch.bfloat16)`` declares a contiguous CUDA tensor; a declaration
    with ``device="cuda"`` (no index) binds to the current CUDA device when a plan is constructed
    from it. ``stride=None`` means contiguous. Sizes and strides are ints (bool and float are
    refused). Plans accept a TensorDesc wherever they accept a tensor; execute() then takes real
    tensors that match it.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None
    device: torch.device | str = "cuda"

    def __post_init__(self) -> None:
        shape = _ints("shape", self.shape, 0)
        if not isinstance(self.dtype, torch.dtype):
            raise ValidationError(f"TensorDesc.dtype: expected a torch.dtype, got {self.dtype!r}")
        stride = contiguous_strides(shape) if self.stride is None else _ints("stride", self.stride, None)
        if len(stride) != len(shape):
            raise ValidationError(
                f"TensorDesc.stride: expected {len(shape)} strides for shape {shape}, got {stride}")
        try:
            device = torch.device(self.device)
        except (TypeError, RuntimeError):
            raise ValidationError(f"TensorDesc.device: expected a torch.device or a device string, "
                                  f"got {self.device!r}") from None
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "stride", stride)
        object.__setattr__(self, "device", device)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorDesc:
        """The description of ``tensor`` (its shape, dtype, strides and device)."""
        return cls(tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()), tensor.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return element_size(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def is_contiguous(self) -> bool:
        """Row-major contiguous (dimensions of size 1 may have any stride)."""
        expected = contiguous_strides(self.shape)
        return all(size <= 1 or s == e for size, s, e in zip(self.shape, self.stride, expected))

    def bound(self, device: torch.device) -> TensorDesc:
        """The same description on ``device``."""
        return TensorDesc(self.shape, self.dtype, self.stride, device)
