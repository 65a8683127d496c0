"""Shared-memory layouts of the tensor-core operands: the swizzle and the matrix descriptors.

One swizzle function serves every reader and writer that the hardware swizzles for: TMA copies
write through it, wgmma and tcgen05 operands are read through it. (Kernels that place data
with ``st.shared``/``cp.async``/``ldmatrix`` compute swizzled addresses themselves, so their
data meets this function only where a descriptor reads it: the cross-check.) The swizzle XORs
bits [4, 4 + b) of the shared address with bits [7, 7 + b), b = 1, 2, 3 for the 32-, 64- and
128-byte modes: 16-byte chunks permuted within each 128-byte row, by the row's index in its
group of 8 (a function of the address itself, so a swizzled buffer must start on a multiple of
the pattern's repeat: 256, 512 or 1024 bytes).

Matrix descriptors (wgmma on sm_90, tcgen05 on sm_100) give an operand's start address, leading
and stride byte offsets (LBO, SBO) and swizzle mode; the element (row, k) of an operand with
rows along M or N and k along K lies at:

- K-major, swizzled (row width T = 32/64/128 bytes): ``(row // 8) * SBO + (row % 8) * T + k*e``
- K-major, not swizzled (8 x 16-byte core matrices): ``(row // 8) * SBO + (k*e // 16) * LBO +
  (row % 8) * 16 + k*e % 16``
- MN-major, swizzled: ``(row*e // T) * LBO + row*e % T + (k // 8) * SBO + (k % 8) * T``
- MN-major, not swizzled: ``(row*e // 16) * SBO + row*e % 16 + (k // 8) * LBO + (k % 8) * 16``

(e: bytes per element), before the swizzle of the absolute address.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .faults import UnsupportedPtx

SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}  # the bits of the swizzle: 1, 2, 3 -> width


def swizzle(address: np.ndarray, width_bytes: int) -> np.ndarray:
    """Shared addresses through the ``width_bytes`` (0, 32, 64, 128) swizzle."""
    if width_bytes == 0:
        return address
    bits = {32: 1, 64: 2, 128: 3}[width_bytes]
    mask = (1 << bits) - 1
    a = address.astype(np.int64)
    return a ^ (((a >> 7) & mask) << 4)


@dataclass(frozen=True)
class MatrixDescriptor:
    """A decoded shared-memory matrix descriptor."""

    start: int  # shared byte address
    lbo: int  # bytes
    sbo: int  # bytes
    swizzle: int  # 0, 32, 64, 128 bytes
    base_offset: int

    @classmethod
    def sm90(cls, desc: int) -> MatrixDescriptor:
        """wgmma's descriptor: start >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45,
        base offset in 49-51, swizzle in 62-63 (0 none, 1 128 B, 2 64 B, 3 32 B)."""
        mode = {0: 0, 1: 128, 2: 64, 3: 32}[(desc >> 62) & 3]
        return cls(
            ((desc & 0x3FFF) << 4),
            ((desc >> 16) & 0x3FFF) << 4,
            ((desc >> 32) & 0x3FFF) << 4,
            mode,
            (desc >> 49) & 7,
        )

    @classmethod
    def sm100(cls, desc: int) -> MatrixDescriptor:
        """tcgen05's descriptor: as sm90's for the address fields, a fixed version 1 in bits
        46-48, base offset in 49-51, the LBO mode in bit 52 and the swizzle in 61-63 (0 none,
        2 128 B, 4 64 B, 6 32 B; 1, the 128-byte swizzle with 32-byte atoms, is refused)."""
        if (desc >> 46) & 7 != 1:
            raise UnsupportedPtx(
                f"tcgen05 matrix descriptor {desc:#x}: version bits 46-48 "
                f"are {(desc >> 46) & 7}, expected 1"
            )
        code = (desc >> 61) & 7
        if code not in (0, 2, 4, 6):
            raise UnsupportedPtx(f"tcgen05 matrix descriptor {desc:#x}: swizzle mode {code}")
        if (desc >> 52) & 1:
            raise UnsupportedPtx(f"tcgen05 matrix descriptor {desc:#x}: the absolute LBO mode")
        return cls(
            ((desc & 0x3FFF) << 4),
            ((desc >> 16) & 0x3FFF) << 4,
            ((desc >> 32) & 0x3FFF) << 4,
            {0: 0, 2: 128, 4: 64, 6: 32}[code],
            (desc >> 49) & 7,
        )

    def offsets(self, rows: int, k: int, elem_bytes: int, mn_major: bool) -> np.ndarray:
        """[rows, k] shared byte addresses of the operand's elements (after the swizzle)."""
        if self.base_offset:
            raise UnsupportedPtx(
                f"matrix descriptors with a base offset ({self.base_offset}) " f"are not emulated"
            )
        r = np.arange(rows)[:, None]
        kk = np.arange(k)[None, :]
        e, t = elem_bytes, self.swizzle
        if not mn_major:
            kb = kk * e
            if t:
                if k * e > t:
                    raise UnsupportedPtx(
                        f"a K-major operand row of {k * e} B wider than its " f"{t}-byte swizzle"
                    )
                off = (r // 8) * self.sbo + (r % 8) * t + kb
            else:
                off = (r // 8) * self.sbo + (kb // 16) * self.lbo + (r % 8) * 16 + kb % 16
        else:
            rb = r * e
            if t:
                off = (rb // t) * self.lbo + rb % t + (kk // 8) * self.sbo + (kk % 8) * t
            else:
                off = (rb // 16) * self.sbo + rb % 16 + (kk // 8) * self.lbo + (kk % 8) * 16
        return swizzle(self.start + off, t)
