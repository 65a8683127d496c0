"""Mamba2 chunked scan (Triton): the per-architecture tile table, its autotune candidates, and
the analytic cost (FLOPs, HBM bytes) of every kernel, counted from the kernels' tiles and loops
(mamba2_fwd.py, mamba2_bwd.py; docs/mamba2.md, "Performance model"; docs/performance.md, "How
traffic is counted").

Counting rules, as docs/performance.md states them: what each program loads and stores counts;
a tile several programs load counts once per program (the h/g heads of a group re-reading B, C
and C·B, the row blocks re-reading a state: no L2 hit is assumed); a tile a program loads again
itself (the diagonal x block for D, dy rows in the decay-gradient loop) counts once; a small
operand every program reads whole (A, dt_bias, D, the varlen offsets) counts once. Masked-off
lanes move nothing; unmasked loads of padded workspace rows count in full. Token loops follow
the segment lengths ``contract.segment_lengths`` gives (packed sequences: an even split, which
the plan cannot know better). A kernel's FLOPs: ``mma_flops`` the tl.dot products over their
padded tiles, the rest the element-wise work on the CUDA cores (exp and log count one each).

Notation in the docstrings: T = b·l tokens, S = max_segments (the grid's segments; "used": the
segments holding tokens), h, g, R = h/g, p, n, Q; e = bytes of x's dtype, e_dt of dt's; per
segment of L tokens, v(k) = tokens of row block k, rb = row blocks holding tokens, tri =
rb(rb+1)/2; NQB = Q/BQ, NPB = ceil(p/BP), NNB = ceil(n/BN), NT = ceil(p·n/PASS); "x-sized" =
T·h·p·e, "state-sized" = S·h·p·n·4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import triton

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.target import target_arch
from fusedops.mamba2.contract import segment_lengths


@dataclass(frozen=True)
class ScanTiles:
    """One entry of the tile table (upper bounds; ``tiles`` fits them to a problem).

    BQ: tokens per row block (rows and columns of a segment's Q x Q blocks; the M of the output,
    C·B, dx and gradient products); BP: head-dim tile; BN: state tile; BLOCK_H: heads per dt
    program; PASS: state elements per state-passing program."""

    BQ: int = 64
    BP: int = 64
    BN: int = 64
    BLOCK_H: int = 16
    PASS: int = 1024


@dataclass(frozen=True)
class Tiles:
    """The tiles of one problem's scan kernels (powers of two)."""

    BQ: int
    BP: int
    BN: int
    BLOCK_H: int
    PASS: int
    SEARCH: int      # binary-search steps to find a segment's sequence (varlen)


TILES = {
    "sm_80": (ScanTiles(64, 64, 64, 16, 1024),
              "A100 (108 SMs, 164 KiB shared memory, mma.sync m16n8k16): today's tiles; the "
              "output kernel's 40.5 KiB of shared memory at two stages allows 4 CTAs per SM; no "
              "measurement yet says better"),
    "sm_90": (ScanTiles(64, 64, 64, 16, 1024),
              "H100/H200 (132 SMs, 228 KiB, wgmma): BQ = BP = 64 rows is one m64 wgmma per "
              "warpgroup, the smallest tile with no mma.sync; today's tiles, no measurement yet"),
    "sm_100": (ScanTiles(64, 64, 64, 16, 1024),
               "B200 (148 SMs, 228 KiB, tcgen05): today's tiles (Triton lowers the 64-row dots "
               "to tcgen05 with a 64-row M); no measurement yet"),
}


def _pow2_between(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(value)))


def tiles(problem, config: ScanTiles | None = None) -> Tiles:
    """The table entry for the plan's architecture (or ``config``) fitted to the problem:
    token, head-dim and state tiles at most the chunk, p and n (16 at least: the MMA's K),
    heads per dt program, state elements per state-passing program, the varlen search depth."""
    c = config or TILES[target_arch(problem.device)][0]
    search = max(1, math.ceil(math.log2(problem.sequences + 1))) if problem.num_sequences else 1
    return Tiles(BQ=min(problem.chunk, c.BQ), BP=_pow2_between(problem.head_dim, 16, c.BP),
                 BN=_pow2_between(problem.state, 16, c.BN),
                 BLOCK_H=_pow2_between(problem.heads, 1, c.BLOCK_H),
                 PASS=_pow2_between(problem.head_dim * problem.state, 16, c.PASS), SEARCH=search)


