"""Mamba2 chunked scan (Triton): the analytic cost (FLOPs, HBM bytes) of the scan kernels
(kernels_forward.py, and kernels_backward.py's state walk; its per-chunk kernels' in
cost_backward.py), counted from the kernels' tiles (tiles.py), loops and program order
(docs/mamba2_scan.md, "Performance model"; docs/performance.md, "How traffic is counted").

Counting rules, as docs/performance.md states them. Programs start in launch order, the grid's
first dimension fastest; programs that return at once (row blocks past a segment's end) take
no slot. A program's load of a tile several programs load (B, C
and C·B by the R heads of a group, a segment's acum by its heads' row blocks) hits in the L2
when the previous program that loaded it is at most G programs earlier, G = half the L2 (50 MB
sm_90, 126 MB sm_100, 40 MB sm_80: ``l2_reuse.machine``) over the mean bytes a program of the
launch moves (``l2_reuse.reuse_traffic``); otherwise, and the first time, it counts (a grid
with the row block in its slowest dimension re-reads a segment's state once per row block). A
tile a program loads again itself (the diagonal x block for D, dy rows in the decay-gradient
loop) counts once. Values passed between kernels through HBM (the passed states, dts and acum,
C·B, d(C·B), the fp32 partials) count in the kernel that reads them. A small operand every
program reads whole (A, dt_bias, D, the varlen offsets) counts once. Masked-off lanes move
nothing; unmasked loads of padded workspace rows count in full. Token loops follow the segment
lengths ``segment_tokens`` gives (packed sequences: the even split the tuning inputs use, which
the plan cannot know better). ``l2_reuse.Programs`` does the counting from each kernel's
tiles, keyed by what they hold; each cost function's docstring states its kernel's order and
reuse, with G at the production shape (b = 2, l = 8192, h = 128, p = 64, n = 128, g = 8,
Q = 256, bf16, BQ = BP = BN = 64) on sm_90 (sm_100's is 2.5 times as large). A kernel's
FLOPs: ``mma_flops`` the tl.dot products over their padded tiles, the rest the element-wise
work on the CUDA cores (exp and log count one each). Not modelled: the runs of sequence ids
(``has_seq_idx``: an int32 per token some kernels read).

Notation in the docstrings: T = b·l tokens, S = max_segments (the grid's segments; "used": the
segments holding tokens), h, g, R = h/g, p, n, Q; e = bytes of x's dtype, e_dt of dt's; per
segment of L tokens, v(k) = tokens of row block k, rb = row blocks holding tokens, tri =
rb(rb+1)/2; NQB = Q/BQ, NPB = ceil(p/BP), NNB = ceil(n/BN); "x-sized" =
T·h·p·e, "state-sized" = S·h·p·n·4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.machines import machine
from fusedops.core.target import target_arch
from fusedops.mamba2_scan.contract import segment_lengths

from .tiles import Tiles, counts, fused_state_width
from ..l2_reuse import Programs, every_program, key, per_arch


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
        self.es = element_size(problem.state_dtype)
        self.NQB, self.NPB, self.NNB = c["NQB"], c["NPB"], c["NNB"]
        self.BQ, self.BP, self.BN = t.BQ, t.BP, t.BN
        self.Pp, self.Np = self.NPB * t.BP, self.NNB * t.BN          # padded to the tiles
        self.DBC_BN, self.DBC_NNB = t.DBC_BN, c["DBC_NNB"]
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

def segment_tokens(problem) -> list[int]:
    """Tokens of every grid segment in segment order: each of the b rows' ceil(l/Q) segments,
    or with cu_seqlens the sequences of the even split (cu[i] = i·l // nseq, the tuning inputs')
    one after another; then the unused segments (0)."""
    Q = problem.chunk
    if problem.num_sequences is None:
        lengths = [problem.length] * problem.batch
    else:
        n, l = problem.num_sequences, problem.length
        lengths = [(i + 1) * l // n - i * l // n for i in range(n)]
    out = [min(Q, L - c * Q) for L in lengths for c in range(-(-L // Q))]
    return out + [0] * (problem.max_segments - len(out))


class _Launch:
    """The programs of one scan kernel's grid, counted in the plan's architecture's L2, with the
    segment lengths: ``L[s]`` tokens of grid segment s, ``V[s, k]`` of its row block k."""

    def __init__(self, problem, t: Tiles, dims, active=None):
        self.d = d = _Dims(problem, t)
        box = machine(target_arch(problem.device))
        self.L = torch.tensor(segment_tokens(problem), dtype=torch.int64)
        self.V = (self.L[:, None] - torch.arange(d.NQB)[None, :] * d.BQ).clamp(0, d.BQ)
        self.programs = Programs(dims, box.l2_bytes,
                                 None if active is None else (lambda *c: active(self, *c)))

    def rows(self, extent: int, tile: int, index) -> torch.Tensor:
        """Elements of tile ``index`` of ``tile`` along ``extent`` (the last one masked)."""
        return (extent - index * tile).clamp(max=tile)

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
    """Grid (S, h/BLOCK_H): each program reads its segment's dt rows for BLOCK_H heads (dt read
    once: no tile is shared), the A and dt_bias slices (read by every segment's program: counted
    once); dts and acum written for every segment, Q per head (2·S·h·Q·4, unused trailing
    segments write zeros). FLOPs: bias, softplus (6), clamp (2), ·A and the cumsum per (segment
    row, head)."""
    d = _Dims(problem, t)
    read = d.T * d.H * d.edt + 4 * d.H * (1 + problem.has_dt_bias) + d.table
    flops = d.S * d.Q * d.H * (4 + problem.has_dt_bias + 6 * problem.dt_softplus)
    return Cost(flops, read, 2 * d.S * d.H * d.Q * 4)


def _block_pairs(nqb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) of every block pair j <= i of nqb row blocks, row-major (the kernels'
    ``block_pair``)."""
    i, j = torch.tril_indices(nqb, nqb)
    return i, j


