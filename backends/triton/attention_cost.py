"""GQA attention: the analytic cost (``fusedops.core.cost.Cost``) of every Triton kernel, counted
from its tiles and loop structure, not from the operator's math (that is the contract's floor).

Conventions (docs/performance.md, "How traffic is counted"): each program's loads count, and a
tile several programs load counts once per program (no L2 hits assumed); masked-off rows and
columns are not loaded (bytes count the real head dim d), but the tensor cores run on whole tiles
(MMA FLOPs count the padded BM x BN x BD tiles, BD = d padded to a power of two). The sequences
are ``fusedops.attention.contract.sequence_lengths`` (packed offsets are runtime data: the
longest sequences the plan allows) and decode's cache lengths ``decode_context`` (the fullest
valid context). CUDA-core FLOPs are the elementwise work per score and per output element (an
exp2 counts as one FLOP, though the special-function unit runs it at a fraction of the FMA rate).
"""

from __future__ import annotations

import collections

from fusedops.attention.contract import FP8, decode_context, sequence_lengths
from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size

SCORE_FLOPS_FWD = 5     # per score: scale, running max, subtract, exp2, row sum
SCORE_FLOPS_BWD = 5     # per score: scale, subtract lse, exp2, dP - delta, times P
OFFSET_BYTES = 16       # a packed program reads c'[i], c'[i + 1] of the q and k offsets


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


def _sequences(problem):
    """(queries, keys) -> how many sequences have them."""
    return collections.Counter(sequence_lengths(problem)).items()


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
    of each kernel's inner loop against the tile's) for every entry of the tile tables: the
    forward at 64 rows on 8 warps does 1.5x on sm_90 (d = 128, 256) and on sm_80 (d = 256); the
    d = 256 backward's 16 x 32 tiles 1.5x (dk/dv) and 5/3 (dq) on every arch; the rest 1x."""
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


def forward_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_fwd_kernel, one program per (query block of bm rows, batch, query head): q's rows
    once, then every key block ``key_range`` lets it see (causal: the blocks up to the diagonal),
    k and v of each (the G = h_q/h_kv query heads of a KV head, and every query block, re-read
    them); o and fp32 lse written once. Per visited tile: S = q kᵀ and P·V, 2·bm·bn·BD FLOPs
    each on tensor cores, and 5 FLOPs per score plus the accumulator rescale (bm·BD), each times
    its ``duplication`` (the score work with S's: at 64 rows on 8 warps on sm_90 both
    warpgroups compute S and its softmax, 1.5x the tensor-core work, 2x the exponentials)."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn = tiles.bm, tiles.bn
    qk_dup, pv_dup = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bd, False)], 1)
    read = written = visits = programs = 0
    for (lq, lk), count in _sequences(p):
        for m0 in range(0, lq, bm):
            rows = min(bm, lq - m0)
            blocks = _key_blocks(m0, m0 + bm, lq, lk, bn, p.causal, p.window)
            keys = sum(min(bn, lk - n0) for n0 in blocks)
            n = count * p.heads_q
            read += n * (rows + 2 * keys) * d * e
            written += n * rows * (d * e + 4)
            visits += n * len(blocks)
            programs += n
    if p.packed:
        read += OFFSET_BYTES * p.batch * p.heads_q * -(-p.seqlen_q // bm)
    mma = visits * 2 * bm * bn * bd * (qk_dup + pv_dup)
    cuda = visits * (SCORE_FLOPS_FWD * bm * bn * qk_dup + bm * bd) + programs * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm)


def sanitise_cost(problem) -> Cost:
    """attn_sanitise_kernel, one program: cu_seqlens_q/k read, the sanitised offsets written
    (nseq + 1 int32 each)."""
    n = 2 * 4 * (problem.batch + 1)
    return Cost(4 * n, n, n)


def delta_cost(problem, rows: int) -> Cost:
    """attn_bwd_delta_kernel, one program per (``rows`` query rows, batch, query head): o and do
    read, delta = rowsum(o·do) written in fp32 (2·d FLOPs per row and head)."""
    p, e = problem, element_size(problem.dtype)
    tokens = sum(lq for lq, _ in sequence_lengths(p)) * p.heads_q
    read = 2 * tokens * p.head_dim * e
    if p.packed:
        read += 8 * p.batch * p.heads_q * -(-p.seqlen_q // rows)
    return Cost(2 * tokens * p.head_dim, read, 4 * tokens)


def dkdv_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_bwd_dkdv_kernel, one program per (key block of bn keys, batch, KV head): k and v of
    the block read once; for each of the G query heads every query block ``query_range`` lets
    see the block (causal: those from the diagonal down), q, do (bm x d), lse and delta; dk, dv
    written once. Per visited tile, four products on tensor cores, 2·bm·bn·BD FLOPs each: S =
    q kᵀ (recomputed), dv += Pᵀ do, dP = do vᵀ, dk += dSᵀ q; 5 FLOPs per score; each times its
    ``duplication`` (the score work with S's)."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bn, True), (bn, bd, False),
                                           (bn, bd, False)], 3)
    read = written = visits = programs = 0
    for (lq, lk), count in _sequences(p):
        for n0 in range(0, lk, bn):
            keys = min(bn, lk - n0)
            blocks = _query_blocks(n0, n0 + bn, lq, lk, bm, p.causal, p.window)
            rows = sum(min(bm, lq - m0) for m0 in blocks)
            n = count * p.heads_kv
            read += n * (2 * keys * d * e + g * rows * (2 * d * e + 8))
            written += n * 2 * keys * d * e
            visits += n * g * len(blocks)
            programs += n
    if p.packed:
        read += OFFSET_BYTES * p.batch * p.heads_kv * -(-p.seqlen_k // bn)
    mma = visits * 2 * bm * bn * bd * sum(dups)
    cuda = visits * SCORE_FLOPS_BWD * bm * bn * dups[0] + programs * bn * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bn)