def candidates(problem) -> list[ScanTiles]:
    """Autotune candidates: the table's entry first; the whole state per program (BN = 128: x
    read once by the segment-state kernels, half the programs); 32-row head-dim tiles (twice
    the output programs); shorter state-passing programs (more of them along a sequence)."""
    base = TILES[target_arch(problem.device)][0]
    out = [base, replace(base, BN=128), replace(base, BP=32), replace(base, PASS=512)]
    return list(dict.fromkeys(out))


def counts(problem, t: Tiles) -> dict:
    """Row blocks per segment, head-dim and state tiles, state-passing programs per head."""
    return dict(NQB=problem.chunk // t.BQ, NPB=triton.cdiv(problem.head_dim, t.BP),
                NNB=triton.cdiv(problem.state, t.BN),
                NT=triton.cdiv(problem.head_dim * problem.state, t.PASS))


# -- the model -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Segment:
    """One segment length L (count: how many), its row blocks' token counts v(k)."""

    L: int
    count: int
    v: tuple[int, ...]

    @property
    def rb(self) -> int:
        return sum(1 for x in self.v if x)

    @property
    def tri(self) -> int:
        return self.rb * (self.rb + 1) // 2

    def below(self) -> int:
        """sum over row blocks i < rb of the tokens of the blocks k <= i."""
        return sum(sum(self.v[:i + 1]) for i in range(self.rb))

    def above(self) -> int:
        """sum over row blocks i < rb of the tokens of the blocks k >= i."""
        return sum(sum(self.v[i:]) for i in range(self.rb))

    def pair_rows(self, nqb: int) -> int:
        """sum over every block pair j <= i (of NQB) of v(i) + v(j): the rows a pair tile
        loads."""
        v = self.v
        return sum(v[i] + v[j] for i in range(nqb) for j in range(i + 1))


class _Dims:
    """The sizes every kernel's model uses (see the module docstring)."""

    def __init__(self, problem, t: Tiles) -> None:
        c = counts(problem, t)
        self.T = problem.batch * problem.length
        self.S = problem.max_segments
        self.H, self.G, self.P, self.N, self.Q = (problem.heads, problem.groups, problem.head_dim,
                                                  problem.state, problem.chunk)
        self.R = self.H // self.G
        self.e, self.edt = element_size(problem.dtype), element_size(problem.dt_dtype)
        self.NQB, self.NPB, self.NNB, self.NT = c["NQB"], c["NPB"], c["NNB"], c["NT"]
        self.BQ, self.BP, self.BN = t.BQ, t.BP, t.BN
        self.Pp, self.Np = self.NPB * t.BP, self.NNB * t.BN          # padded to the tiles
        self.pairs = self.NQB * (self.NQB + 1) // 2
        self.segs = [_Segment(L, n, tuple(min(t.BQ, max(0, L - k * t.BQ))
                                          for k in range(self.NQB)))
                     for L, n in segment_lengths(problem)]
        self.used = sum(s.count for s in self.segs)
        self.seqs = problem.sequences
        self.varlen = problem.num_sequences is not None
        # the offsets every varlen program searches: small, read by all, counted once per kernel
        self.table = 8 * (self.seqs + 1) if self.varlen else 0

    def each(self, f) -> float:
        """sum over the used segments of f(segment) (times their count)."""
        return sum(s.count * f(s) for s in self.segs)


def table_cost(problem) -> Cost:
    """Varlen offsets: cu_seqlens read, its sanitised copy written and read back for the
    lengths, the first-segment table written: 4·(nseq+1) bytes each."""
    k = 4 * (problem.sequences + 1)
    return Cost(4 * (problem.sequences + 1), 2 * k, 2 * k)


def zero_uncovered_cost(problem) -> Cost:
    """Every program loads the two sanitised end offsets (read by all: counted once) and, for
    valid offsets, writes nothing: the model assumes valid index data."""
    return Cost(0, 8, 0)


def dt_cumsum_cost(problem, t: Tiles) -> Cost:
    """dt read once (T·h·e_dt); A and dt_bias slices read by every segment's program (counted
    once); dts and acum written for every segment, Q per head (2·S·h·Q·4, unused trailing
    segments write zeros). FLOPs: bias, softplus (6), clamp (2), ·A and the cumsum per
    (segment row, head)."""
    d = _Dims(problem, t)
    read = d.T * d.H * d.edt + 4 * d.H * (1 + problem.has_dt_bias) + d.table
    flops = d.S * d.Q * d.H * (4 + problem.has_dt_bias + 6 * problem.dt_softplus)
    return Cost(flops, read, 2 * d.S * d.H * d.Q * 4)


