"""Mamba2 chunked scan (Triton): the per-architecture tile table, its autotune candidates, the
tile counts a problem gives, and the CTAs per SM the kernel report measured for the table's
entries (what the cost model's waves are cut by: backends/triton/mamba2_model.py)."""

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
    program."""

    BQ: int = 64
    BP: int = 64
    BN: int = 64
    BLOCK_H: int = 16


@dataclass(frozen=True)
class Tiles:
    """The tiles of one problem's scan kernels (powers of two)."""

    BQ: int
    BP: int
    BN: int
    BLOCK_H: int
    SEARCH: int      # binary-search steps to find a segment's sequence (varlen)


TILES = {
    "sm_80": (ScanTiles(64, 64, 64, 16),
              "A100 (108 SMs, 164 KiB shared memory, mma.sync m16n8k16): today's tiles; the "
              "output kernel's 40.5 KiB of shared memory at two stages allows 4 CTAs per SM; no "
              "measurement yet says better"),
    "sm_90": (ScanTiles(64, 64, 64, 16),
              "H100/H200 (132 SMs, 228 KiB, wgmma): BQ = BP = 64 rows is one m64 wgmma per "
              "warpgroup, the smallest tile with no mma.sync; today's tiles, no measurement yet"),
    "sm_100": (ScanTiles(64, 64, 64, 16),
               "B200 (148 SMs, 228 KiB, tcgen05): today's tiles (Triton lowers the 64-row dots "
               "to tcgen05 with a 64-row M); no measurement yet"),
}


def _pow2_between(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(value)))


def tiles(problem, config: ScanTiles | None = None) -> Tiles:
    """The table entry for the plan's architecture (or ``config``) fitted to the problem:
    token, head-dim and state tiles at most the chunk, p and n (16 at least: the MMA's K),
    heads per dt program, the varlen search depth."""
    c = config or TILES[target_arch(problem.device)][0]
    search = max(1, math.ceil(math.log2(problem.sequences + 1))) if problem.num_sequences else 1
    return Tiles(BQ=min(problem.chunk, c.BQ), BP=_pow2_between(problem.head_dim, 16, c.BP),
                 BN=_pow2_between(problem.state, 16, c.BN),
                 BLOCK_H=_pow2_between(problem.heads, 1, c.BLOCK_H), SEARCH=search)


def candidates(problem) -> list[ScanTiles]:
    """Autotune candidates: the table's entry first; the whole state per program (BN = 128: x
    read once by the states kernels, half their programs); 32-row head-dim tiles (twice the
    output programs)."""
    base = TILES[target_arch(problem.device)][0]
    out = [base, replace(base, BN=128), replace(base, BP=32)]
    return list(dict.fromkeys(out))


def counts(problem, t: Tiles) -> dict:
    """Row blocks per segment, head-dim and state tiles, state tiles per head (NT = NPB·NNB:
    the <dH1, H0> partials of a segment and head)."""
    npb, nnb = triton.cdiv(problem.head_dim, t.BP), triton.cdiv(problem.state, t.BN)
    return dict(NQB=problem.chunk // t.BQ, NPB=npb, NNB=nnb, NT=npb * nnb)


# -- waves and L2 --------------------------------------------------------------------------------
# CTAs per SM of each kernel with the tile table's entry, as ``fusedops kernels --backend triton
# --only "scan "`` reports them at h128 p64 n128 Q256 (triton 3.9, 2026-12-01; registers decide all
# but C·B's on sm_90/sm_100: shared memory), and the
# other production shapes where their registers give another (CTAS_VARIANTS, keyed by the shape's
# ``_variant``); tests/test_kernel_report.py checks both against the compiled kernels. The
# kernels not listed share no tile between programs (dt transform, gate, ddt, parameter
# reduction): waves change nothing.
CTAS_PER_SM = {
    "ssd_cb_kernel": {"sm_80": 4, "sm_90": 6, "sm_100": 6},
    "ssd_chunk_states_kernel": {"sm_80": 2, "sm_90": 3, "sm_100": 4},
    "ssd_chunk_states_bwd_kernel": {"sm_80": 3, "sm_90": 3, "sm_100": 4},
    "ssd_chunk_scan_fwd_kernel": {"sm_80": 3, "sm_90": 3, "sm_100": 3},
    "ssd_chunk_scan_bwd_dx_kernel": {"sm_80": 2, "sm_90": 2, "sm_100": 3},
    "ssd_dcb_kernel": {"sm_80": 2, "sm_90": 2, "sm_100": 2},
    "ssd_dacs_intra_kernel": {"sm_80": 2, "sm_90": 2, "sm_100": 2},
    "ssd_dbc_kernel (dB)": {"sm_80": 2, "sm_90": 2, "sm_100": 2},
    "ssd_dbc_kernel (dC)": {"sm_80": 2, "sm_90": 2, "sm_100": 2},
}
_Q128, _PACKED, _P80 = ("Q < 256",), ("packed",), ("p > 64", "Q < 256")
CTAS_VARIANTS = {
    ("ssd_chunk_scan_fwd_kernel", "sm_100", _P80): 4,
    ("ssd_chunk_scan_bwd_dx_kernel", "sm_100", _Q128): 2,
    ("ssd_chunk_scan_bwd_dx_kernel", "sm_100", _P80): 2,
    ("ssd_dcb_kernel", "sm_90", _PACKED): 3,
    ("ssd_dbc_kernel (dC)", "sm_100", _PACKED): 3,
    ("ssd_dbc_kernel (dB)", "sm_80", _P80): 1,
    ("ssd_dbc_kernel (dC)", "sm_100", _Q128): 3,
    ("ssd_chunk_states_bwd_kernel", "sm_90", _PACKED): 4,
    ("ssd_chunk_states_bwd_kernel", "sm_90", _P80): 2,
    ("ssd_chunk_states_bwd_kernel", "sm_100", _P80): 3,
}


def _variant(problem) -> tuple[str, ...]:
    """The features of a production shape that change a kernel's registers: packed sequences,
    a head dim past one 64-row tile, a chunk shorter than 256 (fewer row blocks per segment)."""
    return (("packed",) if problem.num_sequences is not None else ()) + \
        (("p > 64",) if problem.head_dim > 64 else ()) + (("Q < 256",) if problem.chunk < 256 else ())


def occupancy_key(spec) -> str | None:
    """The CTAS_PER_SM key of a scan KernelSpec (the dB and dC kernels "(dB)" and "(dC)"), or
    None for a kernel the waves do not need."""
    c = dict(spec.constexprs)
    key = spec.name
    if "GRAD_B" in c:
        key += " (dB)" if c["GRAD_B"] else " (dC)"
    return key if key in CTAS_PER_SM else None


def ctas_per_sm(kernel: str, problem, t: Tiles, arch: str) -> int:
    """CTAs per SM of ``kernel`` (a key of CTAS_PER_SM) on ``arch``: the reported occupancy when
    ``t`` holds the tile table's BQ, BP, BN for the problem; a configuration outside the table
    (an autotune candidate, a ``config=``) is counted at one CTA per SM (the smallest wave: the
    most re-reads)."""
    table = tiles(problem, TILES[arch][0])
    if (t.BQ, t.BP, t.BN) != (table.BQ, table.BP, table.BN):
        return 1
    return CTAS_VARIANTS.get((kernel, arch, _variant(problem)), CTAS_PER_SM[kernel][arch])
