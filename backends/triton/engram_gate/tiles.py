"""Engram gate tiles: the per-architecture table, and how a program covers a row of D elements
(held in registers, or streamed in chunks) and how many token blocks the backward splits into.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from fusedops.core.dtypes import element_size
from fusedops.core.target import target_arch
from fusedops.engram_gate.contract import token_blocks


REDUCE_TILE = 8192          # fp32 elements one grad_weight-reduce program loads at once


# -- tiles ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateTiles:
    """max_block_d: the widest row a program holds in registers (wider rows are walked in
    chunks); target_programs: how many backward programs to aim for (grad_weight partial rows
    are about target_programs / ((S + 1) * chunks)); max_warps: warps per program at most
    (about 16 elements per thread below it); held_elements: the most elements of one row a
    forward thread holds in registers (one 16-byte vector per chunk), above which the forward
    streams the row twice."""

    max_block_d: int = 8192
    target_programs: int = 640
    max_warps: int = 16
    held_elements: int = 48
TILES = {
    "sm_80": (GateTiles(8192, 540, 16), "108 SMs (A100): about five backward programs per SM"),
    "sm_90": (GateTiles(8192, 640, 16), "132 SMs (H100/H200): about five backward programs per SM"),
    "sm_100": (GateTiles(8192, 740, 16), "148 SMs (B200): about five backward programs per SM"),
}


def tiles_for(problem) -> GateTiles:
    """The tile table's entry for the plan's architecture."""
    return TILES[target_arch(problem.device)][0]


def candidates(problem) -> list[GateTiles]:
    """Autotune candidates: the table's entry first, then fewer warps and other backward
    program counts."""
    base = tiles_for(problem)
    out = [base, GateTiles(base.max_block_d, base.target_programs, 8),
           GateTiles(base.max_block_d, base.target_programs // 2, base.max_warps),
           GateTiles(base.max_block_d, base.target_programs * 2, base.max_warps)]
    return list(dict.fromkeys(out))


# -- specialisations ---------------------------------------------------------------------------
def block_d(hidden: int, tiles: GateTiles, kernel: str = "fwd") -> int:
    """D elements a program holds per row. Rows wider than max_block_d are walked in chunks,
    narrower ones in the backward (which keeps two more vectors live there)."""
    whole = triton.next_power_of_2(hidden)
    if whole <= tiles.max_block_d:
        return whole
    return tiles.max_block_d if kernel == "fwd" else tiles.max_block_d // 2


def row_warps(block: int, tiles: GateTiles) -> int:
    """Warps for a program holding ``block`` elements per tensor: about 16 per thread."""
    return max(1, min(tiles.max_warps, block // 512))


def vector_elements(problem) -> int:
    """Elements of a 16-byte vector: the unit the kernels take row strides in."""
    return 16 // element_size(problem.dtype)


@dataclass(frozen=True)
class RowLayout:
    """How a program covers a row of D elements: ``chunks`` chunks of ``block`` elements (a
    power of two) on ``warps`` warps; ``held``: the chunks stay in registers (one program per
    row), else the row is streamed chunk by chunk (the backward splits it over programs)."""

    block: int
    chunks: int
    warps: int
    held: bool


def row_layout(problem, tiles: GateTiles, kernel: str = "fwd") -> RowLayout:
    """The held layout that pads the row least, with a 16- or 8-byte vector per thread per
    chunk, at most ``held_elements`` (forward) or half of it (backward, which keeps the weight
    and the grad_weight partial too) per thread; on a tie the wider vector, then fewer warps
    (more CTAs per SM). Rows no held layout covers are streamed in block_d chunks."""
    vec, d = vector_elements(problem), problem.hidden
    limit = tiles.held_elements if kernel == "fwd" else tiles.held_elements // 2
    best, best_key = None, None
    for warps in (1, 2, 4, 8, 16, 32):
        for per_thread in {vec, max(1, vec // 2)}:
            block = per_thread * 32 * warps
            chunks = triton.cdiv(d, block)
            if warps > tiles.max_warps or chunks * per_thread > limit:
                continue
            key = (chunks * block - d, -per_thread, warps)
            if best_key is None or key < best_key:
                best, best_key = RowLayout(block, chunks, warps, True), key
    if best is not None:
        return best
    bd = block_d(d, tiles, kernel)
    return RowLayout(bd, triton.cdiv(d, bd), row_warps(bd, tiles), False)


def max_backward_blocks(problem, tiles: GateTiles) -> int:
    """The most token blocks (grad_weight partial rows) any token count gets: about
    target_programs programs of (stream or grad_v, block, D chunk)."""
    layout = row_layout(problem, tiles, "bwd")
    chunks = 1 if layout.held else layout.chunks
    return max(1, tiles.target_programs // ((problem.streams + 1) * chunks))


def backward_blocks(problem, tiles: GateTiles | None = None) -> tuple[int, int]:
    """(tokens per block, number of blocks) of the backward kernel for ``problem.tokens``."""
    tiles = tiles or tiles_for(problem)
    return token_blocks(problem.tokens, max_backward_blocks(problem, tiles))
