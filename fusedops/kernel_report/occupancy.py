"""Occupancy: how many CTAs of a kernel fit on one SM, and how many waves its grid takes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.machines import machine, waves as wave_count


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int
    limited_by: str              # registers, shared memory, threads or CTAs
    waves: float                 # grid CTAs / (CTAs per SM x SMs)


def occupancy(arch: str, registers: int, threads: int, shared_bytes: int, grid_ctas: int) -> Occupancy:
    """CTAs per SM from registers (allocated per warp in units of 256), shared memory (plus the
    per-CTA reservation), threads and the CTA limit; waves over the arch's SM count."""
    lim = machine(arch)
    warps = max(1, math.ceil(threads / 32))
    per_warp = math.ceil(max(registers, 1) * 32 / lim.register_granularity) * lim.register_granularity
    by = {
        "registers": (lim.registers // per_warp) // warps,
        "threads": lim.max_threads // max(threads, 1),
        "CTAs": lim.max_ctas,
    }
    if shared_bytes:
        by["shared memory"] = lim.shared_bytes // (shared_bytes + lim.shared_reserved_per_cta)
    limited_by = min(by, key=by.get)
    ctas = by[limited_by]
    return Occupancy(ctas, limited_by, wave_count(grid_ctas, lim.sms, ctas))