SECTOR = 32
"""The bytes of the smallest transfer between an SM and the L2 (a quarter of a 128-byte line)."""


def cb_tile_bytes(d: _Dims, i, k) -> torch.Tensor:
    """Bytes of the fp32 C·B tile of block pair (i, k <= i) as the kernels store and load it:
    whole below the diagonal; on it the entries k <= i only (masked), counted in the 32-byte
    sectors their rows touch (9 KiB of the 16 at BQ = 64)."""
    rows = torch.arange(1, d.BQ + 1)
    diagonal = int((((rows * 4 + SECTOR - 1) // SECTOR) * SECTOR).sum())
    i = torch.as_tensor(i)
    return torch.where(i == torch.as_tensor(k), diagonal, d.BQ * d.BQ * 4)


@per_arch
def cb_cost(problem, t: Tiles) -> Cost:
    """C·B. Order: a 1-D grid over (block pair, S·g), the pairs (i, j <= i) of a (segment,
    group) fastest, row-major (tri = NQB(NQB + 1)/2 programs, no pair above the diagonal
    launched). Reuse: a program moves C rows i and B rows j (v·n·e each) and stores a [BQ, BQ]
    fp32 tile: 48 KiB, G = 509 on sm_90; the pairs sharing C rows i (i, 0..i) or B rows j
    (j..NQB-1, j) are at most tri - 1 = 9 programs apart, so C and B are read once (where
    (S·g, NQB²) order, the pairs S·g = 512 programs apart, read every row (NQB + 1)/2 = 2.5
    times on sm_90). One fp32 [BQ, BQ] tile written per pair of every grid segment (on the
    diagonal its lower half: ``cb_tile_bytes``). MMA:
    [BQ, BN] @ [BN, BQ] over n for every pair of every grid segment."""
    d = _Dims(problem, t)
    nqb = d.NQB
    launch = _Launch(problem, t, (d.pairs, d.S * d.G))
    w = launch.programs
    ij, sg = w.coords
    pi, pj = _block_pairs(nqb)
    s, g, i, j = sg // d.G, sg % d.G, pi[ij], pj[ij]
    every = every_program(w)
    w.load("C", every, key((s, d.S), (i, nqb), (g, d.G)), launch.V[s, i] * d.N * d.e)
    w.load("B", every, key((s, d.S), (j, nqb), (g, d.G)), launch.V[s, j] * d.N * d.e)
    w.store(every, cb_tile_bytes(d, i, j))
    read, written = w.count()
    mma = d.S * d.G * d.pairs * 2 * d.BQ * d.BQ * d.Np
    return Cost(mma, read + d.table, written, mma, d.BQ)


def _sequences(problem, d: _Dims):
    """(first segment, segments) of every sequence, in sequence order (``segment_tokens``)."""
    Q = problem.chunk
    if problem.num_sequences is None:
        lengths = [problem.length] * problem.batch
    else:
        n, l = problem.num_sequences, problem.length
        lengths = [(i + 1) * l // n - i * l // n for i in range(n)]
    counts = torch.tensor([-(-L // Q) for L in lengths], dtype=torch.int64)
    return torch.cumsum(counts, 0) - counts, counts


@per_arch
def chunk_states_cost(problem, t: Tiles, entering: bool, backward: bool = False) -> Cost:
    """The states along every sequence (``backward``: their gradients, walked from the last
    segment, with dy for x and C for B). Order: a 1-D grid over (NNB, NPB, sequences·h), the
    state tile fastest; each program walks its sequence's segments (every load of its loop
    counts as the program's). Reuse: x rows (the segment's tokens over the BP head-dim rows)
    are shared by the NNB state tiles next to each other (1 program apart), B rows by the R
    heads of the group (NNB·NPB = 2 apart), acum and dts (BQ·4 per block, unmasked) and the
    last acum by the tiles of the (segment, head); a program moves about 2.5 MB (3 MB backward)
    at the production shape, G = 10 (8.5 backward), so x, B, acum and dts are read once. Every
    step writes the entering [BP, BN] tile in the state dtype (and fp32 into segment_states
    with ``entering``); initial_states read and final_states written once. Backward: no dts;
    every step writes the dH1 tile (input dtype; its <dH1, H0> partial is the dB/dC kernel's,
    which reads H0 anyway, so the walk reads no entering state); dfinal_states read and
    dinitial_states written once. MMA: [BP, BQ] @ [BQ, BN] per block;
    CUDA: the decay weights, the scaling of B (C), the decayed carry (and the partial). With z the
    backward forms dy·silu(z) from dy, z and y before the gate, read like dy (shared by the NNB
    state tiles), and the first state tile's programs write it and dz (2·e per element); the gate's
    FLOPs count once per state tile."""
    d = _Dims(problem, t)
    first, count = _sequences(problem, d)
    steps = max(1, int(count.max()))
    launch = _Launch(problem, t, (d.NNB, d.NPB, d.seqs * d.H))
    w, V = launch.programs, launch.V
    jn, ip, sh = w.coords
    i_s, h = sh // d.H, sh % d.H
    g = h // d.R
    walked = count[i_s]                                   # the segments a program walks
    bp, bn = launch.rows(d.P, d.BP, ip), launch.rows(d.N, d.BN, jn)

    def segment(prog, step):
        return (first[i_s[prog]] + step).clamp(max=d.S - 1)

    prog, sk = w.loop(steps * d.NQB, lambda p, sk: (sk // d.NQB < walked[p])
                      & (V[segment(p, sk // d.NQB), sk % d.NQB] > 0))
    seg, k = segment(prog, sk // d.NQB), sk % d.NQB
    hk, v = h[prog], V[segment(prog, sk // d.NQB), sk % d.NQB]
    w.load("dy" if backward else "x", prog,
           key((seg, d.S), (k, d.NQB), (hk, d.H), (ip[prog], d.NPB)), v * bp[prog] * d.e)
    w.load("C" if backward else "B", prog,
           key((seg, d.S), (k, d.NQB), (g[prog], d.G), (jn[prog], d.NNB)), v * bn[prog] * d.e)
    if backward and problem.has_z:      # the gate: z and y before it read as dy is
        for operand in ("z", "y before the gate"):
            w.load(operand, prog, key((seg, d.S), (k, d.NQB), (hk, d.H), (ip[prog], d.NPB)),
                   v * bp[prog] * d.e)
        w.store(prog, (jn[prog] == 0) * v * bp[prog] * 2 * d.e)    # dy·silu(z) and dz
    w.load("acum", prog, key((seg, d.S), (hk, d.H), (k, d.NQB)), d.BQ * 4)
    if not backward:
        w.load("dts", prog, key((seg, d.S), (hk, d.H), (k, d.NQB)), d.BQ * 4)
    prog, step = w.loop(steps, lambda p, step: step < walked[p])
    w.load("acum last", prog, key((segment(prog, step), d.S), (h[prog], d.H)), 4)
    every, tile = every_program(w), bp * bn
    if backward:
        w.alone(every, tile * 4 * problem.has_dfinal_states)
        w.store(every, walked * tile * d.e + tile * 4 * problem.has_initial_states)
    else:
        w.alone(every, tile * 4 * problem.has_initial_states)
        w.store(every, walked * tile * (d.es + 4 * entering) + tile * 4)
    read, written = w.count()
    blocks = d.each(lambda s: s.rb) * d.H
    mma = blocks * 2 * d.BQ * d.Pp * d.Np
    cuda = (blocks * d.NPB * d.NNB * d.BQ * (d.BN + 4)
            + (4 if backward else 2) * d.used * d.H * d.P * d.N)
    if backward and problem.has_z:      # the gate's 12 FLOPs per element, in every state tile
        cuda += 12 * d.NNB * d.T * d.H * d.P
    return Cost(mma + cuda, read + d.table, written, mma, d.BP)


@per_arch
def chunk_scan_cost(problem, t: Tiles) -> Cost:
    """The output. Order: a 1-D grid over (NPB, NQB, S·h), the head-dim tile fastest, then the
    row block i, the (segment, head) slowest; programs past their segment's end return (no
    slot). Reuse: C rows i (over n) and the C·B tiles (i, k <= i) are shared by the R heads of
    the group (NPB·NQB = 4 programs apart at NQB = 4, NPB = 1); the entering state's [BP, n]
    tile by the segment's row blocks (once, where (S·h, NPB, NQB) order re-read it NQB times,
    S·h programs apart); x rows k by every row block i >= k of the (segment, head), acum and
    dts rows likewise (at most NQB - 1 apart); the D term re-loads the diagonal x block the loop
    just loaded (counted once). A program moves 126 KiB on average at the production shape:
    G = 194, so every shared tile is read once. z read, y (and y before the gate) written once.
    MMA: [BQ, BN] @ [BN, BP] over n and [BQ, BQ] @ [BQ, BP] per pair."""
    d = _Dims(problem, t)
    launch = _Launch(problem, t, (d.NPB, d.NQB, d.S * d.H),
                     active=lambda la, ip, im, sh: im * d.BQ < la.L[sh // d.H])
    w, V = launch.programs, launch.V
    ip, i, sh = w.coords
    s, h = sh // d.H, sh % d.H
    g = h // d.R
    bp = launch.rows(d.P, d.BP, ip)
    every = every_program(w)
    vi = V[s, i]
    w.load("acum", every, key((s, d.S), (h, d.H), (i, d.NQB)), d.BQ * 4)
    w.load("C", every, key((s, d.S), (i, d.NQB), (g, d.G)), vi * d.N * d.e)
    w.load("state", every, key((s, d.S), (h, d.H), (ip, d.NPB)), bp * d.N * d.es)
    prog, k = w.loop(d.NQB, lambda p, k: k <= i[p])
    sk, hk = s[prog], h[prog]
    w.load("C·B", prog, key((sk, d.S), (g[prog], d.G), (i[prog], d.NQB), (k, d.NQB)),
           cb_tile_bytes(d, i[prog], k))
    w.load("acum", prog, key((sk, d.S), (hk, d.H), (k, d.NQB)), d.BQ * 4)
    w.load("dts", prog, key((sk, d.S), (hk, d.H), (k, d.NQB)), d.BQ * 4)
    w.load("x", prog, key((sk, d.S), (k, d.NQB), (hk, d.H), (ip[prog], d.NPB)),
           V[sk, k] * bp[prog] * d.e)
    if problem.has_D:
        w.load("x", every, key((s, d.S), (i, d.NQB), (h, d.H), (ip, d.NPB)), vi * bp * d.e)
    w.alone(every, vi * bp * d.e * problem.has_z)
    w.store(every, vi * bp * d.e * (1 + problem.has_z))
    read, written = w.count()
    D = (d.H * d.P if problem.D_per_channel else d.H) * 4 if problem.has_D else 0
    rows = d.H * d.each(lambda s: s.rb)
    pairs = d.H * d.each(lambda s: s.tri)
    mma = d.NPB * (rows * 2 * d.BQ * d.Np * d.BP + pairs * 2 * d.BQ * d.BQ * d.BP)
    cuda = d.NPB * (pairs * d.BQ * d.BQ * 6 + rows * d.BQ * d.BP * (1 + 2 * problem.has_D
                                                                    + 5 * problem.has_z))
    return Cost(mma + cuda, read + D + d.table, written, mma, d.BQ)


@per_arch
def fused_fwd_cost(problem, t: Tiles, entering: bool) -> Cost:
    """The states and the output in one walk. Order: a 1-D grid over (NPB, sequences·h), the
    head-dim tile fastest; each program walks its sequence's segments (every load of its loop
    counts as the program's). Per segment it stores the entering [BP, n] state tile (the state
    dtype, and fp32 into segment_states with ``entering``), then for every row block i holding
    tokens: acum rows i, C rows i over the whole n (shared by the R heads of the group,
    NPB = 1 program apart at the production shape), the C·B tiles (i, k <= i) (shared the
    same way), acum, dts and x rows k (its own: a reload counts once), the diagonal x block for
    D (its own), z; y and y before the gate written; then the state update's x rows (its own
    again), B rows (shared by the group's heads), acum and dts, and the last acum. A program
    moves about 13 MB at the production shape (G = 3.8 on sm_90): the heads sharing C, B and
    C·B are adjacent, so every shared tile is read once, and x once in all. initial_states read
    and final_states written once. MMA: per row block [BQ, n] @ [n, BP] and [BQ, BQ] @ [BQ, BP]
    per pair, per block of the update [BP, BQ] @ [BQ, n]; CUDA: as the two kernels it
    replaces (``chunk_states_cost`` and ``chunk_scan_cost``)."""
    d = _Dims(problem, t)
    first, count = _sequences(problem, d)
    steps = max(1, int(count.max()))
    Np = fused_state_width(d.N)          # the walk's state tile, padded for the MMA
    launch = _Launch(problem, t, (d.NPB, d.seqs * d.H))
    w, V = launch.programs, launch.V
    ip, sh = w.coords
    i_s, h = sh // d.H, sh % d.H
    g = h // d.R
    walked = count[i_s]
    bp = launch.rows(d.P, d.BP, ip)

    def segment(prog, step):
        return (first[i_s[prog]] + step).clamp(max=d.S - 1)

    def rows(prog, step, k):
        return V[segment(prog, step), k]

    # per (step, row block i)
    prog, si = w.loop(steps * d.NQB, lambda p, si: (si // d.NQB < walked[p])
                      & (rows(p, si // d.NQB, si % d.NQB) > 0))
    seg, i = segment(prog, si // d.NQB), si % d.NQB
    hp, gp, ipp = h[prog], g[prog], ip[prog]
    vi = V[seg, i]
    own = key((seg, d.S), (hp, d.H), (i, d.NQB))
    w.load("acum", prog, own, d.BQ * 4)
    w.load("dts", prog, own, d.BQ * 4)
    w.load("C", prog, key((seg, d.S), (i, d.NQB), (gp, d.G)), vi * d.N * d.e)
    w.load("B", prog, key((seg, d.S), (i, d.NQB), (gp, d.G)), vi * d.N * d.e)
    w.load("x", prog, key((seg, d.S), (i, d.NQB), (hp, d.H), (ipp, d.NPB)), vi * bp[prog] * d.e)
    w.alone(prog, vi * bp[prog] * d.e * problem.has_z)
    w.store(prog, vi * bp[prog] * d.e * (1 + problem.has_z))
    # per (step, row block i, block k <= i): the C·B tiles
    prog, sik = w.loop(steps * d.NQB * d.NQB,
                       lambda p, sik: (sik // (d.NQB * d.NQB) < walked[p])
                       & (sik // d.NQB % d.NQB >= sik % d.NQB)
                       & (rows(p, sik // (d.NQB * d.NQB), sik // d.NQB % d.NQB) > 0))
    seg = segment(prog, sik // (d.NQB * d.NQB))
    i, k = sik // d.NQB % d.NQB, sik % d.NQB
    w.load("C·B", prog, key((seg, d.S), (g[prog], d.G), (i, d.NQB), (k, d.NQB)),
           cb_tile_bytes(d, i, k))
    prog, step = w.loop(steps, lambda p, step: step < walked[p])
    w.load("acum last", prog, key((segment(prog, step), d.S), (h[prog], d.H)), 4)
    every, tile = every_program(w), bp * d.N
    w.alone(every, tile * 4 * problem.has_initial_states)
    w.store(every, walked * tile * (d.es + 4 * entering) + tile * 4)
    read, written = w.count()
    D = (d.H * d.P if problem.D_per_channel else d.H) * 4 if problem.has_D else 0
    blocks = d.H * d.each(lambda s: s.rb)
    pairs = d.H * d.each(lambda s: s.tri)
    mma = d.NPB * (blocks * 2 * d.BQ * d.BP * Np * 2 + pairs * 2 * d.BQ * d.BQ * d.BP)
    cuda = (d.NPB * (blocks * d.BQ * (Np + 4) + pairs * d.BQ * d.BQ * 6
                     + blocks * d.BQ * d.BP * (1 + 2 * problem.has_D + 5 * problem.has_z))
            + 2 * d.used * d.H * d.P * d.N)
    return Cost(mma + cuda, read + D + d.table, written, mma, d.BQ)
