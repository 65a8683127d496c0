"""Global memory of a launch: the buffers it was handed, bounds-checked."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np

from .faults import PtxFault

if TYPE_CHECKING:
    from .program import Instr


class Memory:
    """Global memory: the byte ranges a launch may touch, read and written in place."""

    def __init__(self):
        self._ranges: list[tuple[int, int, str]] = []
        self._regions = None

    def add(self, address: int, nbytes: int, name: str) -> None:
        if nbytes > 0:
            self._ranges.append((address, address + nbytes, name))
            self._regions = None

    def add_tensor(self, tensor, name: str) -> None:
        """The bytes ``tensor`` spans (from its lowest to its highest element)."""
        if tensor.numel() == 0:
            return
        if any(st < 0 for st in tensor.stride()):
            raise PtxFault(f"{name}: negative strides are not emulated")
        span = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride())) + 1
        self.add(tensor.data_ptr(), span * tensor.element_size(), name)

    def regions(self):
        """(lows, highs, names, byte views) of the ranges, overlapping ones merged."""
        if self._regions is None:
            merged = []
            for lo, hi, name in sorted(self._ranges):
                if merged and lo <= merged[-1][1]:
                    plo, phi, pname = merged[-1]
                    merged[-1] = (plo, max(phi, hi), pname if name in pname.split("|") else f"{pname}|{name}")
                else:
                    merged.append((lo, hi, name))
            self._regions = (np.array([m[0] for m in merged], dtype=np.uint64),
                             np.array([m[1] for m in merged], dtype=np.uint64),
                             [m[2] for m in merged],
                             [np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))
                              for lo, hi, _ in merged])
        return self._regions

    def _locate(self, addr: np.ndarray, nbytes: int, instr: Instr, lanes, what: str):
        lows, highs, names, views = self.regions()
        which = np.searchsorted(lows, addr, side="right").astype(np.int64) - 1
        ok = which >= 0
        ok[ok] &= addr[ok] + np.uint64(nbytes) <= highs[which[ok]]
        if not ok.all():
            bad = int(np.argmin(ok))
            ranges = ", ".join(f"{n} [{int(lo):#x}, {int(hi):#x})" for lo, hi, n in zip(lows, highs, names))
            raise PtxFault(f"out-of-bounds global {what} of {nbytes} B at {int(addr[bad]):#x} by "
                           f"{lanes(bad)} in '{instr.text}'; the launch's buffers: {ranges}")
        if nbytes > 1 and (addr % np.uint64(nbytes)).any():
            bad = int(np.argmax(addr % np.uint64(nbytes) != 0))
            raise PtxFault(f"misaligned global {what} of {nbytes} B at {int(addr[bad]):#x} by "
                           f"{lanes(bad)} in '{instr.text}'")
        return which

    def _pieces(self, addr, which):
        lows, _, _, views = self.regions()
        for r in np.unique(which):
            sel = which == r
            yield views[r], sel, (addr[sel] - lows[r]).astype(np.int64)

    def load(self, addr, nbytes, instr, lanes) -> np.ndarray:
        which = self._locate(addr, nbytes, instr, lanes, "load")
        out = np.empty((len(addr), nbytes), dtype=np.uint8)
        for view, sel, offs in self._pieces(addr, which):
            out[sel] = view[offs[:, None] + np.arange(nbytes)]
        return out

    def store(self, addr, data: np.ndarray, instr, lanes) -> None:
        which = self._locate(addr, data.shape[1], instr, lanes, "store")
        for view, sel, offs in self._pieces(addr, which):
            view[offs[:, None] + np.arange(data.shape[1])] = data[sel]
