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
from .overlap import byte_range, extents_meet, shares_bytes

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
    for strided views: slices of one fused buffer that never meet are fine). Pairs are searched
    only when some output's byte extent meets another tensor's."""
    entries = [(name, t, False) for name, t in inputs.items() if t is not None]
    entries += [(name, t, True) for name, t in outputs.items() if t is not None]
    spans = [(*byte_range(t), written) for _, t, written in entries]
    if extents_meet(span for span in spans if span[0] < span[1]):
        _raise_first_overlap(entries, spans)


def _raise_first_overlap(entries, spans) -> None:
    """Raises for the first written tensor (in order) sharing a byte with an earlier tensor,
    the earliest such: ``entries`` (name, tensor, written), inputs first, with their byte
    extents ``spans``."""
    seen = []
    for (name, tensor, written), (lo, hi, _) in zip(entries, spans):
        if written and lo < hi:
            for other, placed, olo, ohi in seen:
                if (lo < ohi and olo < hi and placed.device == tensor.device
                        and shares_bytes(tensor, placed)):
                    raise ValidationError(
                        f"{name}: must not overlap {other}; they share bytes (extents "
                        f"[{lo:#x}, {hi:#x}) and [{olo:#x}, {ohi:#x}))")
        seen.append((name, tensor, lo, hi))


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


SIGNATURES_REMEMBERED = 16   # argument signatures an ExecuteChecks keeps as passed


class ExecuteChecks:
    """execute()'s checks of the buffers handed in against a plan's declarations (host facts
    only), decided once per argument signature.

    ``operands``: per operand in execute()'s order, (name, planned TensorDesc or None where the
    plan was built without it, alignment in bytes, strided, written); ``workspace``: (bytes
    required, device, alignment). Called with execute()'s arguments by name, it raises the
    ValidationError the full checks raise first and returns None when they all pass. The full
    checks, in order: per operand, None where the plan was built without it, otherwise
    ``check_execute_tensor``; ``check_workspace``; ``check_no_overlap`` of the written operands
    (and the workspace, when one is required) against the others.

    A call's signature is, per argument (the workspace last), None or (type, dtype, shape,
    strides, device, data pointer modulo the alignment required): every fact the per-operand and
    workspace checks read, and no address. The first call with a signature runs those checks in
    full; a signature that passed is remembered (the ``capacity`` most recent) with each checked
    tensor's byte extent, and a later call with it runs none of them: fresh tensors of the same
    shapes, strides and dtypes (a training step's) take this path. Overlap depends on addresses
    and is checked on every call from the remembered extents: one sort and sweep of the byte
    ranges (``extents_meet``), so tensors in separate buffers cost nothing per pair; only when
    a written range meets another are pairs searched exactly (slices of one fused buffer that
    never meet pass), in ``check_no_overlap``'s order and with its message.
    """

    def __init__(self, operands, workspace: tuple[int, torch.device, int],
                 capacity: int = SIGNATURES_REMEMBERED) -> None:
        self._operands = tuple(operands)
        self._workspace = workspace
        self._capacity = capacity
        planned = [o for o in self._operands if o[1] is not None]
        self._absent = tuple(o[0] for o in self._operands if o[1] is None)
        self._names = tuple(o[0] for o in planned) + ("workspace",)
        self._alignments = tuple(max(o[2], 1) for o in planned) + (max(workspace[2], 1),)
        self._written = tuple(o[4] for o in planned) + (True,)
        # check_no_overlap's order: the read operands, the written ones, then the workspace
        self._order = tuple(sorted(range(len(self._names)), key=lambda i: self._written[i]))
        self._passed: dict[tuple, tuple[int, ...]] = {}

    def __call__(self, args: Mapping[str, object]) -> None:
        values = [args.get(name) for name in self._names]
        absent = [args.get(name) for name in self._absent]
        key = extents = None
        if absent.count(None) == len(absent):
            try:
                pointers = [0 if v is None else v.data_ptr() for v in values]
                key = tuple([None if v is None else
                             (type(v), v.dtype, v.shape, v.stride(), v.device, p % alignment)
                             for v, p, alignment in zip(values, pointers, self._alignments)])
                extents = self._passed.get(key)
            except Exception:            # not a tensor: refused by the full checks
                key = None
        if extents is None:
            extents, pointers = self._check_in_full(args)
            if key is not None:
                self._remember(key, extents)
        spans = [(p, p + n, w) for p, n, w in zip(pointers, extents, self._written) if n]
        if extents_meet(spans):
            entries, spans = [], []
            for i in self._order:
                if extents[i]:
                    name, written = self._names[i], self._written[i]
                    entries.append((name, args[name], written))
                    spans.append((pointers[i], pointers[i] + extents[i], written))
            _raise_first_overlap(entries, spans)

    def _check_in_full(self, args) -> tuple[tuple[int, ...], list[int]]:
        """Every check but overlap; returns, per planned operand and the workspace, the byte
        extent the overlap check covers (0 for an empty tensor or an unrequired workspace) and
        the data pointer."""
        extents, pointers = [], []
        for name, desc, alignment, strided, _ in self._operands:
            value = args.get(name)
            if desc is None:
                if value is not None:
                    raise ValidationError(f"{name}: this plan was built without {name}; expected "
                                          f"None, got {type(value).__name__}")
                continue
            check_execute_tensor(name, value, desc, alignment, strided)
            lo, hi = byte_range(value)
            extents.append(hi - lo)
            pointers.append(lo)
        required, device, alignment = self._workspace
        workspace = args.get("workspace")
        check_workspace(workspace, required, device, alignment)
        lo, hi = byte_range(workspace) if required else (0, 0)
        extents.append(hi - lo)
        pointers.append(lo)
        return tuple(extents), pointers

    def _remember(self, key: tuple, extents: tuple[int, ...]) -> None:
        passed = self._passed
        if len(passed) >= self._capacity:
            passed.pop(next(iter(passed), None), None)
        passed[key] = extents
