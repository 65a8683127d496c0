"""Validation helpers shared by every plan.

Construction-time helpers check a TensorDesc against the operator contract and raise with a
message naming the argument, the expectation and the value. Execute-time helpers check only
cheap host facts of the tensors handed to execute(): no device reads and no torch ops.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from ..errors import ValidationError
from .desc import TensorDesc
from .dtypes import dtype_name

ALIGNMENT = 16  # bytes: every floating tensor and workspace must start on a 16-byte boundary


def _names(dtypes: Iterable[torch.dtype]) -> str:
    names = [dtype_name(d) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def expect_dtype(name: str, desc: TensorDesc, allowed: Sequence[torch.dtype]) -> None:
    if desc.dtype not in allowed:
        raise ValidationError(f"{name}: expected dtype {_names(allowed)}, got {dtype_name(desc.dtype)}")


def expect_ndim(name: str, desc: TensorDesc, ndim: int, layout: str) -> None:
    if desc.ndim != ndim:
        raise ValidationError(f"{name}: expected a {ndim}-d tensor {layout}, got shape {list(desc.shape)}")


def expect_shape(name: str, desc: TensorDesc, shape: Sequence[int], layout: str) -> None:
    if tuple(desc.shape) != tuple(shape):
        raise ValidationError(
            f"{name}: expected shape {layout} = {list(shape)}, got {list(desc.shape)}")


def expect_contiguous(name: str, desc: TensorDesc) -> None:
    if not desc.is_contiguous():
        raise ValidationError(
            f"{name}: expected a contiguous tensor, got shape {list(desc.shape)} with strides "
            f"{list(desc.stride)}")


def expect_aligned(name: str, tensor: torch.Tensor, alignment: int = ALIGNMENT) -> None:
    if alignment > 1 and tensor.numel() > 0 and tensor.data_ptr() % alignment:
        raise ValidationError(
            f"{name}: expected a data pointer aligned to {alignment} bytes, got address "
            f"{tensor.data_ptr():#x} (offset {tensor.data_ptr() % alignment})")


def check_execute_tensor(name: str, tensor, desc: TensorDesc, alignment: int) -> None:
    """Checks a tensor handed to execute() against its planned declaration (host facts only)."""
    if isinstance(tensor, torch.Tensor) and (
            tensor.dtype == desc.dtype and tensor.shape == desc.shape
            and tensor.device == desc.device and tensor.is_contiguous()
            and (alignment <= 1 or tensor.data_ptr() % alignment == 0)):
        return
    _raise_mismatch(name, tensor, desc, alignment)


def _raise_mismatch(name: str, tensor, desc: TensorDesc, alignment: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValidationError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != desc.dtype:
        raise ValidationError(
            f"{name}: expected dtype {dtype_name(desc.dtype)} as planned, got {dtype_name(tensor.dtype)}")
    if tensor.shape != desc.shape:
        raise ValidationError(
            f"{name}: expected shape {list(desc.shape)} as planned, got {list(tensor.shape)}")
    if tensor.device != desc.device:
        raise ValidationError(f"{name}: expected device {desc.device} as planned, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValidationError(
            f"{name}: expected a contiguous tensor, got strides {list(tensor.stride())}")
    expect_aligned(name, tensor, alignment)


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor may touch (its strided extent)."""
    if tensor.numel() == 0:
        return (0, 0)
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def check_no_overlap(inputs: Mapping[str, torch.Tensor | None],
                     outputs: Mapping[str, torch.Tensor | None]) -> None:
    """Outputs (and workspace) must not share bytes with inputs or with each other."""
    seen = [(name, byte_range(t), t.device) for name, t in inputs.items() if t is not None]
    for name, tensor in outputs.items():
        if tensor is None:
            continue
        lo, hi = byte_range(tensor)
        if hi > lo:
            for other, (olo, ohi), device in seen:
                if lo < ohi and olo < hi and device == tensor.device:
                    raise ValidationError(
                        f"{name}: must not overlap {other}; their byte ranges "
                        f"[{lo:#x}, {hi:#x}) and [{olo:#x}, {ohi:#x}) intersect")
        seen.append((name, (lo, hi), tensor.device))


def check_workspace(workspace, required: int, device: torch.device) -> None:
    if required == 0 and workspace is None:
        return
    if not isinstance(workspace, torch.Tensor):
        raise ValidationError(
            f"workspace: expected a uint8 tensor of at least {required} bytes on {device} "
            f"(plan.allocate_workspace()), got {type(workspace).__name__}")
    nbytes = workspace.numel() * workspace.element_size()
    if (workspace.dtype != torch.uint8 or workspace.device != device or not workspace.is_contiguous()
            or nbytes < required):
        raise ValidationError(
            f"workspace: expected a contiguous uint8 tensor of at least {required} bytes on {device}, "
            f"got {dtype_name(workspace.dtype)} of {nbytes} bytes on {workspace.device}"
            f"{'' if workspace.is_contiguous() else ' (not contiguous)'}")
    expect_aligned("workspace", workspace)
