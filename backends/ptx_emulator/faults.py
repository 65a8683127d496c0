"""Limits and the faults the PTX emulator raises."""

WARP = 32
WARPGROUP = 4 * WARP
MAX_LANES_PER_BATCH = 1 << 13
MAX_STEPS = 20_000_000


class PtxFault(RuntimeError):
    """What a GPU would report as a fault or undefined behaviour, found while emulating."""


class UnsupportedPtx(PtxFault):
    """PTX the emulator does not model (refused by name, never computed wrong)."""


class DataRace(PtxFault):
    """Two warps touched the same shared-memory bytes, at least one writing, with no barrier
    between them; or an asynchronous operation's operands were touched while it was in flight."""


class Deadlock(PtxFault):
    """Every live thread of a CTA waits (barrier, mbarrier, collective) and nothing in flight
    can release any of them."""