def cb_cost(problem, t: Tiles) -> Cost:
    """Per segment and group, every block pair j <= i (no early exit on the segment's end):
    C rows i and B rows j over the whole state, v(i)·n·e + v(j)·n·e, and a [BQ, BQ] fp32 tile
    written. B and C are read NQB+1 times over (pairs x 2 / NQB). MMA: [BQ, BN] @ [BN, BQ] over
    n, for every pair of every grid segment."""
    d = _Dims(problem, t)
    read = d.G * d.each(lambda s: s.pair_rows(d.NQB)) * d.N * d.e + d.table
    written = d.S * d.G * d.pairs * d.BQ * d.BQ * 4
    mma = d.S * d.G * d.pairs * 2 * d.BQ * d.BQ * d.Np
    return Cost(mma, read, written, mma, d.BQ)


def segment_state_cost(problem, t: Tiles, from_start: bool) -> Cost:
    """Per (segment, head, p tile, n tile) program, rb token blocks of x^T [BP, BQ] and B
    [BQ, BN] (dy and C ``from_start``): x is read once per n tile (NNB·x-sized), B once per head
    and p tile (h·NPB·T·n·e: the R heads of a group each read it), acum (and dts) BQ·4 per block
    unmasked; every program writes its fp32 [BP, BN] tile (state-sized: the forward's own states,
    the backward's dH0 terms). MMA: [BP, BQ] @ [BQ, BN] per block; CUDA: the decay weights and
    the scaling of B."""
    d = _Dims(problem, t)
    w = 4 if from_start else 8
    per_head = d.each(lambda s: s.L * (d.P * d.NNB + d.N * d.NPB) * d.e
                      + s.rb * d.BQ * w * d.NPB * d.NNB)
    read = d.H * per_head + 4 * d.S * d.H * d.NPB * d.NNB + d.table
    written = d.S * d.H * d.P * d.N * 4
    blocks = d.each(lambda s: s.rb) * d.H
    mma = blocks * 2 * d.BQ * d.Pp * d.Np
    cuda = blocks * d.NPB * d.NNB * d.BQ * (d.BN + 4)
    return Cost(mma + cuda, read, written, mma, d.BP)


def state_passing_cost(problem, t: Tiles) -> Cost:
    """Along each sequence, per (head, PASS elements): each used segment's own state read and
    the entering state written in its place (state-sized each), its last acum read (one scalar
    per program); initial_states read and final_states written once. FLOPs: decay·state + own
    per element and segment."""
    d = _Dims(problem, t)
    state = d.H * d.P * d.N * 4
    read = d.used * state + d.used * d.H * d.NT * 4 + (d.seqs * state if problem.has_initial_states
                                                       else 0) + d.table
    written = d.used * state + d.seqs * state
    return Cost(2 * d.used * d.H * d.P * d.N + d.used * d.H * d.NT, read, written)


def chunk_scan_cost(problem, t: Tiles) -> Cost:
    """The output, per (segment, head, p tile, row block i) program (those past the segment's
    end return): C rows i over n (v(i)·n·e, so C is read h·NPB times over: by every head of its
    group and p tile) and the entering state's [BP, n] fp32 tile (state-sized x rb per segment:
    NQB times over for full segments); then for every block k <= i a C·B tile (BQ²·4), acum and
    dts (BQ·4 each) and x rows k (x read tri/rb times over: 2.5 at Q = 256, BQ = 64); the D term
    re-loads the diagonal x block the loop just loaded (counted once); z read, y (and y before
    the gate) written once. MMA: [BQ, BN] @ [BN, BP] over n and [BQ, BQ] @ [BQ, BP] per pair."""
    d = _Dims(problem, t)
    e = d.e
    per_head = d.each(lambda s: d.NPB * (sum(s.v) * d.N * e + s.rb * d.BQ * 4
                                         + s.tri * (d.BQ * d.BQ * 4 + 2 * d.BQ * 4))
                      + s.rb * d.P * d.N * 4 + s.below() * d.P * e)
    xbytes = d.T * d.H * d.P * e
    D = (d.H * d.P if problem.D_per_channel else d.H) * 4 if problem.has_D else 0
    read = d.H * per_head + xbytes * problem.has_z + D + d.table
    written = xbytes * (1 + problem.has_z)
    rows = d.H * d.each(lambda s: s.rb)
    pairs = d.H * d.each(lambda s: s.tri)
    mma = d.NPB * (rows * 2 * d.BQ * d.Np * d.BP + pairs * 2 * d.BQ * d.BQ * d.BP)
    cuda = d.NPB * (pairs * d.BQ * d.BQ * 6 + rows * d.BQ * d.BP * (1 + 2 * problem.has_D
                                                                    + 5 * problem.has_z))
    return Cost(mma + cuda, read, written, mma, d.BQ)


