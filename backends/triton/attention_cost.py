"""GQA attention: the analytic cost (``fusedops.core.cost.Cost``) of every Triton kernel, counted
from its tiles, loop structure and program order, not from the operator's math (that is the
contract's floor).

Traffic (docs/performance.md, "How traffic is counted"): programs start in launch order, the
grid's first dimension fastest (``attention.py``'s grids), a wave of ``Machine.sms`` × CTAs per
SM at a time (``ctas_per_sm``: the occupancy ``fusedops kernels`` reports for the tile table's
entries). Programs that exit at once (the query or key blocks past a packed sequence's length)
take no slot. Within a wave, a tile several programs load (a KV head's K and V blocks, a query
head's q, do, lse and delta rows, a row's cache length) counts once, if the wave's working set
fits in the L2 (``Machine.l2_bytes``: the distinct tiles its programs share, plus what each
loads alone and what each stores); a wave that does not fit counts every program's loads. A
tile loaded again in a later wave counts again. What a program loads alone (its q block, a key
block's k and v in dk/dv, a split of the cache) and every store count once. Values passed
between kernels through HBM (lse and o to the backward, delta, the decode partials and row
verdicts) count on both sides. The few offset words every packed program reads (8·(nseq + 1)
bytes, an operand that fits in L2) count once per launch. Masked-off rows and columns are not
loaded (bytes count the real head dim d), but the tensor cores run on whole tiles (MMA FLOPs
count the padded BM x BN x BD tiles, BD = d padded to a power of two).

The sequences are ``fusedops.attention.contract.sequence_lengths`` (packed offsets are runtime
data: the longest sequences the plan allows) and decode's cache lengths ``decode_context`` (the
fullest valid context). CUDA-core FLOPs are the elementwise work per score and per output element
(an exp2 counts as one FLOP, though the special-function unit runs it at a fraction of the FMA
rate).
"""

from __future__ import annotations

import functools

from fusedops.attention.contract import FP8, decode_context, sequence_lengths
from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.target import target_arch

from . import attention_tiles as TILES
from .wave_model import machine

SCORE_FLOPS_FWD = 5     # per score: scale, running max, subtract, exp2, row sum
SCORE_FLOPS_BWD = 5     # per score: scale, subtract lse, exp2, dP - delta, times P

# CTAs per SM of each kernel at its tile-table entry (arch -> head-dim class -> CTAs), as
# ``fusedops kernels --backend triton --only attn`` / ``--only decode`` reports them (triton 3.9,
# 2026-12-01, the backward's 2026-12-02; registers decide all but decode split's and the d = 256
# dq's sm_80 entries, shared memory); the packed
# variants where their registers differ (the packed dq on sm_80: 140 registers, one CTA; the
# packed forward at d = 128 on sm_100: 162 registers, one CTA; FP8_SPLIT_CTAS_PER_SM). The
# delta and
# combine kernels share no tile between programs: their waves change nothing.
CTAS_PER_SM = {
    "attn_fwd_kernel": {"sm_90": {64: 3, 128: 1, 256: 1}, "sm_100": {64: 3, 128: 2, 256: 1},
                        "sm_80": {64: 3, 128: 1, 256: 1}},
    "attn_bwd_dkdv_kernel": {"sm_90": {64: 3, 128: 1, 256: 2}, "sm_100": {64: 4, 128: 1, 256: 2},
                             "sm_80": {64: 4, 128: 1, 256: 2}},
    "attn_bwd_dq_kernel": {"sm_90": {64: 3, 128: 2, 256: 1}, "sm_100": {64: 3, 128: 2, 256: 1},
                           "sm_80": {64: 3, 128: 2, 256: 2}},
    "decode_append_kernel": {"sm_90": 16, "sm_100": 16, "sm_80": 16},
    "decode_split_kernel": {"sm_90": 3, "sm_100": 3, "sm_80": 4},
}
PACKED_CTAS_PER_SM = {("attn_bwd_dq_kernel", 128, "sm_80"): 1, ("attn_fwd_kernel", 128, "sm_100"): 1}


def _arch(arch: str) -> str:
    return arch.removesuffix("a")


