"""Global-memory traffic of Triton kernels run on Triton's CPU interpreter, recorded access by
access: what the kernels' cost models (docs/performance.md, "How traffic is counted") are
checked against.

``record_traffic()`` patches the interpreter's memory hooks for the block (and restores them):
every pointer load and store (masked lanes excluded), tensor-descriptor load and store (the box
clipped to the tensor's bounds: the interpreter masks what lies outside) and atomic (read and
written) is recorded as the 32-byte sectors (address // 32) it touches, per launch (``Launch``:
kernel name, grid) and per program, in issue order. A launch's compulsory traffic is its unique
sectors read and written, times 32 (``Launch.read_bytes``, ``Launch.written_bytes``): what it
moves from and to HBM under an L2 that never evicts. ``exclude`` takes byte ranges that are not
data traffic (a launch's global scratch, where compiled code keeps its tensor descriptors; the
interpreter keeps them in host memory and never touches it, so excluding it changes nothing
there).

``lru_traffic`` replays a launch's per-program streams through an exact LRU cache of a given
size with R programs resident at once (their streams interleaved access by access, a new
program taking the slot of one that finished, in launch order): the HBM bytes of a GPU running
R CTAs concurrently under an ideal L2.

Needs ``TRITON_INTERPRET=1`` set before triton is first imported (tests/conftest.py does).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

SECTOR = 32
"""Bytes per sector: the unit in which L2 and HBM move data."""


@dataclass
class Access:
    """One memory instruction of one program: the unique sectors it touches (sorted), whether
    it reads and whether it writes them (an atomic does both), and the exact bytes (their
    addresses, unique) behind them."""

    program: int
    sectors: np.ndarray
    addresses: np.ndarray
    read: bool
    write: bool


@dataclass
class Launch:
    """One kernel launch under the recorder: the kernel's name, its grid and every access its
    programs issued, in issue order. ``program`` ids are in launch order, the first grid
    dimension fastest (x + gx * (y + gy * z)), as a GPU starts them (the interpreter runs them
    in another order, each program to its end)."""

    kernel: str
    grid: tuple[int, int, int] = (1, 1, 1)
    accesses: list[Access] = field(default_factory=list)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def _unique(self, read: bool, what: str) -> np.ndarray:
        parts = [getattr(a, what) for a in self.accesses if (a.read if read else a.write)]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)

    def read_sectors(self) -> np.ndarray:
        """The unique sectors the launch reads."""
        return self._unique(True, "sectors")

    def written_sectors(self) -> np.ndarray:
        """The unique sectors the launch writes."""
        return self._unique(False, "sectors")

    @property
    def read_bytes(self) -> int:
        """Compulsory bytes read: unique sectors read times ``SECTOR``."""
        return SECTOR * len(self.read_sectors())

    @property
    def written_bytes(self) -> int:
        """Compulsory bytes written: unique sectors written times ``SECTOR``."""
        return SECTOR * len(self.written_sectors())

    @property
    def exact_read_bytes(self) -> int:
        """Unique bytes read (no sector rounding): a diagnostic beside ``read_bytes``."""
        return len(self._unique(True, "addresses"))

    @property
    def exact_written_bytes(self) -> int:
        """Unique bytes written (no sector rounding)."""
        return len(self._unique(False, "addresses"))

    def streams(self) -> list[list[Access]]:
        """Per program in launch order, its accesses in issue order."""
        out: list[list[Access]] = [[] for _ in range(self.programs)]
        for a in self.accesses:
            out[a.program].append(a)
        return out


@dataclass
class Trace:
    """The launches recorded in a ``record_traffic`` block, in launch order."""

    launches: list[Launch] = field(default_factory=list)
    exclude: tuple[tuple[int, int], ...] = ()


def _element_bytes(ptr_dtype) -> int:
    ty = ptr_dtype
    while hasattr(ty, "element_ty"):
        ty = ty.element_ty
    return max(ty.primitive_bitwidth // 8, 1)


@contextlib.contextmanager
def record_traffic(exclude: Sequence[tuple[int, int]] = ()) -> Iterator[Trace]:
    """Records every global access of the Triton kernels launched in the block (on the CPU
    interpreter) into the yielded ``Trace``; the interpreter's hooks are restored on exit.
    ``exclude``: [start, end) byte ranges whose accesses are not recorded."""
    from triton.runtime import interpreter as interp

    builder_cls, executor_cls = interp.InterpreterBuilder, interp.GridExecutor
    trace = Trace(exclude=tuple((int(s), int(e)) for s, e in exclude))
    saved = {name: getattr(builder_cls, name) for name in (
        "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
        "set_grid_dim")}
    saved_call = executor_cls.__call__
    state: dict = dict(launch=None)

    def note(builder, ptrs, mask, read: bool, write: bool) -> None:
        launch = state["launch"]
        if launch is None:
            return
        addresses = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool),
                                                  addresses.shape)]
        addresses = addresses.reshape(-1)
        for start, end in trace.exclude:
            addresses = addresses[(addresses < start) | (addresses >= end)]
        if not addresses.size:
            return
        size = _element_bytes(ptrs.dtype)
        exact = np.unique((addresses[:, None] + np.arange(size, dtype=np.uint64)).reshape(-1))
        x, y, z = builder.grid_idx
        gx, gy, _ = builder.grid_dim
        launch.accesses.append(Access(int(x + gx * (y + gy * z)), np.unique(exact // SECTOR),
                                      exact, read, write))

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        note(self, ptrs, mask, True, False)
        return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        note(self, ptrs, mask, False, True)
        return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        note(self, ptr, mask, True, True)
        return saved["create_atomic_rmw"](self, rmw_op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        note(self, ptr, None, True, True)
        return saved["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    def set_grid_dim(self, nx, ny, nz):
        if state["launch"] is not None:
            state["launch"].grid = (int(nx), int(ny), int(nz))
        return saved["set_grid_dim"](self, nx, ny, nz)

    def call(self, *args, **kwargs):
        outer = state["launch"]
        state["launch"] = Launch(getattr(self.fn, "__name__", str(self.fn)))
        trace.launches.append(state["launch"])
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            state["launch"] = outer

    patches = dict(create_masked_load=masked_load, create_masked_store=masked_store,
                   create_atomic_rmw=atomic_rmw, create_atomic_cas=atomic_cas,
                   set_grid_dim=set_grid_dim)
    try:
        for name, fn in patches.items():
            setattr(builder_cls, name, fn)
        executor_cls.__call__ = call
        yield trace
    finally:
        for name, fn in saved.items():
            setattr(builder_cls, name, fn)
        executor_cls.__call__ = saved_call


def lru_traffic(launch: Launch, l2_bytes: float, resident: int) -> tuple[int, int]:
    """(bytes read from HBM, bytes written to HBM) of ``launch`` through an exact LRU cache of
    ``l2_bytes`` (whole sectors), write-back and write-allocate, with ``resident`` programs
    running at once.

    Programs start in launch order: ``resident`` slots, each running one program's accesses in
    its issue order; the slots take turns, one access each (round robin), and a slot whose
    program has finished takes the next program. A read of a sector not in the cache costs
    ``SECTOR`` bytes; a write makes the sector resident and dirty without reading it; a dirty
    sector costs ``SECTOR`` bytes written when evicted, and every dirty sector left is written
    at the end of the launch."""
    capacity = max(int(l2_bytes // SECTOR), 1)
    cache: collections.OrderedDict[int, bool] = collections.OrderedDict()
    read = written = 0
    pending = collections.deque(s for s in launch.streams() if s)
    slots: list[collections.deque] = []
    turn = 0
    while pending or slots:
        while pending and len(slots) < resident:
            slots.append(collections.deque(pending.popleft()))
        if turn >= len(slots):
            turn = 0
        access = slots[turn].popleft()
        for sector in access.sectors.tolist():
            dirty = cache.pop(sector, None)
            if dirty is None and access.read:
                read += SECTOR
            cache[sector] = bool(dirty) or access.write
            if len(cache) > capacity:
                _, evicted_dirty = cache.popitem(last=False)
                written += SECTOR * evicted_dirty
        if slots[turn]:
            turn += 1
        else:
            slots.pop(turn)
    written += SECTOR * sum(cache.values())
    return read, written