def gate_bwd_cost(problem, t: Tiles) -> Cost:
    """dy, z and y before the gate read, dy·silu(z) and dz written: element-wise, x-sized each."""
    numel = problem.batch * problem.length * problem.heads * problem.head_dim
    e = element_size(problem.dtype)
    return Cost(12 * numel, 3 * numel * e, 2 * numel * e)


def state_passing_bwd_cost(problem, t: Tiles) -> Cost:
    """Backwards along each sequence, per (head, PASS elements): each used segment's own dH0
    term and its entering state H0 read, its dH1 written in place (state-sized each), one
    <dH1, H0> partial per program written; dfinal_states read and dinitial_states written once
    where given. FLOPs: the decayed sum and the dot product, 4 per element and segment."""
    d = _Dims(problem, t)
    state = d.H * d.P * d.N * 4
    seq_state = d.seqs * state
    read = (2 * d.used * state + d.used * d.H * d.NT * 4
            + (seq_state if problem.has_dfinal_states else 0) + d.table)
    written = (d.used * state + d.used * d.H * d.NT * 4
               + (seq_state if problem.has_initial_states else 0))
    return Cost(4 * d.used * d.H * d.P * d.N, read, written)


def dx_cost(problem, t: Tiles) -> Cost:
    """dx, per (segment, head, p tile, row block j) program (no early exit): B rows j over n
    (B read h·NPB times over) and the segment's [BP, n] dH1 tile, loaded by every row block of
    every grid segment (NQB x state-sized); for every block i >= j holding tokens a C·B tile, its
    acum and dy rows i (dy read tri/rb times over, the D term's re-load of the diagonal block
    counted once); x rows j; dx written once, ddt partials (BQ·4 per program) and dD partials
    (BP·4 per program). MMA: [BQ, BN] @ [BN, BP] over n for every program, [BQ, BQ] @ [BQ, BP]
    per pair."""
    d = _Dims(problem, t)
    e = d.e
    per_head = d.each(lambda s: d.NPB * (s.L * d.N * e + s.tri * (d.BQ * d.BQ * 4 + d.BQ * 4))
                      + s.above() * d.P * e)
    xbytes = d.T * d.H * d.P * e
    read = (d.H * per_head + d.S * d.H * d.NQB * (d.P * d.N * 4 + d.NPB * 2 * d.BQ * 4)
            + xbytes + ((d.H * d.P if problem.D_per_channel else d.H) * 4 if problem.has_D else 0)
            + d.table)
    written = (xbytes + d.S * d.H * d.NPB * d.Q * 4
               + (d.S * d.H * d.NQB * d.P * 4 if problem.has_D else 0))
    programs = d.S * d.H * d.NPB * d.NQB
    pairs = d.H * d.NPB * d.each(lambda s: s.tri)
    mma = programs * 2 * d.BQ * d.Np * d.BP + pairs * 2 * d.BQ * d.BQ * d.BP
    cuda = pairs * d.BQ * d.BQ * 5 + programs * d.BQ * d.BP * (3 + 2 * problem.has_D)
    return Cost(mma + cuda, read, written, mma, d.BQ)


def dcb_cost(problem, t: Tiles) -> Cost:
    """d(C·B), per (segment, group, block pair j <= i) program (no early exit on the segment's
    end): for each of the R heads, dy rows i and x rows j over p (dy and x each read (NQB+1)/2
    times over for full segments: 2.5 at Q = 256) and acum/dts (3·BQ·4); one fp32 [BQ, BQ] tile
    written. MMA: [BQ, BP] @ [BP, BQ] over p, per head and pair of every grid segment."""
    d = _Dims(problem, t)
    read = (d.H * d.each(lambda s: s.pair_rows(d.NQB)) * d.P * d.e
            + d.S * d.H * d.pairs * 3 * d.BQ * 4 + d.table)
    written = d.S * d.G * d.pairs * d.BQ * d.BQ * 4
    mma = d.S * d.H * d.pairs * 2 * d.BQ * d.BQ * d.Pp
    return Cost(mma + d.S * d.H * d.pairs * d.BQ * d.BQ * 6, read, written, mma, d.BQ)


