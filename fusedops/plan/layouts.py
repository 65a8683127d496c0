"""Which operands of a plan take strided views, decided per problem from the row widths."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ..core.checks import expect_contiguous
from ..core.dtypes import dtype_name, element_size
from ..errors import ValidationError


def check_activation_layouts(plan, descs, vectors: Mapping[str, int]) -> None:
    """Layout checks of a plan's construction tensors (``descs``). ``vectors``: activation
    operand name -> ``core.checks.row_vector`` of its rows. An activation whose rows are whole
    16-byte vectors takes views whose other strides are multiples of 16 bytes (the operands the
    plan declares ``strided``; the base class checks those). Where a row is not (vector 1), a
    contiguous tensor's rows are not 16-byte aligned either, so this plan instance takes that
    operand contiguous only: its strided flag is dropped for this plan, and a view is refused
    naming the row size. Every other operand (parameters, states, index data) is contiguous."""
    contiguous_only = {name for name, vector in vectors.items() if vector == 1}
    if contiguous_only:
        plan.operands = tuple(replace(o, strided=False) if o.name in contiguous_only else o
                              for o in type(plan).operands)
    strided = {o.name for o in plan.operands if o.strided}
    for name, desc in descs.items():
        if name in strided:
            continue
        if name in vectors and not desc.is_contiguous():
            size = desc.shape[-1] * element_size(desc.dtype)
            raise ValidationError(
                f"{name}: expected a contiguous tensor (a view needs rows of a multiple of 16 "
                f"bytes; {desc.shape[-1]} {dtype_name(desc.dtype)} elements make {size}), got "
                f"shape {list(desc.shape)} with strides {list(desc.stride)}")
        expect_contiguous(name, desc)
