"""Construction checks the attention plans share: the status word, the head dim's row bytes, and
a paged cache with its block table."""

from __future__ import annotations

import torch

from ..core.checks import ALIGNMENT, expect_dtype, expect_ndim, expect_shape
from ..core.dtypes import dtype_name
from ..core.status import STATUS_DTYPE
from ..errors import ValidationError
from .contract import PAGE_MULTIPLE


def has_status(descs) -> bool:
    """Whether a status word is given (checked: int32 [1])."""
    status = descs.get("status")
    if status is None:
        return False
    expect_dtype("status", status, (STATUS_DTYPE,))
    expect_shape("status", status, (1,), "[1]")
    return True


def host_values(t) -> list[int]:
    """The values of an index tensor, on the host (a synchronisation: host checks only)."""
    return t.detach().reshape(-1).to("cpu", torch.int64).tolist()


def expect_head_bytes(name: str, desc) -> None:
    """Rows of d elements start 16-byte aligned in every [..., h, d] tensor (the kernels take
    strides in 16-byte vectors): d·element size a multiple of 16 bytes."""
    d, e = desc.shape[-1], desc.element_size
    if (d * e) % ALIGNMENT:
        raise ValidationError(
            f"{name}: expected a head dim of a multiple of {ALIGNMENT} bytes (d a multiple of "
            f"{max(1, ALIGNMENT // e)} for {dtype_name(desc.dtype)}), got d = {d}")


def paged_table(descs, cache: str, rows: int, rows_name: str) -> tuple[int, int, int]:
    """Checks block_table [rows, max_pages] int32 and the paged ``cache`` [num_pages, page_size,
    ...] (page_size a multiple of PAGE_MULTIPLE); returns (page_size, max_pages, num_pages)."""
    table = descs["block_table"]
    expect_dtype("block_table", table, (torch.int32,))
    expect_ndim("block_table", table, 2, f"[{rows_name}, max_pages]")
    if table.shape[0] != rows:
        raise ValidationError(f"block_table: expected [{rows_name}, max_pages] with {rows_name} = "
                              f"{rows}, got {list(table.shape)}")
    page_size = descs[cache].shape[1]
    if page_size % PAGE_MULTIPLE:
        raise ValidationError(f"{cache}: expected a page size that is a multiple of "
                              f"{PAGE_MULTIPLE}, got {page_size}")
    return page_size, table.shape[1], descs[cache].shape[0]
