"""Global memory of a launch: the buffers it was handed, bounds-checked, read and written in
place."""

from __future__ import annotations

import ctypes

import numpy as np

from .faults import PtxFault

PARAMETER_PREFIX = "kernel parameter "


class Memory:
    """The byte ranges a launch may touch. A kernel access outside them, or one misaligned to
    its width, raises ``PtxFault`` naming the instruction, the thread and the buffers."""

    def __init__(self):
        self._ranges: list[tuple[int, int, str, bool]] = []
        self._regions = None
        self._keep: list = []  # host arrays registered here (kept alive)

    def add(self, address: int, nbytes: int, name: str, writable: bool = True) -> None:
        """Registers ``nbytes`` at ``address`` under ``name``."""
        if nbytes > 0:
            self._ranges.append((address, address + nbytes, name, writable))
            self._regions = None

    def add_tensor(self, tensor, name: str) -> None:
        """The bytes ``tensor`` spans (from its lowest to its highest element)."""
        if tensor.numel() == 0:
            return
        if any(st < 0 for st in tensor.stride()):
            raise PtxFault(f"{name}: negative strides are not emulated")
        span = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride())) + 1
        self.add(tensor.data_ptr(), span * tensor.element_size(), name)

    def add_array(self, array: np.ndarray, name: str, writable: bool = True) -> int:
        """Registers a host array (kept alive by this object); returns its address."""
        self._keep.append(array)
        address = array.ctypes.data
        self.add(address, array.nbytes, name, writable)
        return address

    def regions(self):
        """(lows, highs, names, writable, byte views) of the ranges, overlapping ones merged."""
        if self._regions is None:
            merged: list[list] = []
            for lo, hi, name, writable in sorted(self._ranges):
                if merged and lo <= merged[-1][1]:
                    last = merged[-1]
                    last[1] = max(last[1], hi)
                    if name not in last[2].split("|"):
                        last[2] = f"{last[2]}|{name}"
                    last[3] = last[3] and writable
                else:
                    merged.append([lo, hi, name, writable])
            self._regions = (
                np.array([m[0] for m in merged], dtype=np.uint64),
                np.array([m[1] for m in merged], dtype=np.uint64),
                [m[2] for m in merged],
                [m[3] for m in merged],
                [
                    np.ctypeslib.as_array((ctypes.c_uint8 * (m[1] - m[0])).from_address(m[0]))
                    for m in merged
                ],
            )
        return self._regions

    def describe(self) -> str:
        """The registered buffers (but the kernel's own parameter blocks) with their ranges."""
        lows, highs, names, _, _ = self.regions()
        return ", ".join(
            f"{n} [{int(lo):#x}, {int(hi):#x})"
            for lo, hi, n in zip(lows, highs, names)
            if not n.startswith(PARAMETER_PREFIX)
        )

    def locate(self, addr: np.ndarray, nbytes: int, where, who, what: str, write: bool = False):
        """The region index of each address (``addr`` uint64), after checking that every access
        of ``nbytes`` lies inside one region and is aligned to ``nbytes`` (``who(i)`` names the
        i-th access's thread)."""
        lows, highs, names, writable, _ = self.regions()
        which = np.searchsorted(lows, addr, side="right").astype(np.int64) - 1
        ok = which >= 0
        ok[ok] &= addr[ok] + np.uint64(nbytes) <= highs[which[ok]]
        if not ok.all():
            bad = int(np.argmin(ok))
            raise PtxFault(
                f"out-of-bounds global {what} of {nbytes} B at {int(addr[bad]):#x} by "
                f"{who(bad)} in {where}; the launch's buffers: {self.describe()}"
            )
        if nbytes > 1:
            misaligned = addr % np.uint64(min(nbytes, 16)) != 0
            if misaligned.any():
                bad = int(np.argmax(misaligned))
                raise PtxFault(
                    f"misaligned global {what} of {nbytes} B at {int(addr[bad]):#x} by "
                    f"{who(bad)} in {where}"
                )
        if write:
            for r in np.unique(which):
                if not writable[r]:
                    raise PtxFault(f"global store into read-only {names[r]} by {where}")
        return which

    def _pieces(self, addr, which):
        lows, _, _, _, views = self.regions()
        if len(which) and (which == which[0]).all():
            r = int(which[0])
            yield views[r], slice(None), (addr - lows[r]).astype(np.int64)
            return
        for r in np.unique(which):
            sel = which == r
            yield views[r], sel, (addr[sel] - lows[r]).astype(np.int64)

    def load(self, addr: np.ndarray, nbytes: int, where, who) -> np.ndarray:
        """[len(addr), nbytes] bytes read at ``addr``."""
        which = self.locate(addr, nbytes, where, who, "load")
        out = np.empty((len(addr), nbytes), dtype=np.uint8)
        for view, sel, offs in self._pieces(addr, which):
            out[sel] = view[offs[:, None] + np.arange(nbytes)]
        return out

    def store(self, addr: np.ndarray, data: np.ndarray, where, who) -> None:
        """Writes ``data`` ([len(addr), nbytes] bytes) at ``addr``; where two accesses write the
        same bytes the later lane's data stands (a GPU picks one of them)."""
        which = self.locate(addr, data.shape[1], where, who, "store", write=True)
        for view, sel, offs in self._pieces(addr, which):
            view[offs[:, None] + np.arange(data.shape[1])] = data[sel]

    def view(self, address: int, nbytes: int, where) -> np.ndarray:
        """The ``nbytes`` at ``address`` as a writable byte view (one region must hold them)."""
        lows, highs, _, _, views = self.regions()
        r = int(np.searchsorted(lows, np.uint64(address), side="right")) - 1
        if r < 0 or address + nbytes > int(highs[r]):
            raise PtxFault(
                f"out-of-bounds global access of {nbytes} B at {address:#x} in {where}; "
                f"the launch's buffers: {self.describe()}"
            )
        start = address - int(lows[r])
        return views[r][start : start + nbytes]