def _training_ctas(kernel: str, problem, tiles, arch: str) -> int:
    """CTAs per SM of a training kernel: the reported occupancy when ``tiles`` are the table
    entry's (bm, bn, warps); a configuration outside the table (an autotune candidate, a
    ``config=``) is counted at one CTA per SM (the smallest wave: the most re-reads)."""
    arch = _arch(arch)
    head = TILES.head_class(problem.head_dim)
    table = TILES.FORWARD if kernel == "attn_fwd_kernel" else TILES.BACKWARD
    entry = table.get(arch, {}).get(head, (None,))[0]
    if kernel != "attn_fwd_kernel" and entry is not None:
        entry = entry.dkdv if kernel == "attn_bwd_dkdv_kernel" else entry.dq
    if entry is None or (entry.bm, entry.bn, entry.warps) != (tiles.bm, tiles.bn, tiles.warps):
        return 1
    if problem.packed and (kernel, head, arch) in PACKED_CTAS_PER_SM:
        return PACKED_CTAS_PER_SM[(kernel, head, arch)]
    return CTAS_PER_SM[kernel].get(arch, {}).get(head, 1)


# the paged FP8 split on sm_100: 179 registers, two CTAs
FP8_SPLIT_CTAS_PER_SM = {"sm_100": 2}


def _decode_ctas(kernel: str, arch: str, tiles=None, fp8: bool = False) -> int:
    """CTAs per SM of a decode kernel (split: at the table entry's warps and stages, else 1;
    ``fp8``: an FP8 cache)."""
    arch = _arch(arch)
    if fp8 and kernel == "decode_split_kernel" and arch in FP8_SPLIT_CTAS_PER_SM and \
            tiles is not None and _decode_ctas(kernel, arch, tiles) > 1:
        return FP8_SPLIT_CTAS_PER_SM[arch]
    if tiles is not None:
        entry = TILES.DECODE.get(arch, (None,))[0]
        if entry is None or (entry.warps, entry.stages, entry.maxnreg) != \
                (tiles.warps, tiles.stages, tiles.maxnreg):
            return 1
    return CTAS_PER_SM[kernel].get(arch, 1)


def table_ctas(kernel: str, problem, arch: str) -> int | None:
    """The CTAs per SM the model cuts ``kernel``'s waves at for ``problem`` with the tile table's
    entry for the target architecture ``arch`` (call under ``compiling_for(arch)``); None for a
    kernel whose waves the model does not need."""
    if kernel not in CTAS_PER_SM:
        return None
    a = _arch(arch)
    if kernel.startswith("decode"):
        split = kernel == "decode_split_kernel"
        return _decode_ctas(kernel, a, TILES.decode_tiles(problem) if split else None,
                            split and problem.cache_dtype == FP8)
    if kernel == "attn_fwd_kernel":
        return _training_ctas(kernel, problem, TILES.forward_tiles(problem), a)
    tiles = TILES.backward_tiles(problem)
    return _training_ctas(kernel, problem, tiles.dkdv if "dkdv" in kernel else tiles.dq, a)


