"""Shared-memory race check for the "skewed" schedule: which warps wrote and read each byte
since the CTA's last barrier."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .faults import DataRace

if TYPE_CHECKING:
    from .machine import Machine


class RaceCheck:
    """Per shared byte, the warps that wrote its current value and the warps that read it since
    the CTA's last barrier. A read of a value only other warps wrote, or a write that changes a
    value another warp wrote or read, with no barrier between them, is a ``DataRace`` (as
    compute-sanitizer's racecheck, two warps writing the same value is not one)."""

    def __init__(self, m: Machine) -> None:
        size = m.shared.shape
        self.writers = np.zeros(size, dtype=np.uint64)
        self.write_epoch = np.full(size, -1, dtype=np.int64)
        self.readers = np.zeros(size, dtype=np.uint64)
        self.read_epoch = np.full(size, -1, dtype=np.int64)

    @staticmethod
    def _lanes(m: Machine, offs: np.ndarray, L):
        idx = m.index(L)
        warp = m.warp_in_cta[idx][:, None]
        bit = np.broadcast_to(np.uint64(1) << warp.astype(np.uint64), offs.shape)
        epoch = np.broadcast_to(m.epoch[m.cta_index[idx]][:, None], offs.shape)
        return warp, bit, epoch

    def read(self, m: Machine, offs: np.ndarray, L, where: str) -> None:
        warp, bit, epoch = self._lanes(m, offs, L)
        writers = self.writers[offs]
        clash = (self.write_epoch[offs] == epoch) & (writers != 0) & ((writers & bit) == 0)
        if clash.any():
            i, j = (int(v[0]) for v in np.nonzero(clash))
            raise DataRace(
                f"{where}: warp {int(warp[i, 0])} ({m.who(L)(i)}) reads shared offset "
                f"{int(offs[i, j] % m.shared_size)} that warps {_warps(writers[i, j])} "
                f"wrote with no barrier between them"
            )
        flat, bits, epochs = offs.ravel(), bit.ravel(), epoch.ravel()
        stale = self.read_epoch[flat] != epochs
        self.readers[flat[stale]] = 0
        self.read_epoch[flat] = epochs
        np.bitwise_or.at(self.readers, flat, bits)

    def write(self, m: Machine, offs: np.ndarray, L, where: str, data: np.ndarray) -> None:
        warp, bit, epoch = self._lanes(m, offs, L)
        changes = m.shared[offs] != data
        same = self.write_epoch[offs] == epoch
        others_wrote = same & ((self.writers[offs] & ~bit) != 0)
        others_read = (self.read_epoch[offs] == epoch) & ((self.readers[offs] & ~bit) != 0)
        clash = changes & (others_wrote | others_read)
        if clash.any():
            i, j = (int(v[0]) for v in np.nonzero(clash))
            other = (
                f"written by warps {_warps(self.writers[offs[i, j]])}"
                if others_wrote[i, j]
                else f"read by warps {_warps(self.readers[offs[i, j]] & ~bit[i, j])}"
            )
            raise DataRace(
                f"{where}: warp {int(warp[i, 0])} ({m.who(L)(i)}) changes shared offset "
                f"{int(offs[i, j] % m.shared_size)} {other} with no barrier between them"
            )
        flat = offs.ravel()
        keep = (same & ~changes).ravel()
        self.writers[flat[~keep]] = 0
        self.write_epoch[flat] = epoch.ravel()
        np.bitwise_or.at(self.writers, flat, bit.ravel())
        order = np.argsort(flat, kind="stable")
        f, d = flat[order], data.ravel()[order]
        w = np.broadcast_to(warp, offs.shape).ravel()[order]
        dup = (f[1:] == f[:-1]) & (d[1:] != d[:-1]) & (w[1:] != w[:-1])
        if dup.any():  # within a warp the highest lane's value stands, as on a GPU
            raise DataRace(
                f"{where}: two warps write different values to shared offset "
                f"{int(f[1:][dup][0] % m.shared_size)} in one instruction"
            )

    def async_issue(self, m: Machine, offs: np.ndarray, L, where: str) -> None:
        """Asynchronous copies into shared memory issued by lanes ``L`` (row i of ``offs``: the
        bytes of lane i's copy): they may land at any time from now, so no other warp may still
        read or write those bytes in this epoch."""
        offs = offs.reshape(m.count(L), -1)
        warp, bit, epoch = self._lanes(m, offs, L)
        others = ((self.read_epoch[offs] == epoch) & ((self.readers[offs] & ~bit) != 0)) | (
            (self.write_epoch[offs] == epoch) & ((self.writers[offs] & ~bit) != 0)
        )
        if others.any():
            i, j = (int(v[0]) for v in np.nonzero(others))
            raise DataRace(
                f"{where}: an asynchronous copy issued by warp {int(warp[i, 0])} "
                f"({m.who(L)(i)}) overwrites shared offset "
                f"{int(offs[i, j] % m.shared_size)}, which another warp accessed with "
                f"no barrier since: a buffer reused while still in use"
            )

    def async_landed(self, offs: np.ndarray) -> None:
        """An asynchronous copy's bytes landed: they are ordered by the waits on its
        mbarrier, not by barriers, so no warp counts as their writer."""
        flat = offs.ravel()
        self.writers[flat] = 0
        self.write_epoch[flat] = -1


def _warps(mask) -> list[int]:
    mask = int(mask)
    return [w for w in range(64) if mask >> w & 1]
