"""GQA attention: the Triton kernels' tile tables, one entry per architecture family (sm_80,
sm_90, sm_100) and head-dim class, each with its reason, and the autotune candidates.

The programs pick the entry of ``target_arch(problem.device)`` (``fusedops.core.target``) and
accept any configuration of the same types as ``config=``; ``<program>_candidates(problem)``
lists the entry first. An entry changes with the kernel report and a benchmark as evidence
(docs/performance.md, "Tile tables and autotuning").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton

from fusedops.core.target import target_arch


@dataclass(frozen=True)
class Tiles:
    """One training kernel's tiles: bm query rows and bn keys per step, warps per CTA, software
    pipeline stages and a register budget for ptxas (None: its own choice), and another for the
    wide variants (packed: the clearing of uncovered tokens; softcap: the tanh and its 1 - tanh²
    factor; both add registers; default: maxnreg)."""

    bm: int
    bn: int
    warps: int
    stages: int = 2
    maxnreg: int | None = None
    packed_maxnreg: int | None = None

    def budget(self, wide: bool) -> int | None:
        """The register budget of the plain or the wide (packed or softcapped) variant."""
        return (self.packed_maxnreg or self.maxnreg) if wide else self.maxnreg


@dataclass(frozen=True)
class BackwardTiles:
    """The backward's dk/dv kernel (a key block of bn keys against query blocks of bm rows) and
    dq kernel (a query block of bm rows against key blocks of bn keys). ``features_m``: dk and
    dv accumulated transposed, [d, bn] with the head dim as their products' M and the query
    block as the scores' (else every product has the key block as M)."""

    dkdv: Tiles
    dq: Tiles
    features_m: bool = False


@dataclass(frozen=True)
class DecodeTiles:
    """The decode split kernel: bn keys per step (at most: it must divide the page, so smaller
    pages take the largest of 64, 32, 16 that does), warps, stages, register budget. Its rows
    are fixed by the problem: T·h_q/h_kv padded to a power of two >= 16."""

    bn: int = 64
    warps: int = 4
    stages: int = 2
    maxnreg: int | None = None


# ptxas for sm_100 holds the wide tiles to 128 registers and spills; this budget gives it room
WIDE_TILE_REGISTERS = 192
# every [.., h, d] operand is addressed through its runtime strides, which takes ptxas's own
# choice just past a CTA boundary on some kernels; these budgets hold them at 2 CTAs of 8 warps
# per SM (dq), 4 and 3 of 4 warps, with no spill (the kernel report checks)
DQ_REGISTERS = 128
STRIDED_FOUR_CTAS = 128
STRIDED_THREE_CTAS = 168
# sm_80's 128-row forward at d = 64: 2 CTAs of 8 warps per SM (ptxas's own choice leaves one)
TWO_CTAS_OF_EIGHT_WARPS = 128
# the whole register file: where shared memory bounds the CTAs per SM, ptxas's own choice can
# stop short of what the kernel needs and spill (sm_80's d = 256 dq)
ALL_REGISTERS = 255

FORWARD = {
    "sm_90": {
        64: (Tiles(64, 64, 4), "one warpgroup owns the 64-row wgmma tile; 3 CTAs per SM"),
        128: (Tiles(128, 64, 8, 3, None, WIDE_TILE_REGISTERS),
              "a 64-row wgmma slab per warpgroup: no duplicated QKᵀ or softmax"),
        256: (Tiles(128, 32, 8, 3),
              "a 64-row slab per warpgroup; 32 keys a step, 3 stages: 1 CTA/SM"),
    },
    "sm_100": {
        64: (Tiles(64, 64, 4), "tcgen05 issued from one thread; 4 CTAs per SM"),
        128: (Tiles(64, 64, 8, 2, WIDE_TILE_REGISTERS),
              "one thread issues each tcgen05 MMA: no duplicated work"),
        256: (Tiles(128, 32, 8, 3),
              "tcgen05's full 128-row MMA: key blocks read half as often as at 64 rows"),
    },
    "sm_80": {
        64: (Tiles(128, 32, 8, 2, TWO_CTAS_OF_EIGHT_WARPS, WIDE_TILE_REGISTERS),
             "8 warps of 16 rows, no duplicated mma.sync; 2 CTAs per SM"),
        128: (Tiles(128, 32, 8),
              "8 warps of 16 rows, no duplicated mma.sync; a key block read once per 128 rows"),
        256: (Tiles(64, 32, 8, 2, None),
              "ptxas's own register count: a 192 budget spills; 1 CTA per SM"),
    },
}