def dq_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_bwd_dq_kernel, one program per (query block of bm rows, batch, query head): q, do,
    lse and delta of the block once, then k and v of every key block ``key_range`` lets it see
    (re-read by every query block and query head of the KV head); dq written once. Per visited
    tile, three products on tensor cores, 2·bm·bn·BD FLOPs each: S = q kᵀ and dP = do vᵀ (both
    recomputed: the dk/dv kernel computed them too, so a deterministic backward runs 7 products
    where the atomic one runs 5) and dq += dS k; 5 FLOPs per score; each times its
    ``duplication``."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn = tiles.bm, tiles.bn
    dups = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bn, True), (bm, bd, False)], 2)
    read = written = visits = programs = 0
    for (lq, lk), count in _sequences(p):
        for m0 in range(0, lq, bm):
            rows = min(bm, lq - m0)
            blocks = _key_blocks(m0, m0 + bm, lq, lk, bn, p.causal, p.window)
            keys = sum(min(bn, lk - n0) for n0 in blocks)
            n = count * p.heads_q
            read += n * (rows * (2 * d * e + 8) + 2 * keys * d * e)
            written += n * rows * d * e
            visits += n * len(blocks)
            programs += n
    if p.packed:
        read += OFFSET_BYTES * p.batch * p.heads_q * -(-p.seqlen_q // bm)
    mma = visits * 2 * bm * bn * bd * sum(dups)
    cuda = visits * SCORE_FLOPS_BWD * bm * bn * dups[0] + programs * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm)


# -- decode ------------------------------------------------------------------------------------
def _scale_bytes(problem) -> int:
    if problem.cache_dtype != FP8:
        return 0
    return 2 * 4 * (problem.heads_kv if problem.scale_per_head else 1)


def append_cost(problem, block: int) -> Cost:
    """decode_append_kernel, one program per (row, new token, chunk of ``block`` of the
    h_kv·d values): the row's cache length and (paged) the block-table entries the row needs
    (every program checks the row: cdiv(L + T, page) entries at context L = decode_context), the
    chunk of k_new and v_new and the scales read; the chunk written to both caches (FP8:
    divided, clamped and rounded, 3 FLOPs per value) and the row's verdict (4 bytes)."""
    p, e, ce = problem, element_size(problem.dtype), element_size(problem.cache_dtype)
    L, row = decode_context(p), p.heads_kv * p.head_dim
    programs = p.batch * p.tokens * -(-row // block)
    table = 4 * min(p.max_pages, -(-(L + p.tokens) // p.page_size)) if p.paged else 0
    values = p.batch * p.tokens * row
    read = 2 * values * e + programs * (4 + table + _scale_bytes(p))
    flops = 2 * 3 * values if p.cache_dtype == FP8 else 0
    return Cost(flops, read, 2 * values * ce + 4 * p.batch)


def split_cost(problem, tiles, bm: int, bd: int, split_len: int, arch: str) -> Cost:
    """decode_split_kernel, one program per (row, KV head, split of ``split_len`` positions): the
    row's length and verdict, the T·G query rows of the KV head and the scales read, then k and v
    of every cached position of its split up to L + T (at context L = decode_context: the whole
    capacity, the new tokens included; paged: one block-table entry per bn positions); the
    partial output written whole, bm x BD fp32 (rows T·G padded to bm), and bm lse values (every
    split, empty ones included). Per step of bn positions, q kᵀ and P v on tensor cores,
    2·bm·bn·BD FLOPs each on the padded rows; 5 FLOPs per score; each times its
    ``duplication``."""
    p, e, ce = problem, element_size(problem.dtype), element_size(problem.cache_dtype)
    bn, d, g = tiles.bn, problem.head_dim, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bd, False)], 1)
    total = min(decode_context(p) + p.tokens, p.capacity)
    heads = p.batch * p.heads_kv
    read = written = steps = 0
    for split in range(p.num_splits):
        start = split * split_len
        end = min(start + split_len, total)
        keys = max(0, end - start)
        blocks = len(range(start, end, bn))
        read += heads * (8 + p.tokens * g * d * e + _scale_bytes(p) + 2 * keys * d * ce
                         + (4 * blocks if p.paged else 0))
        written += heads * (bm * bd * 4 + bm * 4)
        steps += heads * blocks
    mma = steps * 2 * bm * bn * bd * sum(dups)
    cuda = steps * (SCORE_FLOPS_FWD * bm * bn * dups[0] + bm * bd) + heads * p.num_splits * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm)


def combine_cost(problem, bm: int, bd: int) -> Cost:
    """decode_combine_kernel, one program per (row, KV head): the splits' lse read twice (the
    maximum, then the weights) and their bm x BD fp32 partial outputs once; o (the T·G real
    rows) and lse written. 2 FLOPs per partial value."""
    p, e = problem, element_size(problem.dtype)
    heads, rows = p.batch * p.heads_kv, p.tokens * (p.heads_q // p.heads_kv)
    read = heads * p.num_splits * (2 * bm * 4 + bm * bd * 4)
    written = heads * rows * (p.head_dim * e + 4)
    return Cost(heads * p.num_splits * 2 * bm * bd, read, written)
