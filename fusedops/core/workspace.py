"""Carving one caller buffer (workspace, saved state) into typed pieces.

Pieces start at 128-byte aligned offsets. ``Layout.carve`` returns ``Region``s: a launcher passes
a region to a GPU kernel as a raw address (no tensor is made: execute dispatches no torch
operator), and to the CPU interpreter as a tensor view.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .dtypes import element_size as _element_size

PIECE_ALIGNMENT = 128


class Region(NamedTuple):
    """``numel`` elements of ``dtype`` at byte ``offset`` of ``buffer``."""

    buffer: torch.Tensor
    offset: int
    dtype: torch.dtype
    numel: int

    def address(self) -> int:
        return self.buffer.data_ptr() + self.offset

    def tensor(self) -> torch.Tensor:
        """A view (allocates nothing; dispatches torch operators: for CPU paths and tests)."""
        size = _element_size(self.dtype)
        return self.buffer[self.offset:self.offset + self.numel * size].view(self.dtype)


class Layout:
    """Named pieces (dtype, element count) of one byte buffer, in order."""

    def __init__(self, pieces) -> None:
        self.offsets: dict[str, tuple[int, torch.dtype, int]] = {}
        cursor = 0
        for name, dtype, numel in pieces:
            if numel <= 0:
                continue
            cursor = -(-cursor // PIECE_ALIGNMENT) * PIECE_ALIGNMENT
            self.offsets[name] = (cursor, dtype, numel)
            cursor += numel * _element_size(dtype)
        self.size = cursor

    def __contains__(self, name: str) -> bool:
        return name in self.offsets

    def carve(self, buffer: torch.Tensor, name: str) -> Region:
        """The piece ``name`` of ``buffer`` (which holds at least ``size`` bytes)."""
        offset, dtype, numel = self.offsets[name]
        return Region(buffer, offset, dtype, numel)

    def __repr__(self) -> str:
        pieces = ", ".join(f"{n}: {numel} x {str(d).removeprefix('torch.')} @ {o}"
                           for n, (o, d, numel) in self.offsets.items())
        return f"Layout({self.size} bytes; {pieces})"


def aligned_bytes(nbytes: int, alignment: int, device) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose address is a multiple of ``alignment`` (a view into a
    slightly larger allocation where the allocator aligns less: CPU memory)."""
    buffer = torch.empty(nbytes + alignment, dtype=torch.uint8, device=device)
    offset = -buffer.data_ptr() % alignment
    return buffer[offset:offset + nbytes]


EMPTY = Layout(())
"""The layout of a buffer a program does not need."""
