"""Limits and the fault the PTX emulator raises."""

WARP = 32
MAX_LANES_PER_BATCH = 1 << 14
MAX_STEPS = 10_000_000


class PtxFault(RuntimeError):
    """What a GPU would report as a fault or undefined behaviour, found while emulating."""