def _union(spans: list[tuple[int, int]]) -> int:
    """Length of the union of half-open intervals."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


class Waves:
    """A launch's working programs, fed in launch order, cut into waves of ``size``; each
    program gives the tiles it shares with others (``(operand, bytes per unit, start, end)``:
    the units [start, end) of the operand, e.g. the keys of one KV head of one sequence), the
    bytes it loads alone and the bytes it stores. Per wave: the distinct shared bytes if the
    working set (distinct + alone + stored) fits in ``l2``, else every program's shared loads;
    plus the loads alone. ``waves``, ``fitting``: how many waves, how many of them fit."""

    def __init__(self, size: int, l2: int):
        self.size, self.l2 = max(1, size), l2
        self.read = self.written = 0.0
        self.waves = self.fitting = 0
        self._start()

    def _start(self):
        self._spans: dict = {}
        self._every = self._alone = self._stored = 0.0
        self._count = 0

    def program(self, shared=(), alone: float = 0, stored: float = 0):
        for operand, unit, start, end in shared:
            if end > start:
                self._spans.setdefault((operand, unit), []).append((start, end))
                self._every += unit * (end - start)
        self._alone += alone
        self._stored += stored
        self._count += 1
        if self._count == self.size:
            self._flush()

    def _flush(self):
        distinct = sum(unit * _union(spans) for (_, unit), spans in self._spans.items())
        fits = distinct + self._alone + self._stored <= self.l2
        self.read += (distinct if fits else self._every) + self._alone
        self.written += self._stored
        self.waves += 1
        self.fitting += fits
        self._start()

    def close(self) -> Waves:
        if self._count:
            self._flush()
        return self


def _waves(kernel_ctas: int, arch: str) -> Waves:
    box = machine(_arch(arch))
    return Waves(box.sms * kernel_ctas, box.l2_bytes)


def _offsets(problem, arrays: int = 2) -> int:
    """The sanitised offsets a packed launch reads (``arrays`` of nseq + 1 int32): counted once."""
    return 4 * arrays * (problem.batch + 1) if problem.packed else 0


def _loaded(blocks: range, step: int, length: int) -> tuple[int, int]:
    """[start, end) of the rows (keys) the blocks of ``step`` starting at ``blocks`` load, the
    last one masked to ``length``."""
    if not len(blocks):
        return 0, 0
    return blocks.start, min(blocks.start + len(blocks) * step, length)


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
    (h_q, or h_kv ``by_keys``), then the sequence. Blocks past a sequence's length exit at once
    and take no wave slot."""
    heads = problem.heads_kv if by_keys else problem.heads_q
    for i, lengths in enumerate(sequence_lengths(problem)):
        for h in range(heads):
            for r0 in range(0, lengths[1 if by_keys else 0], block):
                yield i, lengths, h, r0


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