def dacs_intra_cost(problem, t: Tiles) -> Cost:
    """Straddling-pair sums of the decay gradient, per (segment, head, row block i) program
    (past the end: none): dy rows i (re-loaded by the program for every block, counted once),
    then for every block j <= i x rows j (x read tri/rb times over), a C·B tile, acum and dts;
    BQ·4 partials written per pair. MMA: dy·x^T [BQ, BP] @ [BP, BQ] over p per pair (the same
    products the d(C·B) kernel computes, again)."""
    d = _Dims(problem, t)
    per_head = d.each(lambda s: sum(s.v) * d.P * d.e + s.rb * d.BQ * 4
                      + s.below() * d.P * d.e + s.tri * (d.BQ * d.BQ * 4 + 2 * d.BQ * 4))
    pairs = d.H * d.each(lambda s: s.tri)
    mma = pairs * 2 * d.BQ * d.BQ * d.Pp
    return Cost(mma + pairs * d.BQ * d.BQ * 10, d.H * per_head + d.table,
                pairs * d.BQ * 4, mma, d.BQ)


def dbc_cost(problem, t: Tiles, grad_b: bool) -> Cost:
    """dB (``grad_b``) or dC, per (segment, group, row block, n tile) program (past the end:
    none): its own rows of B (C) and, for every block on the other side of the diagonal, a
    d(C·B) tile and the other operand's rows (C for dB, B for dC); then for each of the R heads
    acum (and dts), the x (dy) rows over p (x-sized x NNB: every n tile re-reads them) and the
    [p, BN] dH1 (H0) tile (state-sized x rb per segment); one BQ·4 partial per head written and
    the rows of dB (dC) once. MMA: [BQ, BQ] @ [BQ, BN] per pair and [BQ, BP] @ [BP, BN] per
    head."""
    d = _Dims(problem, t)
    e = d.e
    other = (lambda s: s.above()) if grad_b else (lambda s: s.below())
    per_group = d.each(lambda s: s.L * d.N * e + d.NNB * s.tri * d.BQ * d.BQ * 4
                       + other(s) * d.N * e
                       + d.R * (s.rb * d.NNB * d.BQ * 4 * (2 if grad_b else 1)
                                + s.L * d.P * e * d.NNB + s.rb * d.P * d.N * 4))
    read = d.G * per_group + d.table
    rows = d.each(lambda s: s.rb)
    written = d.T * d.G * d.N * e + d.H * rows * d.NNB * d.BQ * 4
    mma = d.NNB * (d.G * d.each(lambda s: s.tri) * 2 * d.BQ * d.BQ * d.BN
                   + d.H * rows * 2 * d.BQ * d.Pp * d.BN)
    cuda = d.H * rows * d.NNB * d.BQ * (d.Pp + 2 * d.BN + 4)
    return Cost(mma + cuda, read, written, mma, d.BQ)


def dt_bwd_cost(problem, t: Tiles) -> Cost:
    """ddt, per (segment, head) program: the straddling partials of its row blocks (rb·Q·4),
    the dx, U and W partials (NPB, NNB, NNB rows of Q·4), the <dH1, H0> partials and dts, all
    unmasked, for every grid segment; dt read and ddt written once; dA and ddt_bias partials
    (4 bytes per program each)."""
    d = _Dims(problem, t)
    rows = d.each(lambda s: s.rb)
    read = (d.H * rows * d.Q * 4 + d.S * d.H * ((d.NPB + 2 * d.NNB + 1) * d.Q * 4 + d.NT * 4)
            + d.T * d.H * d.edt + 4 * d.H * (1 + problem.has_dt_bias) + d.table)
    written = d.T * d.H * d.edt + d.S * d.H * 4 * (1 + problem.has_dt_bias)
    flops = d.S * d.H * d.Q * (d.NPB + 2 * d.NNB + 12 + 6 * problem.dt_softplus) + d.H * rows * d.Q
    return Cost(flops, read, written)


def param_reduce_cost(problem, t: Tiles) -> Cost:
    """dA, ddt_bias and dD: every segment's partials read once (S·h·4 each, dD S·h·NQB·p·4),
    the results written (and read first when accumulating)."""
    d = _Dims(problem, t)
    parts = (d.S * d.H * (1 + problem.has_dt_bias)
             + (d.S * d.H * d.NQB * d.P if problem.has_D else 0))
    out = d.H * (1 + problem.has_dt_bias) + ((d.H * d.P if problem.D_per_channel else d.H)
                                             if problem.has_D else 0)
    return Cost(parts, 4 * (parts + out * problem.accumulate), 4 * out)
