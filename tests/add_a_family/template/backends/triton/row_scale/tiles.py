"""Row scale tiles: columns per program, per architecture."""

from __future__ import annotations

from dataclasses import dataclass

from fusedops.core.target import target_arch


@dataclass(frozen=True)
class RowTiles:
    """BLOCK: the columns one program covers."""

    BLOCK: int = 1024


TILES = {
    "sm_80": (RowTiles(1024), "one 16-byte vector per thread over 4 warps"),
    "sm_90": (RowTiles(1024), "one 16-byte vector per thread over 4 warps"),
    "sm_100": (RowTiles(1024), "one 16-byte vector per thread over 4 warps"),
}


def tiles_for(problem) -> RowTiles:
    """The table's entry for the plan's architecture."""
    return TILES[target_arch(problem.device)][0]
