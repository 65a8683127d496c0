"""The analytic cost of a kernel launch or of an operator: FLOPs and HBM bytes.

Backends attach a ``Cost`` to every kernel they launch, counted from the kernel's own tiles, loop
structure and program order (docs/performance.md, "How traffic is counted": a tile re-read by
programs of the same wave counts once when the wave's working set fits in L2, a re-read in a
later wave counts again, values passed between kernels always count). Operator contracts give the
minimum FLOPs and bytes any implementation needs (each input read once, each output written
once). The kernel report (``fusedops kernels``) compares the two and puts them against the
roofline of each GPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """FLOPs and HBM bytes of one launch (or the sum of several).

    ``mma_flops``: the part of ``flops`` done by tensor-core matrix multiplies (the rest runs on
    the CUDA cores), duplicated work included; ``mma_duplication``: how many times the kernel's
    warps (warpgroups) compute each tensor-core product, averaged over its products (1: no
    warpgroup repeats another's work), stated by the backend from its warp layout and checked
    against the compiled code; ``mma_rows``: rows of the matrix-multiply tile one CTA owns.
    """

    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    mma_flops: float = 0.0
    mma_rows: int = 0
    mma_duplication: float = 1.0

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                    self.bytes_written + other.bytes_written, self.mma_flops + other.mma_flops,
                    max(self.mma_rows, other.mma_rows),
                    max(self.mma_duplication, other.mma_duplication))

    def floor_seconds(self, tflops: float, tbps: float) -> float:
        """The roofline time: the larger of FLOPs at ``tflops`` TFLOP/s and bytes at ``tbps``
        TB/s."""
        return max(self.flops / (tflops * 1e12), self.bytes / (tbps * 1e12))


ZERO = Cost()


def total(costs) -> Cost:
    """The sum of ``costs``."""
    out = ZERO
    for cost in costs:
        out = out + cost
    return out
