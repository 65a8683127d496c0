"""GQA attention: the analytic cost (``fusedops.core.cost.Cost``) of every Triton kernel, counted
from its tiles, loop structure and program order, not from the operator's math (that is the
contract's floor).

Traffic (docs/performance.md, "How traffic is counted"): programs start in launch order, the
grid's first dimension fastest (``attention.py``'s grids); programs that exit at once (the query
or key blocks past a packed sequence's length) take no slot. The tiles programs share are keyed
at the kernel's block: a KV head's k and v of one key block of bn keys, a KV head's q, do, lse
and delta rows of one query block of bm rows (its h_q/h_kv query heads'), a row's cache length,
a block-table entry. A program's load of one hits in the L2 when the previous program that
loaded it is at most G programs earlier, G = half the L2 (``Machine.l2_bytes``) over the mean
bytes a program of the launch moves (``l2_reuse.reuse_traffic``); otherwise, and the first
time, it counts. What a program loads alone (its q block, a key block's k and v in dk/dv, a
split of the cache) and every store count once. Values passed
between kernels through HBM (lse and o to the backward, delta, the decode partials and row
verdicts) count on both sides. The few offset words every packed program reads (8·(nseq + 1)
bytes, an operand that fits in L2) count once per launch. Masked-off rows and columns are not
loaded (bytes count the real head dim d), but the tensor cores run on whole tiles (MMA FLOPs
count the padded BM x BN x BD tiles, BD = d padded to a power of two).

The sequences are ``fusedops.gqa_attention.contract.sequence_lengths`` (packed offsets are runtime
data: the longest sequences the plan allows) and decode's cache lengths ``decode_context`` (the
fullest valid context). CUDA-core FLOPs are the elementwise work per score and per output element
(an exp2 counts as one FLOP, though the special-function unit runs it at a fraction of the FMA
rate).
"""

from __future__ import annotations

import functools

import torch

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.machines import machine
from fusedops.core.target import target_arch
from fusedops.gqa_attention.contract import FP8, decode_context, sequence_lengths

from ..l2_reuse import Programs, every_program, key

SCORE_FLOPS_FWD = 5     # per score: scale, running max, subtract, exp2, row sum
SCORE_FLOPS_BWD = 5     # per score: scale, subtract lse, exp2, dP - delta, times P


def _offsets(problem, arrays: int = 2) -> int:
    """The sanitised offsets a packed launch reads (``arrays`` of nseq + 1 int32): counted once."""
    return 4 * arrays * (problem.batch + 1) if problem.packed else 0


