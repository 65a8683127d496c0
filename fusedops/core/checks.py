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
from .dtypes import dtype_name, element_size
from .overlap import byte_range, shares_bytes

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


def expect_last_dim_contiguous(name: str, desc: TensorDesc, *, vector_bytes: int = ALIGNMENT) -> None:
    """A strided view whose last dimension is contiguous (stride 1) and whose other strides are
    non-negative multiples of ``vector_bytes`` (so every row starts aligned for the kernels'
    vector loads; 1 where a kernel does not vectorise): views of a fused projection go in
    without a copy. Dimensions of size 1 may have any stride."""
    dims = [(size, stride) for size, stride in zip(desc.shape, desc.stride) if size > 1]
    if desc.ndim and desc.shape[-1] > 1 and desc.stride[-1] != 1:
        raise ValidationError(
            f"{name}: expected the last dimension contiguous (stride 1), got shape "
            f"{list(desc.shape)} with strides {list(desc.stride)}")
    e = desc.element_size
    for size, stride in dims[:-1] if desc.shape and desc.shape[-1] > 1 else dims:
        if stride < 0 or (stride * e) % vector_bytes:
            raise ValidationError(
                f"{name}: expected strides of multiples of {vector_bytes} bytes "
                f"({vector_bytes // e} elements), got strides {list(desc.stride)} for shape "
                f"{list(desc.shape)}")


def same_layout(shape, stride_a, stride_b) -> bool:
    """Equal strides in every dimension of size > 1 (the others are never stepped)."""
    return all(size <= 1 or a == b for size, a, b in zip(shape, stride_a, stride_b))


def expect_aligned(name: str, tensor: torch.Tensor, alignment: int = ALIGNMENT) -> None:
    if alignment > 1 and tensor.numel() > 0 and tensor.data_ptr() % alignment:
        raise ValidationError(
            f"{name}: expected a data pointer aligned to {alignment} bytes, got address "
            f"{tensor.data_ptr():#x} (offset {tensor.data_ptr() % alignment})")


def row_vector(width: int, dtype: torch.dtype) -> int:
    """Elements per 16-byte vector, the unit kernels take an activation's row strides in, when a
    row of ``width`` elements of ``dtype`` is a whole number of vectors (the tensor may then be a
    view whose other strides are any multiples of 16 bytes); 1 otherwise (its rows are not
    16-byte aligned, so the plans take it contiguous only)."""
    vector = ALIGNMENT // element_size(dtype)
    return vector if vector >= 1 and width % vector == 0 else 1


def rows_layout(shape, stride, element_size: int, vector_bytes: int = ALIGNMENT) -> bool:
    """Last dimension contiguous, other strides non-negative multiples of ``vector_bytes``."""
    for i, (size, s) in enumerate(zip(shape, stride)):
        if size <= 1:
            continue
        if i == len(shape) - 1:
            if s != 1:
                return False
        elif s < 0 or (s * element_size) % vector_bytes:
            return False
    return True


def check_execute_tensor(name: str, tensor, desc: TensorDesc, alignment: int,
                         strided: bool = False) -> None:
    """Checks a tensor handed to execute() against its planned declaration (host facts only):
    dtype, shape, device, alignment, and the planned strides (``strided``: any row layout)."""
    if isinstance(tensor, torch.Tensor) and (
            tensor.dtype == desc.dtype and tensor.shape == desc.shape
            and tensor.device == desc.device
            and (rows_layout(desc.shape, tensor.stride(), tensor.element_size()) if strided
                 else same_layout(desc.shape, tensor.stride(), desc.stride))
            and (alignment <= 1 or tensor.data_ptr() % alignment == 0)):
        return
    _raise_mismatch(name, tensor, desc, alignment, strided)


def _raise_mismatch(name: str, tensor, desc: TensorDesc, alignment: int, strided: bool = False) -> None:
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
    if strided and not rows_layout(desc.shape, tensor.stride(), tensor.element_size()):
        raise ValidationError(
            f"{name}: expected the last dimension contiguous and the other strides multiples of "
            f"{ALIGNMENT} bytes, got strides {list(tensor.stride())}")
    if not strided and not same_layout(desc.shape, tensor.stride(), desc.stride):
        planned = "a contiguous tensor" if desc.is_contiguous() else f"strides {list(desc.stride)} as planned"
        raise ValidationError(f"{name}: expected {planned}, got strides {list(tensor.stride())}")
    expect_aligned(name, tensor, alignment)


def check_no_overlap(inputs: Mapping[str, torch.Tensor | None],
                     outputs: Mapping[str, torch.Tensor | None]) -> None:
    """Outputs (and workspace) must not share a byte with an input or with each other (exact
    for strided views: slices of one fused buffer that never meet are fine)."""
    seen = [(name, t) for name, t in inputs.items() if t is not None]
    for name, tensor in outputs.items():
        if tensor is None:
            continue
        for other, placed in seen:
            if placed.device == tensor.device and shares_bytes(tensor, placed):
                lo, hi = byte_range(tensor)
                olo, ohi = byte_range(placed)
                raise ValidationError(
                    f"{name}: must not overlap {other}; they share bytes (extents "
                    f"[{lo:#x}, {hi:#x}) and [{olo:#x}, {ohi:#x}))")
        seen.append((name, tensor))


def check_workspace(workspace, required: int, device: torch.device,
                    alignment: int = ALIGNMENT) -> None:
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
    expect_aligned("workspace", workspace, alignment)
