"""GQA attention: the Triton kernels' tile tables, one entry per architecture family (sm_80,
sm_90, sm_100) and head-dim class, each with its reason, and the autotune candidates.

The programs pick the entry of ``target_arch(problem.device)`` (``fusedops.core.target``) and
accept any configuration of the same types as ``config=``; ``<program>_candidates(problem)``
lists the entry first. Entries marked "today's tiles" are the tiles the kernels had before the
table existed: nothing better is known without a GPU to measure (the performance issues that
follow change them, with the kernel report and a benchmark as evidence).
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
# (the packed dq kernel spilled 8 bytes at 128)
WIDE_TILE_REGISTERS = 192
# strided addressing (issue 19: every [.., h, d] operand through its runtime strides) added ~10
# registers where ptxas's own choice sat at a CTA boundary; these budgets keep the CTAs per SM
# the kernels had, with no spill (the kernel report checks): 2 CTAs of 8 warps (dq), 4 and 3 of
# 4 warps
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
        64: (Tiles(64, 64, 4), "today's tiles: one warpgroup owns the 64-row wgmma tile; 40 KiB "
             "of shared memory, 3 CTAs per SM by registers (strided addressing took ptxas to 138; "
             "a 128 budget for 4 CTAs spilled 8 bytes)"),
        128: (Tiles(128, 64, 8, 3, None, WIDE_TILE_REGISTERS), "128 query rows on 8 warps: each "
              "warpgroup owns one 64-row wgmma slab (no duplicated QKᵀ or softmax: 2/3 of the "
              "64-row tile's tensor-core work, half its exponentials); with TMA tiles and the "
              "previous block's P·V under this block's softmax 164 registers (154 packed; 184 "
              "before), 1 CTA per SM, 145 KiB of shared memory for 3 stages; 128 keys per step "
              "takes 249 (2026-12-04, `fusedops kernels`)"),
        256: (Tiles(128, 32, 8, 3), "128 query rows on 8 warps, each warpgroup its own 64-row "
              "slab (the 64-row tile on 8 warps had both warpgroups compute the whole QKᵀ and "
              "softmax: 1.5x the tensor-core work, 2x the exponentials), 32 keys per step: 198 "
              "registers with TMA (235 with pointer loads, 2026-12-02), no spill, 168 KiB of "
              "shared memory for 3 stages, 1 CTA per SM (2026-12-04, `fusedops kernels`)"),
    },
    "sm_100": {
        64: (Tiles(64, 64, 4), "today's tiles: tcgen05 from one thread; 127 registers with TMA, "
             "4 CTAs per SM (3 before)"),
        128: (Tiles(64, 64, 8, 2, WIDE_TILE_REGISTERS), "today's tiles; one thread issues each "
              "tcgen05 MMA for the CTA and the warps share the score tile's softmax (no "
              "duplicated work, unlike sm_90's wgmma); 94 registers with TMA (122 before), 2 "
              "CTAs per SM; the 192 budget keeps the wide variants from spilling"),
        256: (Tiles(128, 32, 8, 3), "128 query rows on 8 warps (tcgen05's full 128-row MMA), "
              "32 keys per step, 3 stages: 238 registers (246 packed, 254 softcapped), no spill, "
              "161 KiB of shared memory, 1 CTA per SM as the 64-row tile it replaces (166 "
              "registers at its 192 budget), whose query blocks read each key block twice as "
              "often (0.900 to 0.736 GB modelled at hkv8 causal); 64 keys per step spills 40 "
              "bytes (2026-12-02, `fusedops kernels`)"),
    },
    "sm_80": {
        64: (Tiles(128, 32, 8, 2, TWO_CTAS_OF_EIGHT_WARPS, WIDE_TILE_REGISTERS), "128 query rows "
             "on 8 warps of 16 rows each (mma.sync m16n8k16, no duplicated work), 32 keys per "
             "step: each key block read once per 128 query rows, not 64, and 2 CTAs per SM (16 "
             "warps; the 64 x 64 tile on 4 warps spilled at the 168 registers of its 3 CTAs); "
             "the wide variants under the 192 budget, 1 CTA"),
        128: (Tiles(128, 32, 8), "128 query rows on 8 warps of 16 rows each (mma.sync, no "
              "duplicated work), 32 keys per step: each key block read once per 128 query rows, "
              "not 64, at the same 1 CTA per SM, with ptxas's own register choice (the 64-row "
              "tile spilled at a 192 budget; 64 keys per step spill in the windowed variant)"),
        256: (Tiles(64, 32, 8, 2, None), "sm_80's own entry: at 192 registers ptxas spilled 56 "
              "bytes; without a budget it fits in 255 registers x 8 warps (one CTA per SM, as "
              "with the budget)"),
    },
}

BACKWARD = {
    "sm_90": {
        64: (BackwardTiles(Tiles(32, 64, 4, 2, None, STRIDED_THREE_CTAS), Tiles(64, 64, 4)),
             "dk/dv: 64 keys on one warpgroup, every product a wgmma with the keys as M (Sᵀ = k "
             "qᵀ, dPᵀ = v doᵀ, then Pᵀ do and dSᵀ q), 32 query rows per step; 159 registers, 3 "
             "CTAs per SM (the softcapped variant held to 168 for the same 3: 176 without; at 64 "
             "rows 246 registers, 2 CTAs; 128 keys on 8 warps: 150 registers, one CTA). dq: 64 "
             "query rows on one warpgroup, every product a wgmma (141 registers, 3 CTAs per SM)"),
        128: (BackwardTiles(Tiles(32, 128, 8), Tiles(64, 64, 4)),
              "dk/dv: 128 keys on 8 warps, each warpgroup its own 64 keys as every product's M "
              "(FlashAttention-3's Hopper tiles: no product below wgmma's 64 rows, none computed twice; 64 "
              "keys on 8 warps would compute Sᵀ on both warpgroups), 32 query rows per step "
              "(at 64 ptxas spills 96-240 bytes at 255 registers); 230 registers with TMA (239 "
              "before), 1 CTA per SM. dq: 64 query rows on one warpgroup, every product a wgmma "
              "(20 HGMMA, 159 registers with TMA, 199 before, 2 CTAs per SM by its 96 KiB of "
              "shared memory) (2026-12-04)"),
        256: (BackwardTiles(Tiles(128, 32, 8, 1), Tiles(128, 32, 8), True),
              "dk/dv with dkᵀ and dvᵀ [256, 32] accumulated (the head dim as their products' M, "
              "split over the two warpgroups; S and dP [128, 32] with the query rows as M, 64 a "
              "warpgroup): every product a wgmma, none computed twice, 242 registers, 168 KiB "
              "of shared memory (one stage; two need 297), 1 CTA per SM. Keys as M need 64 keys "
              "a warpgroup, whose [64, 256] fp32 dk and dv take 256 registers a thread (the "
              "former 16 x 32 mma.sync tiles, 240 registers, 2 CTAs); 64 x 32 on one warpgroup "
              "spills 72 bytes with dP issued before the exponentials (255 registers, no "
              "overlap, without). dq: 128 query rows on 8 warps, each warpgroup its own 64 "
              "rows, every product a wgmma (211 registers, 192 KiB of shared memory, 1 CTA per "
              "SM) (2026-12-04, `fusedops kernels`)"),
    },
    "sm_100": {
        64: (BackwardTiles(Tiles(32, 64, 4), Tiles(64, 64, 4)), "as sm_90: every product "
             "tcgen05 (dk/dv 122 registers, 4 CTAs per SM)"),
        128: (BackwardTiles(Tiles(64, 64, 8), Tiles(64, 64, 4)),
              "dk/dv: 64 keys x 64 query rows on 8 warps, every product tcgen05 with the keys as "
              "M (issued once per CTA: no duplication at 64 keys), 160 registers, 1 CTA per SM; "
              "128 keys would double a wave's keys and its wave would no longer fit the L2 at "
              "h_kv = 2 (the model: 2.0 -> 16x the floor). dq at 64 rows all tcgen05 (147 "
              "registers, 112 KiB of shared memory: 2 CTAs per SM)"),
        256: (BackwardTiles(Tiles(64, 32, 4, 1), Tiles(128, 32, 8), True),
              "dk/dv with dkᵀ and dvᵀ accumulated in tensor memory (as sm_90's; 64 query rows "
              "on 4 warps, tcgen05 issued once per CTA): 239 registers, 100 KiB of shared "
              "memory, 2 CTAs per SM (two stages need 233 KiB); dq: 128 query rows on 8 warps, "
              "all tcgen05 (169 registers, 208 KiB of shared memory) (2026-12-04)"),
    },
    "sm_80": {
        64: (BackwardTiles(Tiles(32, 32, 4, 2, STRIDED_FOUR_CTAS), Tiles(32, 64, 4)), "sm_80's "
             "own entry: dk/dv on 32 keys x 32 query rows (119 registers, 4 CTAs per SM, no "
             "duplicated work); dq at 32 rows (mma.sync)"),
        128: (BackwardTiles(Tiles(64, 32, 8), Tiles(32, 64, 8, 2, DQ_REGISTERS, WIDE_TILE_REGISTERS)),
              "dk/dv: 32 keys x 64 query rows on 8 warps, 176 registers (with the keys as M the "
              "former 64 keys x 32 rows lay the warps so that Sᵀ and dPᵀ ran twice; 64 x 64 "
              "took 255 registers and its softcapped variant spilled 8 bytes); all mma.sync "
              "m16n8k16; no spill"),
        256: (BackwardTiles(Tiles(32, 16, 4), Tiles(32, 32, 4, 2, ALL_REGISTERS)),
              "dk/dv as sm_90 (247 registers, 2 CTAs per SM); dq: 32 x 32 on 4 warps (no "
              "duplicated product: the 16 x 32 tiles on 8 warps computed S and dP 5/3 times), "
              "2 CTAs per SM by its shared memory, with the whole register file (ptxas's own "
              "choice spilled)"),
    },
}

DECODE = {
    "sm_90": (DecodeTiles(64, 4, 2, 168), "64 cache positions per step on one warpgroup, every "
              "product transposed (Sᵀ = k qᵀ with the positions as M, oᵀ += vᵀ Pᵀ with the "
              "features as M: the T·h_q/h_kv query rows, 16 at T = 1..4, G = 4, are below "
              "wgmma's 64), wgmma, the previous step's vᵀ Pᵀ under this step's softmax; a 168 "
              "budget keeps 3 CTAs per SM with no spill (147 bf16, 168 paged FP8, which took "
              "214 without it); the step is bound by reading the cache (2026-12-04)"),
    "sm_100": (DecodeTiles(64, 4, 2), "as sm_90, tcgen05, ptxas's own register count: 196 (bf16, "
               "2 CTAs per SM), 160 (paged FP8, 3); a 168 budget holds the bf16 kernel to 3 CTAs "
               "without spilling on triton 3.9 but spills 144 bytes on 3.6 (2026-12-04)"),
    "sm_80": (DecodeTiles(64, 4, 2), "64 positions per step, mma.sync on the same transposed "
              "products: 184 registers, 2 CTAs per SM (128 and 4 before they were transposed; "
              "budgets of 128 and 168 spill 152 and 16 bytes), each keeping two stages of 32 KiB "
              "of cache in flight, more than reading the cache needs (2026-12-04)"),
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