def _key_blocks(m0, m1, len_q, len_k, bn, causal, window) -> range:
    """The key blocks a program of query rows [m0, m1) visits (``key_range`` of the kernels)."""
    offset, (left, right) = len_k - len_q, window
    lo, hi, last = 0, len_k, min(m1, len_q) - 1
    if causal:
        hi = min(hi, last + offset + 1)
    if right >= 0:
        hi = min(hi, last + offset + right + 1)
    if left >= 0:
        lo = max(lo, m0 + offset - left)
    return range(lo // bn * bn, hi, bn)


def _query_blocks(n0, n1, len_q, len_k, bm, causal, window) -> range:
    """The query blocks a program of keys [n0, n1) visits (``query_range`` of the kernels)."""
    offset, (left, right) = len_k - len_q, window
    lo, hi, last = 0, len_q, min(n1, len_k) - 1
    if causal:
        lo = max(lo, n0 - offset)
    if right >= 0:
        lo = max(lo, n0 - offset - right)
    if left >= 0:
        hi = min(hi, last - offset + left + 1)
    return range(lo // bm * bm, hi, bm)


def _programs(problem, block: int, by_keys: bool):
    """(sequence, (queries, keys), head, first row) of a training grid's working programs in
    launch order: the grid (cdiv(s, block), nseq·heads) runs the block fastest, then the head
    (h_q, or h_kv ``by_keys``), then the sequence; a causal forward or dq takes its query blocks
    from the last one down (``query_block``). Blocks past a sequence's length exit at once and
    take no slot."""
    heads = problem.heads_kv if by_keys else problem.heads_q
    for i, lengths in enumerate(sequence_lengths(problem)):
        rows = range(0, lengths[1 if by_keys else 0], block)
        for h in range(heads):
            for r0 in (rows[::-1] if problem.causal and not by_keys else rows):
                yield i, lengths, h, r0


class _Grid:
    """A training grid's working programs (``_programs``) as ``programs`` counted in the L2 of
    ``arch``: per program its sequence, lengths (lq, lk), head and own rows (tensors), and the
    blocks of ``other`` rows of the other side it visits (``_key_blocks``, or ``_query_blocks``
    ``by_keys``): ``prog``, ``block``, one entry per visit."""

    def __init__(self, problem, block: int, other: int, by_keys: bool, arch: str):
        visits = _query_blocks if by_keys else _key_blocks
        rows = []
        for i, (lq, lk), h, r0 in _programs(problem, block, by_keys):
            n = lk if by_keys else lq
            blocks = visits(r0, r0 + block, lq, lk, other, problem.causal, problem.window)
            rows.append((i, lq, lk, h, min(block, n - r0), blocks.start // other, len(blocks)))
        self.seq, self.lq, self.lk, self.head, self.rows, first, self.visits = \
            torch.tensor(rows, dtype=torch.int64).reshape(-1, 7).T
        self.sequences = len(sequence_lengths(problem))
        self.programs = Programs((len(rows),), machine(arch).l2_bytes)
        self.other = other
        self.prog, self.block = self.programs.ranges(first, self.visits)

    def visited(self, length: torch.Tensor) -> torch.Tensor:
        """Rows of each visited block, the last one of a sequence of ``length`` masked."""
        return (length[self.prog] - self.block * self.other).clamp(max=self.other)

    def tile(self, head: torch.Tensor, heads: int, length: int) -> torch.Tensor:
        """The key of each visited block: (sequence, ``head`` of its program, block), blocks of
        sequences up to ``length`` rows."""
        blocks = -(-length // self.other)
        return key((self.seq[self.prog], self.sequences), (head[self.prog], heads),
                   (self.block, blocks))


def _engine(arch: str, m: int, warps: int) -> str:
    """The tensor-core instruction Triton uses for a product of ``m`` rows: wgmma on sm_90 and
    tcgen05 on sm_100 from 64 rows up, else mma.sync (m16n8k16)."""
    if m >= 64 and arch == "sm_90" and warps % 4 == 0:
        return "wgmma"
    if m >= 64 and arch == "sm_100":
        return "tcgen05"
    return "mma.sync"


def duplication(arch: str, warps: int, products, decider: int) -> list[int]:
    """How many times each product's work is done per CTA (1: no duplication), from how Triton
    lays the products of one kernel out over the warps. ``products``: (rows, columns, score) of
    each product (score: its result is the score tile the softmax works on and feeds the next
    product's register operand); ``decider``: the index of the accumulating product, whose shape
    sets the warp layout of the chained mma.sync products.

    * mma.sync chained to an mma.sync accumulator: every product gets the decider's layout, all
      warps along the rows when it has at least as many rows as columns ([W, 1], 16 rows per
      warp), else along the columns ([1, W], 8 per warp); a product with fewer rows (columns)
      than that is computed by several warps at once: 16·W/rows (8·W/columns) times.
    * mma.sync chained to a wgmma/tcgen05 accumulator: split in both directions, duplicated only
      when the tile is smaller than W m16n8 tiles.
    * wgmma (sm_90): a score product with fewer rows than 64 per warpgroup is computed whole by
      every warpgroup (each needs all of P's rows for its P·V), 64·(W/4)/rows times; the
      accumulating products split their columns over the warpgroups.
    * tcgen05 (sm_100): one thread issues each MMA once for the CTA: no duplication.

    Checked against the compiled kernels (``fusedops kernels --dump``: the MMA FLOPs in the PTX
    of each kernel's inner loop against the tile's): a forward at 64 rows on 8 warps does 1.5x
    on sm_90 and on sm_80 (the d = 256 entry there); d = 256 backward tiles of 16 x 32 on 8
    warps 1.5x (dk/dv) and 5/3 (dq) on every arch; every other entry of the tile tables 1x."""
    dm, dn, _ = products[decider]
    decider_engine = _engine(arch, dm, warps)
    out = []
    for m, n, score in products:
        engine = _engine(arch, m, warps)
        if engine == "tcgen05":
            out.append(1)
        elif engine == "wgmma":
            out.append(max(1, 64 * (warps // 4) // m) if score else 1)
        elif decider_engine != "mma.sync":
            out.append(max(1, 16 * 8 * warps // (m * n)))
        elif dm >= dn:
            out.append(max(1, 16 * warps // m))
        else:
            out.append(max(1, 8 * warps // n))
    return out


@functools.lru_cache(maxsize=128)
def forward_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_fwd_kernel, one program per (query block of bm rows, batch, query head).

    Order: the grid (cdiv(s_q, bm), b·h_q) runs the query block fastest: every query block of
    one query head (causal: the last first, ``query_block``), then the next; the h_q/h_kv heads
    of a KV head are consecutive.

    Reuse: k and v of a key block are shared by every program on the same KV head and sequence
    that visits it (``key_range``; causal: the blocks up to the diagonal). Within a head the
    next query block re-reads them 1 program later: a hit. Causal, key block j (of the
    diagonal of query block j) is last read by a head's query block j and first read again by
    the next head's first program, j + 1 programs later: a hit while j + 1 <= G, so a causal KV
    head's late key blocks count again for each of its heads (not causal: every query block
    visits every key block, and all hit). At
    s = 4096, d = 128, causal on sm_90 (bm = 128: 32 query blocks; a program moves 1.1 MB,
    G = 22) the diagonal key blocks of the last 11 query blocks count again: K and V 2.0x once
    per KV head; d = 256 (bm = 128: 32 query blocks; 2.3 MB a program, G = 11) 3.1x. Alone: the
    program's q rows (rows·d·e); stored: o and fp32 lse (rows·(d·e + 4)). Packed: the offsets
    once.

    FLOPs per visited tile: S = q kᵀ and P·V, 2·bm·bn·BD each on tensor cores, and 5 FLOPs per
    score plus the accumulator rescale (bm·BD), each times its ``duplication`` (the score work
    with S's: at 64 rows on 8 warps on sm_90 both warpgroups compute S and its softmax, 1.5x
    the tensor-core work, 2x the exponentials)."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    qk_dup, pv_dup = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bd, False)], 1)
    grid = _Grid(p, bm, bn, False, arch)
    w, every = grid.programs, every_program(grid.programs)
    w.load("k, v", grid.prog, grid.tile(grid.head // g, p.heads_kv, p.seqlen_k),
           2 * d * e * grid.visited(grid.lk))
    w.alone(every, grid.rows * d * e)
    w.store(every, grid.rows * (d * e + 4))
    read, written = w.count()
    read += _offsets(p)
    visits, programs = int(grid.visits.sum()), w.programs
    mma = visits * 2 * bm * bn * bd * (qk_dup + pv_dup)
    cuda = visits * (SCORE_FLOPS_FWD * bm * bn * qk_dup + bm * bd) + programs * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm,
                mma_duplication=(qk_dup + pv_dup) / 2)


def sanitise_cost(problem) -> Cost:
    """attn_sanitise_kernel, one program: cu_seqlens_q/k read, the sanitised offsets written
    (nseq + 1 int32 each)."""
    n = 2 * 4 * (problem.batch + 1)
    return Cost(4 * n, n, n)


def delta_cost(problem, rows: int) -> Cost:
    """attn_bwd_delta_kernel, one program per (``rows`` query rows, batch, query head), in any
    order: no two programs load the same tile, so the L2 changes nothing. Each reads its
    o and do rows alone (o passed from the forward: counted) and writes delta = rowsum(o·do) in
    fp32 (passed to dk/dv and dq: counted; 2·d FLOPs per row and head). Packed: the q offsets
    once."""
    p, e = problem, element_size(problem.dtype)
    tokens = sum(lq for lq, _ in sequence_lengths(p)) * p.heads_q
    read = 2 * tokens * p.head_dim * e + _offsets(p, arrays=1)
    return Cost(2 * tokens * p.head_dim, read, 4 * tokens)


@functools.lru_cache(maxsize=128)
def dkdv_cost(problem, tiles, bd: int, arch: str, features_m: bool = False) -> Cost:
    """attn_bwd_dkdv_kernel, one program per (key block of bn keys, batch, KV head).

    Order: the grid (cdiv(s_k, bn), b·h_kv) runs the key block fastest: every key block of one
    KV head, then the next.

    Reuse: each program loops over the query blocks ``query_range`` lets see its keys (causal:
    those from the diagonal down), from the last one down, and over the h_q/h_kv query heads of
    its KV head within each, loading q, do (bm x d), lse and delta (lse from the forward, delta
    from the delta kernel: passed through HBM, each counted at least once): (h_q/h_kv)·(2·d·e +
    8) bytes a query row. The next key block of the KV head re-reads them 1 program later: a
    hit when a program moves less than the usable L2 (G >= 1), so every query row counts once
    per KV head (at s = 4096, d = 128, causal on sm_90: 128 keys a program, 4.5 MB, G = 5.5). At
    h_kv = 2 (16 query heads, not causal) a program loads all 4096 rows of its 16 heads' q, do,
    lse and delta: 34 MB, G = 0.7 on sm_90, so every program's loads count (1.8 on sm_100:
    once). Alone: the block's k and v (2·keys·d·e); stored: dk, dv. Packed: the offsets once.

    FLOPs per visited tile: four products on tensor cores, 2·bm·bn·BD each, every one with the
    key block's bn rows as M (transposed): Sᵀ = k qᵀ (recomputed) and dPᵀ = v doᵀ, [bn, bm];
    dv += Pᵀ do and dk += dSᵀ q, [bn, BD], Pᵀ and dSᵀ the register A operand; 5 FLOPs per
    score; each times its ``duplication`` (the score work with Sᵀ's: at bn = 64 on 8 warps both
    Hopper warpgroups would compute the whole Sᵀ, which is why sm_90 takes 128 keys on 8 warps
    or 64 on 4). ``features_m`` (d = 256): S = q kᵀ and dP = do vᵀ, [bm, bn], with the query
    block as M, then dvᵀ += doᵀ P and dkᵀ += qᵀ dS, [BD, bn], with the head dim as M."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    if features_m:
        products = [(bm, bn, True), (bm, bn, True), (bd, bn, False), (bd, bn, False)]
    else:
        products = [(bn, bm, True), (bn, bm, True), (bn, bd, False), (bn, bd, False)]
    dups = duplication(arch, tiles.warps, products, 3)
    grid = _Grid(p, bn, bm, True, arch)
    w, every = grid.programs, every_program(grid.programs)
    w.load("q, do, lse, delta", grid.prog, grid.tile(grid.head, p.heads_kv, p.seqlen_q),
           g * (2 * d * e + 8) * grid.visited(grid.lq))
    w.alone(every, 2 * grid.rows * d * e)
    w.store(every, 2 * grid.rows * d * e)
    read, written = w.count()
    read += _offsets(p)
    visits, programs = g * int(grid.visits.sum()), w.programs
    mma = visits * 2 * bm * bn * bd * sum(dups)
    cuda = visits * SCORE_FLOPS_BWD * bm * bn * dups[0] + programs * bn * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm if features_m else bn,
                mma_duplication=sum(dups) / len(dups))


@functools.lru_cache(maxsize=128)
def dq_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_bwd_dq_kernel, one program per (query block of bm rows, batch, query head).

    Order: the grid (cdiv(s_q, bm), b·h_q) runs the query block fastest, as the forward's
    (causal: the last first).

    Reuse: k and v of each key block ``key_range`` lets a program see are shared by the
    programs on the same KV head and sequence, counted as the forward's (``forward_cost``): the
    next query head re-reads key block j j + 1 programs after the previous head last read it, a
    miss when j + 1 > G (at s = 4096, d = 128, causal on
    sm_90: 64 query blocks of 64 rows, 1.1 MB a program, G = 22: K and V 3.0x once per KV
    head). Alone: the block's q, do, lse and delta (rows·(2·d·e + 8); lse and delta passed
    through HBM: counted); stored: dq. Packed: the offsets once.

    FLOPs per visited tile: three products on tensor cores, 2·bm·bn·BD each: S = q kᵀ and dP =
    do vᵀ (both recomputed: the dk/dv kernel computed them too, so a deterministic backward
    runs 7 products where the atomic one runs 5) and dq += dS k; 5 FLOPs per score; each times
    its ``duplication``."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bn, True), (bm, bd, False)], 2)
    grid = _Grid(p, bm, bn, False, arch)
    w, every = grid.programs, every_program(grid.programs)
    w.load("k, v", grid.prog, grid.tile(grid.head // g, p.heads_kv, p.seqlen_k),
           2 * d * e * grid.visited(grid.lk))
    w.alone(every, grid.rows * (2 * d * e + 8))
    w.store(every, grid.rows * d * e)
    read, written = w.count()
    read += _offsets(p)
    visits, programs = int(grid.visits.sum()), w.programs
    mma = visits * 2 * bm * bn * bd * sum(dups)
    cuda = visits * SCORE_FLOPS_BWD * bm * bn * dups[0] + programs * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm,
                mma_duplication=sum(dups) / len(dups))


# -- decode ------------------------------------------------------------------------------------
def _scales(problem, w: Programs, first_head, heads) -> None:
    """The FP8 scales programs load, shared by every program: k_scale and v_scale (4 bytes
    each) of heads first_head .. first_head + heads - 1 (per head, tensors over the programs)
    or the two per-tensor ones."""
    if problem.cache_dtype != FP8:
        return
    if problem.scale_per_head:
        prog, head = w.ranges(first_head, heads)
        w.load("scales", prog, head, 8)
    else:
        every = every_program(w)
        w.load("scales", every, torch.zeros_like(every), 8)


def append_cost(problem, block: int) -> Cost:
    """decode_append_kernel, one program per (row, new token, chunk of ``block`` of the
    h_kv·d values).

    Order: the grid (b, T, cdiv(h_kv·d, block)) runs the row fastest.

    Reuse: every program checks its row before writing: the row's cache length and (paged) the
    block-table entries it needs (cdiv(L + T, page) at context L = decode_context), shared by
    the row's T·chunks programs, b programs apart; the scales of the chunk's heads (FP8),
    shared by all. A program moves a few KiB (G in the thousands, more than the b·T = 64 or 256
    programs of the production steps): each counts once. Alone: the chunk of k_new and v_new;
    stored: the chunk in both caches (FP8: divided, clamped and rounded, 3 FLOPs per value) and
    the row's verdict (4 bytes, by its first program; passed to the split kernel)."""
    p, e, ce = problem, element_size(problem.dtype), element_size(problem.cache_dtype)
    arch = target_arch(p.device)
    L, row, d = decode_context(p), p.heads_kv * p.head_dim, p.head_dim
    table = min(p.max_pages, -(-(L + p.tokens) // p.page_size)) if p.paged else 0
    w = Programs((p.batch, p.tokens, -(-row // block)), machine(arch).l2_bytes)
    b, t, c = w.coords
    every = every_program(w)
    values = (row - c * block).clamp(max=block)
    w.load("length", every, b, 4)
    w.load("table", every, b, 4 * table)
    _scales(p, w, c * block // d, -(-(c * block + values) // d) - c * block // d)
    w.alone(every, 2 * values * e)
    w.store(every, 2 * values * ce + 4 * ((t == 0) & (c == 0)))
    read, written = w.count()
    flops = 2 * 3 * p.batch * p.tokens * row if p.cache_dtype == FP8 else 0
    return Cost(flops, read, written)


@functools.lru_cache(maxsize=64)
def split_cost(problem, tiles, bm: int, bd: int, split_len: int, arch: str) -> Cost:
    """decode_split_kernel, one program per (row, KV head, split of ``split_len`` positions).

    Order: the grid (b·h_kv, splits) runs the (row, KV head) fastest: one split of every (row,
    KV head), then the next split (b·h_kv = 512 at the production shapes).

    Reuse: each program loads its row's cache length and verdict (from the append kernel),
    shared by the row's h_kv programs, 1 apart: once per (row, split); the T·h_q/h_kv query rows
    of its KV head, shared with the same (row, KV head)'s other splits only, b·h_kv programs
    apart; the scales (FP8), shared by all; (paged) the block-table entries of its split's pages
    (a program re-reads one per bn positions of a page: once), shared by the row's KV heads, 1
    apart. A program streams its split of the cache (256 KiB at T = 1, bf16, 512 positions):
    G = 92 on sm_90 (232 on sm_100) < 512, so q counts once per split, the rest once. Alone: k
    and v of every cached position of its split up to L + T (at context L = decode_context: the
    whole capacity, the new tokens included); stored: the partial output whole, bm x BD fp32
    (rows T·h_q/h_kv padded to bm), and bm lse values, every split (empty ones included), read
    back by the combine kernel.

    FLOPs per step of bn positions: Sᵀ = k qᵀ and oᵀ += vᵀ Pᵀ on tensor cores (the positions
    and the features as M), 2·bm·bn·BD each on the padded rows; 5 FLOPs per score; each times
    its ``duplication``."""
    p, e, ce = problem, element_size(problem.dtype), element_size(problem.cache_dtype)
    bn, d, g = tiles.bn, problem.head_dim, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bn, bm, True), (bd, bm, False)], 1)
    total = min(decode_context(p) + p.tokens, p.capacity)
    heads = p.batch * p.heads_kv
    w = Programs((heads, p.num_splits), machine(arch).l2_bytes)
    bk, split = w.coords
    b, kh = bk // p.heads_kv, bk % p.heads_kv
    every = every_program(w)
    keys = (total - split * split_len).clamp(0, split_len)
    w.load("length, verdict", every, b, 8)
    w.load("q", every, bk, p.tokens * g * d * e)
    _scales(p, w, kh, 1)
    if p.paged:
        first = split * split_len // p.page_size
        pages = torch.where(keys > 0, (split * split_len + keys - 1) // p.page_size + 1 - first, 0)
        prog, page = w.ranges(first, pages)
        w.load("table", prog, key((b[prog], p.batch), (page, p.max_pages)), 4)
    w.alone(every, 2 * keys * d * ce)
    w.store(every, bm * bd * 4 + bm * 4)
    read, written = w.count()
    steps = int((-(-keys // bn)).sum())
    mma = steps * 2 * bm * bn * bd * sum(dups)
    cuda = steps * (SCORE_FLOPS_FWD * bm * bn * dups[0] + bm * bd) + heads * p.num_splits * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bn,
                mma_duplication=sum(dups) / len(dups))


def combine_cost(problem, bm: int, bd: int) -> Cost:
    """decode_combine_kernel, one program per (row, KV head), in any order: no two programs
    load the same tile, so the L2 changes nothing. Each reads its splits' bm x BD fp32 partial
    outputs and bm lse values (passed from the split kernel: counted) alone; it reads the lse
    twice (the maximum, then the weights), the second time its own tile again (counted once:
    a few KiB it loaded itself just before); o (the T·h_q/h_kv real rows) and lse written.
    2 FLOPs per partial value."""
    p, e = problem, element_size(problem.dtype)
    heads, rows = p.batch * p.heads_kv, p.tokens * (p.heads_q // p.heads_kv)
    read = heads * p.num_splits * (bm * 4 + bm * bd * 4)
    written = heads * rows * (p.head_dim * e + 4)
    return Cost(heads * p.num_splits * 2 * bm * bd, read, written)
