"""Tile tables of the Triton MoE kernels: one entry per architecture family (``sm_80``, ``sm_90``,
``sm_100``, picked by ``fusedops.core.target.target_arch``), each with its reason, and the
autotune candidates (docs/performance.md, "Tile tables and autotuning"; docs/moe.md).

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
class MoETiles:
    """The expert kernels' tiles.

    row_tiles: (rows per tile, least mean rows per expert) of the routed row tile, largest
    first; ``min_row_tile`` below them (decode-sized batches). bm_split: the grouped GEMM's BM is
    the row tile / bm_split. bn: the widest column tile (narrower where N is smaller); bk: the K
    step for 16-bit inputs (fp32 takes half); warps for a tile of at least ``wide_tile``
    elements (smaller tiles take 4); stages: software-pipeline depth; group_m: row tiles per L2
    group of the grouped ordering. wgrad_*: the weight-gradient GEMM's tile of the gradient
    (bm × bn), its step over the expert's rows (bk, 16-bit; fp32 takes half), warps and stages.
    ctas_per_sm: the CTAs per SM the cost model's waves assume (moe_cost; the kernel report
    shows the compiled occupancy: one or two by registers at these tiles).
    """

    row_tiles: tuple[tuple[int, int], ...] = ((128, 96), (64, 48), (32, 24))
    min_row_tile: int = 16
    bm_split: int = 1
    bn: int = 128
    bk: int = 64
    warps: int = 8
    wide_tile: int = 64 * 128
    stages: int = 3
    group_m: int = 8
    wgrad_bm: int = 128
    wgrad_bn: int = 128
    wgrad_bk: int = 32
    wgrad_warps: int = 8
    wgrad_stages: int = 3
    ctas_per_sm: int = 1


TODAY = MoETiles()

TILES = {
    "sm_80": (TODAY, "A100 (108 SMs, 164 KiB shared memory per CTA, mma.sync, cp.async): "
              "today's tiles, 128x128x64 over 3 stages (64 KiB: cp.async keeps two tiles in "
              "flight), one CTA per SM by registers; nothing measured better yet"),
    "sm_90": (TODAY, "H100/H200 (132 SMs, 227 KiB shared memory, wgmma on 64-row warpgroup "
              "tiles): today's tiles, 128x128x64 over 8 warps (two warpgroups of 64 rows), 3 "
              "stages (96 KiB); vLLM's published H100 configuration for E=128, N=1856 at >= "
              "3072 tokens (128x256x64, 8 warps, 4 stages) is the first candidate, not the "
              "default until a GPU run shows it faster"),
    "sm_100": (TODAY, "B200 (148 SMs, 227 KiB shared memory, tcgen05 MMA accumulating in tensor "
               "memory): today's tiles; vLLM's published B200 configuration for E=128, N=1856 "
               "(128x256x64, 8 warps, 4 stages) is the first candidate"),
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


def gemm_blocks(problem, kdim: int, ndim: int, bm: int,
                tiles: MoETiles) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) of a grouped or dense GEMM with K = kdim, N = ndim, BM = bm."""
    bn = min(tiles.bn, max(16, triton.next_power_of_2(ndim)))
    step = tiles.bk // 2 if problem.dtype == torch.float32 else tiles.bk
    bk = min(step, max(16, triton.next_power_of_2(kdim)))
    return bm, bn, bk, tiles.warps if bm * bn >= tiles.wide_tile else 4


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


def candidates(problem) -> list[MoETiles]:
    """Autotune candidates, the table's entry first: vLLM's large-batch tiles (BN 256, 4
    stages), 4 stages at BN 128, half-height row tiles on one warpgroup (BM 64, 4 warps), a
    deeper weight-gradient step; for decode-sized row tiles (<= 32 rows) narrower, deeper
    tiles instead (vLLM's small-batch shape: BN 64, BK 128)."""
    base = tiles_for(problem)
    swap = dataclasses.replace
    if row_tile(problem, base) <= 32:
        out = [base, swap(base, bn=64, bk=128), swap(base, bn=64, bk=128, stages=4),
               swap(base, bk=128, warps=4, wide_tile=128 * 128)]
    else:
        out = [base, swap(base, bn=256, stages=4), swap(base, stages=4),
               swap(base, bm_split=2, wide_tile=128 * 128), swap(base, wgrad_bk=64)]
    return list(dict.fromkeys(out))


# -- the router ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterTiles:
    """scores: router scores [tokens × E] one program holds (tokens per program = scores / E
    rounded to a power of two, 1 to 64); warps per program."""

    scores: int = 1024
    warps: int = 4


ROUTER_TILES = {
    "sm_80": (RouterTiles(), "today's: 1024 scores (8 tokens at E = 128) per 4-warp program, "
              "8 fp32 per thread; the router is bound by its logits read on every architecture"),
    "sm_90": (RouterTiles(), "today's, as sm_80: 1024 tokens x E = 128 make 1024 programs, "
              "about 8 per SM on 132 SMs"),
    "sm_100": (RouterTiles(), "today's, as sm_80 (148 SMs)"),
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