BACKWARD = {
    "sm_90": {
        64: (BackwardTiles(Tiles(32, 64, 4, 2, None, STRIDED_THREE_CTAS), Tiles(64, 64, 4)),
             "the keys as every wgmma's M on one warpgroup; 3 CTAs per SM"),
        128: (BackwardTiles(Tiles(32, 128, 8), Tiles(64, 64, 4)),
              "FA3's tiles: each warpgroup its 64 keys as M, no product twice"),
        256: (BackwardTiles(Tiles(128, 32, 8, 1), Tiles(128, 32, 8), True),
              "dkᵀ, dvᵀ with the head dim as M: all wgmma, none twice"),
    },
    "sm_100": {
        64: (BackwardTiles(Tiles(32, 64, 4), Tiles(64, 64, 4)),
             "as sm_90: every product tcgen05, 4 CTAs per SM"),
        128: (BackwardTiles(Tiles(64, 64, 8), Tiles(64, 64, 4)),
              "64 keys: tcgen05 duplicates nothing; a wave's keys fit the L2"),
        256: (BackwardTiles(Tiles(64, 32, 4, 1), Tiles(128, 32, 8), True),
              "dkᵀ, dvᵀ in tensor memory on 4 warps: 2 CTAs per SM"),
    },
    "sm_80": {
        64: (BackwardTiles(Tiles(32, 32, 4, 2, STRIDED_FOUR_CTAS), Tiles(32, 64, 4)),
             "32 keys x 32 query rows: no duplicated work, 4 CTAs per SM"),
        128: (BackwardTiles(Tiles(64, 32, 8),
                            Tiles(32, 64, 8, 2, DQ_REGISTERS, WIDE_TILE_REGISTERS)),
              "32 keys x 64 query rows on 8 warps: no product twice, no spill"),
        256: (BackwardTiles(Tiles(32, 16, 4), Tiles(32, 32, 4, 2, ALL_REGISTERS)),
              "dq 32 x 32 on 4 warps: no product twice; the whole register file: no spill"),
    },
}

DECODE = {
    "sm_90": (DecodeTiles(64, 4, 2, 168),
              "products transposed on one warpgroup; 168 registers: 3 CTAs per SM"),
    "sm_100": (DecodeTiles(64, 4, 2),
               "as sm_90 on tcgen05, ptxas's own registers: a 168 budget spills on triton 3.6"),
    "sm_80": (DecodeTiles(64, 4, 2),
              "the transposed products on mma.sync; two stages of cache in flight"),
}


def head_class(head_dim: int) -> int:
    """The tables' head-dim class: 64 (d <= 64), 128 or 256 (the padded tile width)."""
    return max(64, triton.next_power_of_2(head_dim))


def _fit(tiles: Tiles, problem) -> Tiles:
    """Tiles no larger than the longest sequence needs (at least 16: the smallest MMA tile)."""
    longest = triton.next_power_of_2(max(problem.seqlen_q, problem.seqlen_k, 1))
    return replace(tiles, bm=max(16, min(tiles.bm, longest)), bn=max(16, min(tiles.bn, longest)))


def forward_tiles(problem, config: Tiles | None = None) -> Tiles:
    """The forward's tiles: ``config`` or the table's entry for the plan's architecture, cut to
    the longest sequence."""
    entry = config or FORWARD[target_arch(problem.device)][head_class(problem.head_dim)][0]
    return _fit(entry, problem)


