"""Mamba2 inference tiles: the per-architecture block table of the state update and the rollback,
and the head-dim rows an update program holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from fusedops.core.target import target_arch


# -- tiles -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeTiles:
    """One entry of the block table. BP: head-dim rows per update program (nearest rounding);
    BP_STOCHASTIC: the same with stochastic rounding (Philox keeps four 32-bit words per element
    live); ELEMENTS_PER_WARP: state elements per warp (warps = BP·n / it, at most MAX_WARPS);
    ROLLBACK_BLOCK: state elements per rollback program."""

    BP: int = 16
    BP_STOCHASTIC: int = 8
    ELEMENTS_PER_WARP: int = 256
    MAX_WARPS: int = 8
    ROLLBACK_BLOCK: int = 4096
TILES = {
    "sm_80": (DecodeTiles(16, 8, 256, 8, 4096),
              "8 state elements a thread at n = 128; programs fill the 108 SMs many times"),
    "sm_90": (DecodeTiles(16, 8, 256, 8, 4096),
              "the [16, n] state tile in fp32 registers, 8 elements a thread"),
    "sm_100": (DecodeTiles(16, 8, 256, 8, 4096),
               "as sm_90 (148 SMs): bound by reading and writing the state"),
}


def tiles_for(problem) -> DecodeTiles:
    """The block table's entry for the plan's architecture."""
    return TILES[target_arch(problem.device)][0]


def candidates(problem) -> list[DecodeTiles]:
    """Autotune candidates: the table's entry first, then 32 and 8 head-dim rows per update
    program (fewer B/C re-reads per head, or more programs) and 2048 / 8192 elements per
    rollback program."""
    base = tiles_for(problem)
    out = [base, replace(base, BP=32, BP_STOCHASTIC=16), replace(base, BP=8, BP_STOCHASTIC=4),
           replace(base, ROLLBACK_BLOCK=2048), replace(base, ROLLBACK_BLOCK=8192)]
    return list(dict.fromkeys(out))


def head_dim_rows(problem, tiles: DecodeTiles | None = None) -> int:
    """Head-dim rows per program: the table's BP (BP_STOCHASTIC with stochastic rounding), at
    most p rounded up to a power of two."""
    tiles = tiles or tiles_for(problem)
    rows = tiles.BP_STOCHASTIC if problem.stochastic else tiles.BP
    return max(1, min(rows, triton.next_power_of_2(problem.head_dim)))
