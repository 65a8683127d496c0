"""The device-side status word: how kernels report invalid index data without a host read.

Plans that read index tensors (cu_seqlens, sequence ids, block tables, cache lengths, slot
indices, accepted counts, expert ids) take an optional ``status`` operand: an int32 tensor of one
element on the plan's device. Every kernel that finds an invalid entry ORs the bit of that kind of violation
into it (an integer OR: order-independent, so deterministic) and then clamps or masks, so no
access leaves the buffers it was handed, whatever the index data holds. fusedops never clears
the word: zero it when a step starts (``status.zero_()``, capturable in a CUDA Graph), read it
when convenient (``Status(int(status))`` synchronises; do it after the step, or every N steps).
"""

from __future__ import annotations

import enum

import torch

from ..errors import ValidationError


class Status(enum.IntFlag):
    """One bit per kind of invalid index data (what the kernels clamped or masked)."""

    OK = 0
    CU_SEQLENS = 1 << 0          # not starting at 0, decreasing, or past the packed tokens
    BLOCK_TABLE = 1 << 1         # a page a row needs is negative or past the page pool
    CACHE_SEQLENS = 1 << 2       # negative, or too long for the new tokens to fit
    SLOT_INDEX = 1 << 3          # a state slot past the state cache (negative = padding: valid)
    ACCEPTED_COUNT = 1 << 4      # accepted tokens outside [0, T]
    EXPERT_ID = 1 << 5           # an expert id outside [0, E) other than -1 (padding)
    SEQ_IDX = 1 << 6             # a sequence id negative or smaller than the one before it

    def describe(self) -> str:
        """The violated kinds, by name ("OK" when none)."""
        if not self:
            return "OK"
        return ", ".join(flag.name.lower() for flag in Status if flag and flag in self)


STATUS_DTYPE = torch.int32


def read_status(status: torch.Tensor) -> Status:
    """The flags a status word holds (a host read: synchronises with its device)."""
    return Status(int(status.reshape(-1)[0].item()))


def raise_for_status(status: torch.Tensor, where: str = "") -> None:
    """Raises ValidationError naming the violated kinds when the word is not zero (a host read)."""
    flags = read_status(status)
    if flags:
        raise ValidationError(f"{where + ': ' if where else ''}invalid index data: {flags.describe()}"
                              f" (status {int(flags):#x})")
