"""Tile tables of the Triton MoE kernels: one entry per architecture family (``sm_80``, ``sm_90``,
``sm_100``, picked by ``fusedops.core.target.target_arch``), each with its reason, and the
autotune candidates (docs/performance.md, "Tile tables and autotuning"; docs/relu2_moe.md).

The routed row tile is also the padding of every expert's rows in the dispatch, which the
forward saves for its backward: it comes from the table (by the mean rows per expert), never
from a candidate, so every candidate keeps the saved layout. A candidate may split it
(``bm_split``: the grouped GEMM's BM = row tile / bm_split, still inside one expert) and change
the column tile, K step, warps, stages and the weight-gradient tiles; the workspace follows the
choice (allocate it after compile()).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from fusedops.core.target import target_arch


@dataclass(frozen=True)
class GemmTile:
    """One grouped GEMM's column tile, K step (16-bit inputs; fp32 takes half), warps (for a
    tile of at least ``wide`` elements, default the table's ``wide_tile``; smaller tiles take
    4), pipeline stages and a register budget for ptxas (None: its own choice)."""

    bn: int
    bk: int
    warps: int
    stages: int
    wide: int | None = None
    maxnreg: int | None = None


@dataclass(frozen=True)
class MoETiles:
    """The expert kernels' tiles.

    row_tiles: (rows per tile, least mean rows per expert) of the routed row tile, largest
    first; ``min_row_tile`` below them (decode-sized batches). bm_split: the grouped GEMM's BM is
    the row tile / bm_split. The grouped and dense GEMMs by kind: ``plain`` (the up GEMMs, the
    routed down GEMM, the routed dgrad-up: epilogues that write their tile and read nothing
    more) and ``fused`` (the dgrad-down, whose epilogue reads u, and the shared expert's
    combining down and dgrad-up, which read the k rows of each token: a second tile live in
    registers), and ``relu2`` for the plain GEMM whose A operand is relu(u)² formed in
    registers (the routed down GEMM); row tiles of ``small_rows`` or fewer (decode-sized) take
    ``small`` for all.
    group_m: row tiles per L2 group of the routed GEMMs' grouped ordering (dense_group_m: the
    shared expert's). wgrad_*: the weight-gradient GEMM's tile of the gradient (bm × bn), its
    step over the expert's rows (bk, 16-bit; fp32 takes half), warps, stages and the row tiles
    of its L2 group inside an expert (dense_wgrad_group_m: the shared expert's, which walks
    every token), and a register budget for ptxas; wgrad_split_slots: the fp32 gradient-sized
    slots a routed expert's rows beyond its first chunk go to (``wgrad_split``; 0: none);
    dense_wgrad_pair: the shared expert's two weight gradients in one launch
    (``moe.dense_wgrad_pair_stage``), so the second's tiles fill the first's last wave.
    epilogue_quarters: the epilogues that read a second tile run on a quarter of the columns at
    a time (``kernels._column_quarters``).
    """

    row_tiles: tuple[tuple[int, int], ...] = ((128, 96), (64, 48), (32, 24))
    min_row_tile: int = 16
    bm_split: int = 1
    plain: GemmTile = GemmTile(128, 64, 8, 3)
    fused: GemmTile = GemmTile(128, 64, 8, 3, wide=128 * 128, maxnreg=128)
    relu2: GemmTile = GemmTile(128, 32, 8, 4)
    small: GemmTile = GemmTile(64, 128, 4, 4)
    small_rows: int = 32
    wide_tile: int = 64 * 128
    group_m: int = 6
    dense_group_m: int = 8
    wgrad_bm: int = 128
    wgrad_bn: int = 128
    wgrad_bk: int = 64
    wgrad_warps: int = 8
    wgrad_stages: int = 3
    wgrad_group_m: int = 16
    dense_wgrad_group_m: int = 4
    wgrad_maxnreg: int | None = 128
    wgrad_split_slots: int = 8
    dense_wgrad_pair: bool = True
    epilogue_quarters: bool = True


HOPPER = MoETiles()
AMPERE = MoETiles(small=GemmTile(64, 64, 4, 3), fused=GemmTile(128, 64, 8, 3, wide=128 * 128),
                  wgrad_maxnreg=128, dense_wgrad_pair=False)
"""sm_80: its fused GEMMs take ptxas's own register count (a 128 budget spills them); the shared
expert's weight gradients in two launches (one spills at 128 registers and, on 108 SMs, fills
as many waves as two)."""
VLLM_LARGE = GemmTile(256, 64, 8, 4)
"""vLLM's published fused-MoE configuration for E = 128, N = 1856 at >= 3072 tokens on H100 (and
>= 1536 on B200): 128 x 256 x 64, 8 warps, 4 stages."""

TILES = {
    "sm_80": (AMPERE,
              "mma.sync, 128x128x64 over 3 stages; wgrads held to 128 registers: 2 CTAs per SM"),
    "sm_90": (HOPPER, "two 64-row wgmma warpgroups; 128 columns pad N = 1856 least; 2 CTAs per SM"),
    "sm_100": (HOPPER, "as sm_90 on tcgen05: the same tiles and budgets, no spill"),
}


def tiles_for(problem) -> MoETiles:
    """The tile table's entry for the plan's architecture."""
    return TILES[target_arch(problem.device)][0]


def row_tile(problem, tiles: MoETiles | None = None) -> int:
    """Rows per routed tile, also the padding of every expert's rows: the largest tile whose
    threshold the mean rows per expert (t·k / E) reaches."""
    tiles = tiles or tiles_for(problem)
    mean = problem.assignments / problem.experts
    for tile, least in tiles.row_tiles:
        if mean >= least:
            return tile
    return tiles.min_row_tile


def max_rows(problem, tiles: MoETiles | None = None) -> int:
    """Upper bound of the dispatched rows: t·k + E·(tile - 1), whatever the routing."""
    tile = row_tile(problem, tiles)
    return triton.cdiv(problem.assignments + problem.experts * (tile - 1), tile) * tile


def gemm_tile(tiles: MoETiles, bm: int, fused: bool, relu2: bool = False) -> GemmTile:
    """The GemmTile a GEMM of BM = bm takes: ``small`` for decode-sized row tiles, else
    ``fused`` (an epilogue holding a second tile), ``relu2`` (A formed in registers) or
    ``plain``."""
    if bm <= tiles.small_rows:
        return tiles.small
    return tiles.fused if fused else tiles.relu2 if relu2 else tiles.plain


def gemm_blocks(problem, kdim: int, ndim: int, bm: int, tiles: MoETiles, fused: bool = False,
                relu2: bool = False) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) of a grouped or dense GEMM with K = kdim, N = ndim, BM = bm
    (``fused``: its epilogue holds a second tile; ``relu2``: its A is formed in registers)."""
    g = gemm_tile(tiles, bm, fused, relu2)
    bn = min(g.bn, max(16, triton.next_power_of_2(ndim)))
    step = g.bk // 2 if problem.dtype == torch.float32 else g.bk
    bk = min(step, max(16, triton.next_power_of_2(kdim)))
    return bm, bn, bk, g.warps if bm * bn >= (g.wide or tiles.wide_tile) else 4, g.stages


