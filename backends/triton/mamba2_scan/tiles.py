"""Mamba2 chunked scan (Triton): the per-architecture tile table, its autotune candidates and
the tile counts a problem gives."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import triton

from fusedops.core.target import target_arch


@dataclass(frozen=True)
class ScanTiles:
    """One entry of the tile table (upper bounds; ``tiles`` fits them to a problem).

    BQ: tokens per row block (rows and columns of a segment's Q x Q blocks; the M of the output,
    C·B, dx and gradient products); BP: head-dim tile; BN: state tile; BLOCK_H: heads per dt
    program. FUSED: the forward computes the states and the output in one walk along every
    sequence (``ssd_fused_fwd_kernel``: a program holds the whole state of its BP head-dim rows,
    so BN does not apply to it) instead of a states kernel and an output kernel; FUSED_WARPS and
    FUSED_STAGES: that kernel's warps and software-pipelining stages. DBC_BN: the state tile of
    the backward dB/dC kernel, which forms its d(C·B) tiles once per state tile (so the whole
    state, where its [BQ, n] fp32 accumulator fits). DX_IN_DBC: dx's programs run in the dB/dC
    launch, beside the dB and dC programs of their (segment, group), so that dy, x, dH1 and B
    come from the L2 (C·B then comes from the prologue's C·B kernel); DBC_STAGES: that launch's
    software-pipelining stages (dB and dC's head-dim loops are one step at p <= 64; dx's block
    loop is what a second stage pipelines). WALK_STAGES: the backward state walk's
    software-pipelining stages (``ssd_chunk_states_bwd_kernel``: C's next steps loaded
    ahead through shared memory)."""

    BQ: int = 64
    BP: int = 64
    BN: int = 64
    BLOCK_H: int = 16
    FUSED: bool = True
    FUSED_WARPS: int = 8
    FUSED_STAGES: int = 1
    DBC_BN: int = 128
    DX_IN_DBC: bool = True
    DBC_STAGES: int = 1
    WALK_STAGES: int = 2


@dataclass(frozen=True)
class Tiles:
    """The tiles of one problem's scan kernels (powers of two)."""

    BQ: int
    BP: int
    BN: int
    BLOCK_H: int
    SEARCH: int      # binary-search steps to find a segment's sequence (varlen)
    FUSED: bool
    FUSED_WARPS: int
    FUSED_STAGES: int
    DBC_BN: int
    DX_IN_DBC: bool
    DBC_STAGES: int
    WALK_STAGES: int


FUSED_MAX_STATE = 128
"""The widest state the fused forward walk holds in registers: at n = 128 its [64, n] fp32 tile
takes 32 registers a thread of 8 warps, in a kernel near the 255-register limit; twice that
would spill."""


TILES = {
    "sm_80": (ScanTiles(64, 64, 64, 16, WALK_STAGES=3),
              "mma.sync; the walk's 3 cp.async stages fit its 128 registers: 4 CTAs/SM"),
    "sm_90": (ScanTiles(64, 64, 64, 16, DBC_STAGES=2),
              "64 rows: one m64 wgmma a warpgroup; dB/dC+dx at 2 stages keeps dx in flight"),
    "sm_100": (ScanTiles(64, 64, 64, 16, DBC_STAGES=2),
               "as sm_90, the 64-row dots on tcgen05"),
}


MMA_MIN = 16
"""The smallest dimension of a tensor-core product Triton compiles (``tl.dot``'s K, on every
target): every tile of a dot operand is at least this wide, and a narrower p or n is padded to it
with masked loads (the padding reads nothing and adds zeros)."""


def _pow2_between(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(value)))


def fused_state_width(state: int) -> int:
    """The state tile of the fused forward walk: the whole state n, rounded up to a power of two
    and to at least MMA_MIN (the K of its C·H0 product)."""
    return max(MMA_MIN, triton.next_power_of_2(state))


def tiles(problem, config: ScanTiles | None = None) -> Tiles:
    """The table entry for the plan's architecture (or ``config``) fitted to the problem:
    token, head-dim and state tiles at most the chunk, p and n (16 at least: the MMA's K),
    heads per dt program, the varlen search depth; the fused forward walk only while n (rounded
    up to a power of two) is at most FUSED_MAX_STATE."""
    c = config or TILES[target_arch(problem.device)][0]
    search = max(1, math.ceil(math.log2(problem.sequences + 1))) if problem.num_sequences else 1
    return Tiles(BQ=min(problem.chunk, c.BQ), BP=_pow2_between(problem.head_dim, MMA_MIN, c.BP),
                 BN=_pow2_between(problem.state, MMA_MIN, c.BN),
                 BLOCK_H=_pow2_between(problem.heads, 1, c.BLOCK_H), SEARCH=search,
                 FUSED=c.FUSED and triton.next_power_of_2(problem.state) <= FUSED_MAX_STATE,
                 FUSED_WARPS=c.FUSED_WARPS, FUSED_STAGES=c.FUSED_STAGES,
                 DBC_BN=_pow2_between(problem.state, MMA_MIN, c.DBC_BN), DX_IN_DBC=c.DX_IN_DBC,
                 DBC_STAGES=c.DBC_STAGES, WALK_STAGES=c.WALK_STAGES)


def candidates(problem) -> list[ScanTiles]:
    """Autotune candidates, one per distinct fit to the problem: the table's entry first; the
    other forward pipeline (fused or split); dx in its own launch or in the dB/dC launch,
    whichever the entry does not (the backward's occupancy against its traffic); the whole
    state per program (BN = 128: x read once by the states kernels, half their programs);
    32-row head-dim tiles (twice the output or fused programs)."""
    base = TILES[target_arch(problem.device)][0]
    apart = replace(base, DX_IN_DBC=False, DBC_STAGES=1)    # one stage suits dB/dC alone
    out = [base, replace(base, FUSED=not base.FUSED),
           apart if base.DX_IN_DBC else replace(base, DX_IN_DBC=True),
           replace(base, BN=128), replace(base, BP=32)]
    fitted = {}
    for config in out:                  # one per distinct fit (past n = 128 both are split)
        fitted.setdefault(tiles(problem, config), config)
    return list(fitted.values())


def counts(problem, t: Tiles) -> dict:
    """Row blocks per segment, head-dim and state tiles, the dB/dC kernel's state tiles
    (DBC_NNB: its U, W' and <dH1, H0> partials per segment and head)."""
    npb, nnb = triton.cdiv(problem.head_dim, t.BP), triton.cdiv(problem.state, t.BN)
    return dict(NQB=problem.chunk // t.BQ, NPB=npb, NNB=nnb,
                DBC_NNB=triton.cdiv(problem.state, t.DBC_BN))