def backward_tiles(problem, config: BackwardTiles | None = None) -> BackwardTiles:
    entry = config or BACKWARD[target_arch(problem.device)][head_class(problem.head_dim)][0]
    return replace(entry, dkdv=_fit(entry.dkdv, problem), dq=_fit(entry.dq, problem))


def decode_tiles(problem, config: DecodeTiles | None = None) -> DecodeTiles:
    """The decode split kernel's tiles: bn the largest of config.bn, 64 and 32 (at most
    config.bn) dividing the page, else 16."""
    entry = config or DECODE[target_arch(problem.device)][0]
    bn = next((b for b in (entry.bn, 64, 32) if b <= entry.bn and problem.page_size % b == 0), 16)
    return replace(entry, bn=bn)


def forward_candidates(problem) -> list[Tiles]:
    """The entry, then (d <= 128) 128 query rows on 8 warps (one 64-row wgmma slab per
    warpgroup: no duplicated S), 4 warps, and 128 keys per step; (d = 256, where those spill)
    64 query rows on 4 warps (one warpgroup) and the entry with the other of 2 and 3 pipeline
    stages. Every candidate compiles for sm_80, sm_90 and sm_100 within the shared memory of
    each."""
    head = head_class(problem.head_dim)
    base = FORWARD[target_arch(problem.device)][head][0]
    if head <= 128:
        out = [base, replace(base, bm=128, warps=8), replace(base, warps=4, maxnreg=None),
               replace(base, bn=2 * base.bn)]
    else:
        out = [base, replace(base, bm=64, warps=4, stages=2, maxnreg=None),
               replace(base, stages=2 if base.stages == 3 else 3)]
    return list(dict.fromkeys(out))


def backward_candidates(problem) -> list[BackwardTiles]:
    """The entry, then (d <= 128) dk/dv on 128 keys over two warpgroups and on 64 keys of one
    warpgroup (32 query rows per step), at 64 query rows, dq on 64-row tiles of 4 warps, and one
    more pipeline stage for both; (d = 256, dk and dv transposed: sm_90, sm_100) dk/dv on 128
    query rows over two warpgroups (each holding half of dkᵀ and dvᵀ's features) and on 16 keys
    with two stages, dq on 32 x 32 tiles of 4 warps; (d = 256, keys as M: sm_80) dk/dv on 32 x
    32 tiles of 8 warps, dq on 32 x 32 tiles of 4 warps, and one more stage for dk/dv (the dq
    entry's 192 KiB of shared memory leave no room for a third)."""
    head = head_class(problem.head_dim)
    base = BACKWARD[target_arch(problem.device)][head][0]
    if head <= 128:
        out = [base, replace(base, dkdv=Tiles(32, 128, 8)), replace(base, dkdv=Tiles(32, 64, 4)),
               replace(base, dkdv=replace(base.dkdv, bm=64)), replace(base, dq=Tiles(64, 64, 4)),
               replace(base, dkdv=replace(base.dkdv, stages=3), dq=replace(base.dq, stages=3))]
    elif base.features_m:
        out = [base, replace(base, dkdv=Tiles(128, 32, 8, 1)),
               replace(base, dkdv=Tiles(64, 16, 4, 2)), replace(base, dq=Tiles(32, 32, 4))]
    else:
        out = [base, replace(base, dkdv=Tiles(32, 32, 8)), replace(base, dq=Tiles(32, 32, 4)),
               replace(base, dkdv=replace(base.dkdv, stages=3))]
    return list(dict.fromkeys(out))


def decode_candidates(problem) -> list[DecodeTiles]:
    """The entry, then 128 positions per step on one warpgroup and on two (64 positions each:
    every score product keeps 64 positions per warpgroup as its M), and three stages."""
    base = DECODE[target_arch(problem.device)][0]
    out = [base, replace(base, bn=128, maxnreg=None), replace(base, bn=128, warps=8, maxnreg=None),
           replace(base, stages=3)]
    return list(dict.fromkeys(out))
