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
    dq kernel (a query block of bm rows against key blocks of bn keys)."""

    dkdv: Tiles
    dq: Tiles


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

FORWARD = {
    "sm_90": {
        64: (Tiles(64, 64, 4), "today's tiles: one warpgroup owns the 64-row wgmma tile; 40 KiB "
             "of shared memory, 3 CTAs per SM by registers (strided addressing took ptxas to 138; "
             "a 128 budget for 4 CTAs spilled 8 bytes)"),
        128: (Tiles(128, 64, 8, 3, None, WIDE_TILE_REGISTERS), "128 query rows on 8 warps: each "
              "warpgroup owns one 64-row wgmma slab (no duplicated QKᵀ or softmax: 2/3 of the "
              "64-row tile's tensor-core work, half its exponentials); 184 registers, 1 CTA per "
              "SM, 128 KiB of shared memory for 3 stages (2026-12-01, `fusedops kernels`)"),
        256: (Tiles(128, 32, 8, 3), "128 query rows on 8 warps, each warpgroup its own 64-row "
              "slab (the 64-row tile on 8 warps had both warpgroups compute the whole QKᵀ and "
              "softmax: 1.5x the tensor-core work, 2x the exponentials), 32 keys per step: 235 "
              "registers (250 packed, 212 softcapped), no spill (the 64-row tile's packed "
              "variant spilled 40 bytes at its 192 budget), 160 KiB of shared memory for 3 "
              "stages, 1 CTA per SM as before; 64 keys per step spills 48 bytes at 255 "
              "(2026-12-02, `fusedops kernels`)"),
    },
    "sm_100": {
        64: (Tiles(64, 64, 4), "today's tiles: tcgen05 from one thread, 3 CTAs per SM"),
        128: (Tiles(64, 64, 8, 2, WIDE_TILE_REGISTERS), "today's tiles; one thread issues each "
              "tcgen05 MMA for the CTA and the warps share the score tile's softmax (no "
              "duplicated work, unlike sm_90's wgmma); 192 registers keep ptxas from spilling"),
        256: (Tiles(128, 32, 8, 3), "128 query rows on 8 warps (tcgen05's full 128-row MMA), "
              "32 keys per step, 3 stages: 238 registers (246 packed, 254 softcapped), no spill, "
              "161 KiB of shared memory, 1 CTA per SM as the 64-row tile it replaces (166 "
              "registers at its 192 budget), whose query blocks read each key block twice as "
              "often (0.900 to 0.736 GB modelled at hkv8 causal); 64 keys per step spills 40 "
              "bytes (2026-12-02, `fusedops kernels`)"),
    },
    "sm_80": {
        64: (Tiles(64, 64, 4, 2, STRIDED_THREE_CTAS), "today's tiles: mma.sync m16n8k16, four "
             "warps of 16 rows each; 3 CTAs per SM on 108 SMs (a 168 budget: strided addressing "
             "took ptxas to 178)"),
        128: (Tiles(64, 64, 8, 2, WIDE_TILE_REGISTERS), "today's tiles: 8 warps of mma.sync (no "
              "warpgroups, no duplicated work); 192 registers, no spill"),
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
              "(at 64 ptxas spills 96-240 bytes at 255 registers); 239 registers, 1 CTA per "
              "SM. dq: 64 query rows on one warpgroup, every product a wgmma (20 HGMMA, 199 "
              "registers, 209 packed, 2 CTAs per SM, 96 KiB of shared memory)"),
        256: (BackwardTiles(Tiles(32, 16, 4), Tiles(128, 32, 8)),
              "dk/dv: 16 keys x 32 query rows on 4 warps, mma.sync (wgmma needs 64 keys per "
              "warpgroup, whose [64, 256] fp32 dk and dv take 256 registers a thread; 128 query "
              "rows as S's M with 64 keys split over two warpgroups spills 200-256 bytes); "
              "240 registers, 2 CTAs per SM, no duplicated product (the 16 x 32 tiles on 8 warps "
              "computed S and dP twice). dq: 128 query rows on 8 warps, each warpgroup its own "
              "64 rows, every product a wgmma (220 registers, 192 KiB of shared memory, 1 CTA per "
              "SM; at 64 rows on 4 warps it spilled)"),
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
        256: (BackwardTiles(Tiles(32, 16, 4), Tiles(128, 32, 8)),
              "dk/dv as sm_90 (mma.sync: tcgen05 needs 64 rows); dq: 128 query rows on 8 warps, "
              "all tcgen05 (186 registers, 208 KiB of shared memory)"),
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
        256: (BackwardTiles(Tiles(32, 16, 4), Tiles(32, 32, 4)),
              "dk/dv as sm_90 (247 registers, 2 CTAs per SM); dq: 32 x 32 on 4 warps (168 "
              "registers, no duplicated product: the 16 x 32 tiles on 8 warps computed S and dP "
              "5/3 times)"),
    },
}

DECODE = {
    "sm_90": (DecodeTiles(64, 4, 2), "today's tiles: 64 cache positions per step, 4 warps; the "
              "T·h_q/h_kv query rows (16 at T = 1..4, G = 4) are below wgmma's 64, so mma.sync; "
              "the step is bound by reading the cache"),
    "sm_100": (DecodeTiles(64, 4, 2), "today's tiles (as sm_90); ptxas's own register count (a "
               "168 budget for 3 CTAs per SM spilled 24 bytes on the paged FP8 cache)"),
    "sm_80": (DecodeTiles(64, 4, 2), "today's tiles: mma.sync; 4 CTAs per SM by shared memory"),
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
    return BackwardTiles(_fit(entry.dkdv, problem), _fit(entry.dq, problem))


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
    more pipeline stage for both; (d = 256) dk/dv on 32 x 32 tiles of 8 warps, dq on 32 x 32
    tiles of 4 warps, and one more stage for dk/dv (the dq entry's 192 KiB of shared memory
    leave no room for a third)."""
    head = head_class(problem.head_dim)
    base = BACKWARD[target_arch(problem.device)][head][0]
    if head <= 128:
        out = [base, replace(base, dkdv=Tiles(32, 128, 8)), replace(base, dkdv=Tiles(32, 64, 4)),
               replace(base, dkdv=replace(base.dkdv, bm=64)), replace(base, dq=Tiles(64, 64, 4)),
               BackwardTiles(replace(base.dkdv, stages=3), replace(base.dq, stages=3))]
    else:
        out = [base, replace(base, dkdv=Tiles(32, 32, 8)), replace(base, dq=Tiles(32, 32, 4)),
               replace(base, dkdv=replace(base.dkdv, stages=3))]
    return list(dict.fromkeys(out))


def decode_candidates(problem) -> list[DecodeTiles]:
    """The entry, then 128 and 32 positions per step, and 8 warps."""
    base = DECODE[target_arch(problem.device)][0]
    out = [base, replace(base, bn=128), replace(base, bn=32), replace(base, warps=8)]
    return list(dict.fromkeys(out))