def routed_bm(problem, tiles: MoETiles) -> int:
    """The grouped GEMM's BM: the row tile split by ``bm_split`` (at least 16)."""
    return max(16, row_tile(problem, tiles) // tiles.bm_split)


def dense_bm(problem, tiles: MoETiles) -> int:
    """The shared expert's dense GEMM BM: the token count up to the largest routed tile (split
    like it)."""
    largest = tiles.row_tiles[0][0] if tiles.row_tiles else tiles.min_row_tile
    return min(max(16, largest // tiles.bm_split), max(16, triton.next_power_of_2(problem.tokens)))


def wgrad_blocks(problem, m: int, n: int, tiles: MoETiles) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) of the weight-gradient GEMM of a [m, n] gradient."""
    bm = min(tiles.wgrad_bm, max(16, triton.next_power_of_2(m)))
    bn = min(tiles.wgrad_bn, max(16, triton.next_power_of_2(n)))
    bk = tiles.wgrad_bk // 2 if problem.dtype == torch.float32 else tiles.wgrad_bk
    return bm, bn, bk, tiles.wgrad_warps if bm * bn >= 128 * 128 else 4


def wgrad_split(problem, tiles: MoETiles, bk: int) -> tuple[int, int]:
    """(slots, chunk) of the routed weight gradients' deterministic split-K: an expert with
    more than ``chunk`` rows computes chunk 0 in one program per gradient tile and each further
    chunk in another, summed in chunk order through fp32 slots. chunk = t·k / slots rounded up
    to the K step, so the chunks past the first never outnumber the slots, whatever the routing;
    (0, 0) where the table has no slots or chunk >= t, which an expert passes only when a token
    names it more than once (its k experts are distinct under every router)."""
    slots = tiles.wgrad_split_slots
    if slots <= 0:
        return 0, 0
    chunk = triton.cdiv(triton.cdiv(problem.assignments, slots), bk) * bk
    return (slots, chunk) if chunk < problem.tokens else (0, 0)


def candidates(problem) -> list[MoETiles]:
    """Autotune candidates, the table's entry first. At row tiles over ``small_rows``: the plain
    GEMMs on vLLM's large-batch configuration (``VLLM_LARGE``) and at 4 stages, half-height row
    tiles on one warpgroup (BM 64, 4 warps), a 32-row weight-gradient step, and L2 groups of 8
    row tiles; for decode-sized row tiles, 128 columns, 5 stages (vLLM's 16-row shapes) and 8
    warps."""
    base = tiles_for(problem)
    swap = dataclasses.replace
    if row_tile(problem, base) <= base.small_rows:
        s = base.small
        out = [base, swap(base, small=swap(s, bn=128)), swap(base, small=swap(s, stages=5)),
               swap(base, small=swap(s, bk=64, warps=8), wide_tile=16 * 64)]
    else:
        p = base.plain
        out = [base, swap(base, plain=VLLM_LARGE), swap(base, plain=swap(p, stages=4)),
               swap(base, bm_split=2, wide_tile=128 * 128), swap(base, wgrad_bk=32),
               swap(base, group_m=8)]
    return list(dict.fromkeys(out))


# -- the router ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterTiles:
    """scores: router scores [tokens × E] one program holds (tokens per program = scores / E
    rounded to a power of two, 1 to 64); warps per program."""

    scores: int = 1024
    warps: int = 4


ROUTER_TILES = {
    "sm_80": (RouterTiles(), "1024 scores per 4-warp program; bound by reading the logits"),
    "sm_90": (RouterTiles(), "as sm_80: 1024 programs at 8192 tokens and E = 128, about 8 per SM"),
    "sm_100": (RouterTiles(), "as sm_80 (148 SMs)"),
}


def router_tiles_for(problem) -> RouterTiles:
    """The router table's entry for the plan's architecture."""
    return ROUTER_TILES[target_arch(problem.device)][0]


def router_candidates(problem) -> list[RouterTiles]:
    """The table's entry first, then half and twice the scores per program, and 8 warps."""
    base = router_tiles_for(problem)
    return list(dict.fromkeys([base, RouterTiles(base.scores // 2, base.warps),
                               RouterTiles(base.scores * 2, base.warps),
                               RouterTiles(base.scores * 2, 8)]))