@functools.lru_cache(maxsize=128)
def forward_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_fwd_kernel, one program per (query block of bm rows, batch, query head).

    Order and waves: the grid (cdiv(s_q, bm), b·h_q) runs the query block fastest, so a wave
    (SMs × ``ctas_per_sm``: 132 at d = 128 on sm_90, one CTA per SM) holds every query block of
    one query head after another, then the next heads: the G = h_q/h_kv heads of a KV head are
    consecutive, so a wave spans the query blocks of about wave / cdiv(s_q, bm) heads of one or
    two KV heads.

    Reuse: k and v of a key block are shared by every program of the wave on the same KV head
    and sequence that visits it (``key_range``; causal: the blocks up to the diagonal): counted
    once per wave, over the union of the programs' key ranges (a wave holding query block 63 of
    a head reads all of the KV head's keys once), if the working set fits in L2 (at s = 4096,
    d = 128: 2 MiB of K and V per KV head, 4 MiB of q and o per wave against 50 MB: every wave
    fits); a KV head whose query heads run over several waves is read once in each. Alone: the
    program's q rows (rows·d·e); stored: o and fp32 lse (rows·(d·e + 4)). Packed: the offsets
    once.

    FLOPs per visited tile: S = q kᵀ and P·V, 2·bm·bn·BD each on tensor cores, and 5 FLOPs per
    score plus the accumulator rescale (bm·BD), each times its ``duplication`` (the score work
    with S's: at 64 rows on 8 warps on sm_90 both warpgroups compute S and its softmax, 1.5x
    the tensor-core work, 2x the exponentials)."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    qk_dup, pv_dup = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bd, False)], 1)
    waves = _waves(_training_ctas("attn_fwd_kernel", p, tiles, arch), arch)
    visits = programs = 0
    for i, (lq, lk), h, m0 in _programs(p, bm, by_keys=False):
        rows = min(bm, lq - m0)
        blocks = _key_blocks(m0, m0 + bm, lq, lk, bn, p.causal, p.window)
        waves.program([(("kv", i, h // g), 2 * d * e, *_loaded(blocks, bn, lk))],
                      alone=rows * d * e, stored=rows * (d * e + 4))
        visits += len(blocks)
        programs += 1
    waves.close()
    read, written = waves.read + _offsets(p), waves.written
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
    order: no two programs load the same tile, so waves and L2 change nothing. Each reads its
    o and do rows alone (o passed from the forward: counted) and writes delta = rowsum(o·do) in
    fp32 (passed to dk/dv and dq: counted; 2·d FLOPs per row and head). Packed: the q offsets
    once."""
    p, e = problem, element_size(problem.dtype)
    tokens = sum(lq for lq, _ in sequence_lengths(p)) * p.heads_q
    read = 2 * tokens * p.head_dim * e + _offsets(p, arrays=1)
    return Cost(2 * tokens * p.head_dim, read, 4 * tokens)


@functools.lru_cache(maxsize=128)
def dkdv_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_bwd_dkdv_kernel, one program per (key block of bn keys, batch, KV head).

    Order and waves: the grid (cdiv(s_k, bn), b·h_kv) runs the key block fastest: a wave (SMs ×
    ``ctas_per_sm``) holds every key block of one KV head, then of the next: about wave /
    cdiv(s_k, bn) KV heads (132 x 128 keys at d = 128 on sm_90: four KV heads and part of a
    fifth).

    Reuse: each program loops over the query blocks ``query_range`` lets see its keys (causal:
    those from the diagonal down), from the last one down, and over the G query heads of its KV
    head within each, loading q, do (bm x d), lse and delta (lse from the forward, delta from the
    delta kernel: passed through HBM, each counted at least once). Every key block of the KV head
    loads the same rows: counted once per wave over the union of its programs' query ranges
    (G·s_q·(2·d·e + 8) per KV head and wave), if the wave's working set fits in L2; when it does
    not (G·s_q rows of q and do per KV head: 8.5 MB at G = 4, d = 128, s = 4096, 34 MB at G = 16,
    times the KV heads a wave holds), every program's loads count. The rule takes each program's
    whole query range as held for its whole loop; the descending order keeps the key blocks of a
    KV head on the same q and do tiles at the same time, which it does not credit. Alone: the
    block's k and v (2·keys·d·e); stored: dk, dv. Packed: the offsets once.

    FLOPs per visited tile: four products on tensor cores, 2·bm·bn·BD each, every one with the
    key block's bn rows as M (transposed): Sᵀ = k qᵀ (recomputed) and dPᵀ = v doᵀ, [bn, bm];
    dv += Pᵀ do and dk += dSᵀ q, [bn, BD], Pᵀ and dSᵀ the register A operand; 5 FLOPs per
    score; each times its ``duplication`` (the score work with Sᵀ's: at bn = 64 on 8 warps both
    Hopper warpgroups would compute the whole Sᵀ, which is why sm_90 takes 128 keys on 8 warps
    or 64 on 4)."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bn, bm, True), (bn, bm, True), (bn, bd, False),
                                           (bn, bd, False)], 3)
    waves = _waves(_training_ctas("attn_bwd_dkdv_kernel", p, tiles, arch), arch)
    visits = programs = 0
    for i, (lq, lk), kh, n0 in _programs(p, bn, by_keys=True):
        keys = min(bn, lk - n0)
        blocks = _query_blocks(n0, n0 + bn, lq, lk, bm, p.causal, p.window)
        waves.program([(("q do lse delta", i, kh), g * (2 * d * e + 8), *_loaded(blocks, bm, lq))],
                      alone=2 * keys * d * e, stored=2 * keys * d * e)
        visits += g * len(blocks)
        programs += 1
    waves.close()
    read, written = waves.read + _offsets(p), waves.written
    mma = visits * 2 * bm * bn * bd * sum(dups)
    cuda = visits * SCORE_FLOPS_BWD * bm * bn * dups[0] + programs * bn * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bn,
                mma_duplication=sum(dups) / len(dups))


@functools.lru_cache(maxsize=128)
def dq_cost(problem, tiles, bd: int, arch: str) -> Cost:
    """attn_bwd_dq_kernel, one program per (query block of bm rows, batch, query head).

    Order and waves: the grid (cdiv(s_q, bm), b·h_q) runs the query block fastest, as the
    forward's: a wave (SMs × ``ctas_per_sm``) holds the query blocks of about wave /
    cdiv(s_q, bm) consecutive query heads, of one or two KV heads.

    Reuse: k and v of each key block ``key_range`` lets a program see are shared by the wave's
    programs on the same KV head and sequence: counted once per wave over the union of their
    key ranges, if the working set fits in L2 (2·s_k·d·e per KV head and the wave's own rows:
    it does at every production shape); a KV head whose query heads span several waves is read
    once in each. Alone: the block's q, do, lse and delta (rows·(2·d·e + 8); lse and delta
    passed through HBM: counted); stored: dq. Packed: the offsets once.

    FLOPs per visited tile: three products on tensor cores, 2·bm·bn·BD each: S = q kᵀ and dP =
    do vᵀ (both recomputed: the dk/dv kernel computed them too, so a deterministic backward
    runs 7 products where the atomic one runs 5) and dq += dS k; 5 FLOPs per score; each times
    its ``duplication``."""
    p, e, d = problem, element_size(problem.dtype), problem.head_dim
    bm, bn, g = tiles.bm, tiles.bn, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bn, True), (bm, bd, False)], 2)
    waves = _waves(_training_ctas("attn_bwd_dq_kernel", p, tiles, arch), arch)
    visits = programs = 0
    for i, (lq, lk), h, m0 in _programs(p, bm, by_keys=False):
        rows = min(bm, lq - m0)
        blocks = _key_blocks(m0, m0 + bm, lq, lk, bn, p.causal, p.window)
        waves.program([(("kv", i, h // g), 2 * d * e, *_loaded(blocks, bn, lk))],
                      alone=rows * (2 * d * e + 8), stored=rows * d * e)
        visits += len(blocks)
        programs += 1
    waves.close()
    read, written = waves.read + _offsets(p), waves.written
    mma = visits * 2 * bm * bn * bd * sum(dups)
    cuda = visits * SCORE_FLOPS_BWD * bm * bn * dups[0] + programs * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm,
                mma_duplication=sum(dups) / len(dups))


# -- decode ------------------------------------------------------------------------------------
def _scales(problem, first_head: int, last_head: int) -> list:
    """The FP8 scales a program loads: k_scale and v_scale (4 bytes each) of heads [first_head,
    last_head) (per head) or the two per-tensor ones; shared by every program."""
    if problem.cache_dtype != FP8:
        return []
    if problem.scale_per_head:
        return [(("scales",), 8, first_head, last_head)]
    return [(("scales",), 8, 0, 1)]


def append_cost(problem, block: int) -> Cost:
    """decode_append_kernel, one program per (row, new token, chunk of ``block`` of the
    h_kv·d values).

    Order and waves: the grid (b, T, cdiv(h_kv·d, block)) runs the row fastest; 16 CTAs per SM
    (4 warps, few registers): the production steps' b·T programs (64, 256) are one wave.

    Reuse: every program checks its row before writing: the row's cache length and (paged) the
    block-table entries it needs (cdiv(L + T, page) at context L = decode_context), shared by
    the row's T·chunks programs: once per wave; the scales of the chunk's heads (FP8), shared by
    all. Alone: the chunk of k_new and v_new; stored: the chunk in both caches (FP8: divided,
    clamped and rounded, 3 FLOPs per value) and the row's verdict (4 bytes, by its first
    program; passed to the split kernel)."""
    p, e, ce = problem, element_size(problem.dtype), element_size(problem.cache_dtype)
    arch = target_arch(p.device)
    L, row, d = decode_context(p), p.heads_kv * p.head_dim, p.head_dim
    table = min(p.max_pages, -(-(L + p.tokens) // p.page_size)) if p.paged else 0
    waves = _waves(_decode_ctas("decode_append_kernel", arch), arch)
    for c in range(-(-row // block)):
        values = min(block, row - c * block)
        scales = _scales(p, c * block // d, -(-(c * block + values) // d))
        for t in range(p.tokens):
            for b in range(p.batch):
                waves.program([(("length", b), 4, 0, 1), (("table", b), 4, 0, table), *scales],
                              alone=2 * values * e,
                              stored=2 * values * ce + (4 if t == 0 and c == 0 else 0))
    waves.close()
    flops = 2 * 3 * p.batch * p.tokens * row if p.cache_dtype == FP8 else 0
    return Cost(flops, waves.read, waves.written)


@functools.lru_cache(maxsize=64)
def split_cost(problem, tiles, bm: int, bd: int, split_len: int, arch: str) -> Cost:
    """decode_split_kernel, one program per (row, KV head, split of ``split_len`` positions).

    Order and waves: the grid (b·h_kv, splits) runs the (row, KV head) fastest: a wave (SMs ×
    ``ctas_per_sm``: 396 on sm_90) holds one split of every (row, KV head), or the end of one
    split and the start of the next (b·h_kv = 512 at the production shapes).

    Reuse: each program loads its row's cache length and verdict (from the append kernel),
    shared by the row's h_kv programs of the wave; the T·G query rows of its KV head, shared
    with the same (row, KV head)'s other splits only: 512 programs apart, so in another wave
    (read once per split); the scales (FP8), shared by all; (paged) the block-table entries of
    its split's pages (a program re-reads one per bn positions of a page: once), shared by the
    row's KV heads. Alone: k and v of every cached position of its split up to L + T (at
    context L = decode_context: the whole capacity, the new tokens included); stored: the
    partial output whole, bm x BD fp32 (rows T·G padded to bm), and bm lse values, every split
    (empty ones included), read back by the combine kernel. The cache splits a wave streams
    count in its working set: 396 x 256 KiB at T = 1 (bf16, 512 positions a split) does not fit
    sm_90's 50 MB, so every program's shared loads count there (a few KiB: the lengths,
    verdicts and table entries); B200's 126 MB holds the wave.

    FLOPs per step of bn positions: q kᵀ and P v on tensor cores, 2·bm·bn·BD each on the
    padded rows; 5 FLOPs per score; each times its ``duplication``."""
    p, e, ce = problem, element_size(problem.dtype), element_size(problem.cache_dtype)
    bn, d, g = tiles.bn, problem.head_dim, problem.heads_q // problem.heads_kv
    dups = duplication(arch, tiles.warps, [(bm, bn, True), (bm, bd, False)], 1)
    total = min(decode_context(p) + p.tokens, p.capacity)
    heads = p.batch * p.heads_kv
    waves = _waves(_decode_ctas("decode_split_kernel", arch, tiles, p.cache_dtype == FP8), arch)
    steps = 0
    for split in range(p.num_splits):
        start = split * split_len
        end = min(start + split_len, total)
        keys = max(0, end - start)
        pages = (start // p.page_size, (end - 1) // p.page_size + 1) if p.paged and keys else (0, 0)
        for bk in range(heads):
            b, kh = divmod(bk, p.heads_kv)
            waves.program([(("length, verdict", b), 8, 0, 1),
                           (("q", bk), p.tokens * g * d * e, 0, 1), *_scales(p, kh, kh + 1),
                           (("table", b), 4, *pages)],
                          alone=2 * keys * d * ce, stored=bm * bd * 4 + bm * 4)
        steps += heads * len(range(start, end, bn))
    waves.close()
    read, written = waves.read, waves.written
    mma = steps * 2 * bm * bn * bd * sum(dups)
    cuda = steps * (SCORE_FLOPS_FWD * bm * bn * dups[0] + bm * bd) + heads * p.num_splits * bm * bd
    return Cost(mma + cuda, read, written, mma_flops=mma, mma_rows=bm,
                mma_duplication=sum(dups) / len(dups))


def combine_cost(problem, bm: int, bd: int) -> Cost:
    """decode_combine_kernel, one program per (row, KV head), in any order: no two programs
    load the same tile, so waves change nothing. Each reads its splits' bm x BD fp32 partial
    outputs and bm lse values (passed from the split kernel: counted) alone; it reads the lse
    twice (the maximum, then the weights), the second time its own tile again (counted once:
    8 CTAs per SM, a few KiB each, well within L2); o (the T·G real rows) and lse written.
    2 FLOPs per partial value."""
    p, e = problem, element_size(problem.dtype)
    heads, rows = p.batch * p.heads_kv, p.tokens * (p.heads_q // p.heads_kv)
    read = heads * p.num_splits * (bm * 4 + bm * bd * 4)
    written = heads * rows * (p.head_dim * e + 4)
    return Cost(heads * p.num_splits * 2 * bm * bd, read, written)
