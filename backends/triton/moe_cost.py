"""The FLOP and HBM-traffic model of the Triton MoE expert kernels (docs/performance.md, "How
traffic is counted"; docs/moe.md, "Performance model"), counted from each kernel's tiles, loop
structure and program order.

Routing: the models take the production shapes' uniform routing at its mean
(``fusedops.moe.contract.balanced_rows``: every expert gets t·k / E rows, every id valid, each
token k distinct experts). The dispatch ranks an expert's rows in assignment order, so row tile j
of an expert with r rows holds the tokens of the fraction [j·BM / r, (j + 1)·BM / r) of the
token range.

Waves: programs start in launch order (a 1-D grid by program id; a 2-D or 3-D grid with its
first dimension fastest), ``Machine.sms`` × CTAs per SM (the tile table's ``ctas_per_sm``; 1 for
the kernels without a table) at a time; a wave is that many consecutive programs that do work (a
grouped-GEMM program past offsets[E] exits after one load and takes no slot). Within a wave:

* a tile several of its programs load (a weight column tile, an A row tile, a gradient's row
  slice) counts once, and a row gathered by token that programs of several experts load (the
  token is in each expert's rows) counts once: with s experts' tiles covering a stretch of the
  token range, a token there is in at least one of them with probability
  1 - C(E - s, k) / C(E, k) (uniform routing, k distinct experts);
* that credit holds only if the wave's working set fits in the L2 (``Machine.l2_bytes``): the
  distinct bytes its programs load, plus what they load alone (u, the gradients they
  accumulate) and what they store, taking whole K strips (programs of a wave hold their rows
  and columns for the whole K loop). A wave that does not fit counts every program's loads;
* a tile loaded again in a later wave counts again.

What a program loads alone, and every store, counts once. Masked loads (padding rows, columns
past N) move nothing; the tensor cores still multiply the padded tile, so MMA FLOPs count whole
tiles. The few index words every program reads (offsets, counts: 4(2E + 1) bytes) count once.
Values passed between kernels through HBM (relu(u)², d_u, the fp32 rows the combine sums, the
<g, a> partials) count on both sides. Integer work (the dispatch's compares and prefix sums)
counts no FLOPs.

Strides: x, d_out, out and d_x (and the router's logits, d_logits) may be strided views; the
kernels load and store each row's elements and nothing between rows, so no count depends on the
strides (a row that starts 16 bytes into a 32-byte sector touches one sector more, at most 32
bytes a row; not counted).

The counts are torch computations on the CPU; a plan built under a fake-tensor mode (the torch
ops' fake implementations, torch.compile tracing) still gets real numbers (``_real``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.moe.contract import balanced_rows

from .wave_model import machine

INDEX = 4              # bytes of an int32 id, row or offset, and of an fp32 routing weight
_F64 = torch.float64


def _real(model):
    """``model`` computed on real CPU tensors even inside a fake-tensor mode (a data-dependent
    size such as repeat_interleave's has no fake counterpart)."""
    @functools.wraps(model)
    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return model(*args, **kwargs)
    return run


# -- the balanced routing ----------------------------------------------------------------------
def routed_rows(problem) -> int:
    """Rows the routed GEMMs hold data for: t·k (every id valid)."""
    return sum(rows * n for rows, n in balanced_rows(problem.assignments, problem.experts))


def _expert_rows(problem) -> torch.Tensor:
    """Rows of each expert under the balanced routing, in expert order [E]."""
    out = []
    for rows, n in balanced_rows(problem.assignments, problem.experts):
        out += [rows] * n
    return torch.tensor(out, dtype=torch.int64)


@dataclass(frozen=True)
class RowTiles:
    """The routed row tiles the grid runs (every expert's rows padded to the row tile, BM rows a
    tile), in dispatch order: expert, index within the expert, rows holding data, and the
    fraction of the token range the tile's rows come from."""

    expert: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    frac: torch.Tensor

    @property
    def count(self) -> int:
        return len(self.expert)


def routed_row_tiles(problem, bm: int, tile: int) -> RowTiles:
    """Row tiles in use: expert e's rows padded to ``tile`` (the dispatch's row tile) and cut
    into BM-row tiles; a tile of padding only still runs (its loads of A are masked, B's not).
    The grid's other tiles (up to the worst case t·k + E·(tile - 1)) exit after reading
    offsets[E]."""
    rows = _expert_rows(problem)
    per = (rows + tile - 1) // tile * tile // bm
    expert = torch.repeat_interleave(torch.arange(len(rows)), per)
    start = torch.cumsum(per, 0) - per
    index = torch.arange(int(per.sum())) - torch.repeat_interleave(start, per)
    r = rows[expert]
    valid = torch.clamp(r - index * bm, 0, bm)
    return RowTiles(expert, index, valid, valid.to(_F64) / torch.clamp(r, min=1).to(_F64))


def dense_row_tiles(tokens: int, bm: int) -> RowTiles:
    """The shared expert's row tiles: ceil(t / BM), one expert, rows = tokens."""
    n = triton.cdiv(tokens, bm)
    index = torch.arange(n)
    valid = torch.clamp(tokens - index * bm, 0, bm)
    return RowTiles(torch.zeros(n, dtype=torch.int64), index, valid,
                    valid.to(_F64) / max(tokens, 1))


# -- counting by wave ----------------------------------------------------------------------------
def _first(keys: torch.Tensor) -> torch.Tensor:
    """Mask of the first occurrence (in program order) of each key."""
    order = torch.argsort(keys, stable=True)
    ranked = keys[order]
    first = torch.ones_like(ranked, dtype=torch.bool)
    first[1:] = ranked[1:] != ranked[:-1]
    out = torch.empty_like(first)
    out[order] = first
    return out


def _per_wave(wave: torch.Tensor, values: torch.Tensor, waves: int) -> torch.Tensor:
    return torch.bincount(wave, weights=values.to(_F64), minlength=waves)


def keyed(wave: torch.Tensor, waves: int, key: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
    """Distinct bytes per wave of an operand whose tile ``key`` (>= 0) has ``nbytes``."""
    first = _first(wave * (int(key.max()) + 1 if len(key) else 1) + key)
    return _per_wave(wave[first], nbytes[first], waves)


@functools.lru_cache(maxsize=32)
def _miss_table(experts: int, top_k: int) -> torch.Tensor:
    return torch.tensor([math.comb(experts - i, top_k) / math.comb(experts, top_k)
                         for i in range(experts + 1)], dtype=_F64)


def _miss(problem, s: torch.Tensor) -> torch.Tensor:
    """C(E - s, k) / C(E, k): the chance a token has none of s given experts."""
    return _miss_table(problem.experts, problem.top_k)[s]


def gathered(problem, wave: torch.Tensor, waves: int, column: torch.Tensor,
             width: torch.Tensor, tiles: RowTiles, tile: torch.Tensor) -> torch.Tensor:
    """Distinct bytes per wave of an operand gathered by token (x, d_out): a program loads the
    tokens of row tile ``tile`` (whole experts in the weight gradient: index 0, fraction 1) at
    column block ``column`` of ``width`` bytes. Per (wave, column block, tile index): with s
    experts' tiles there, t·fraction·(1 - C(E - s, k) / C(E, k)) distinct tokens."""
    index = tiles.index[tile]
    span = int(index.max()) + 1 if len(index) else 1
    group = (wave * (int(column.max()) + 1 if len(column) else 1) + column) * span + index
    first_expert = _first(group * problem.experts + tiles.expert[tile])
    first_group = _first(group)
    _, inverse = torch.unique(group, return_inverse=True)
    s = torch.bincount(inverse[first_expert], minlength=int(inverse.max()) + 1 if len(inverse)
                       else 0)
    tokens = problem.tokens * tiles.frac[tile] * (1 - _miss(problem, s[inverse]))
    return _per_wave(wave[first_group], (tokens * width.to(_F64))[first_group], waves)


@dataclass(frozen=True)
class Waves:
    """The working programs of a launch in launch order, cut into waves."""

    size: int
    count: int
    wave: torch.Tensor

    @classmethod
    def of(cls, programs: int, size: int) -> Waves:
        return cls(size, triton.cdiv(programs, size) if programs else 0,
                   torch.arange(programs) // size)


def wave_traffic(waves: Waves, l2: int, shared: list[tuple[torch.Tensor, torch.Tensor]],
                 alone: torch.Tensor, written: torch.Tensor) -> tuple[float, float]:
    """(bytes read, bytes written) of a launch: ``shared`` = (each program's bytes of the
    operand, the operand's distinct bytes per wave) for every operand programs share,
    ``alone``/``written`` each program's bytes loaded alone/stored. Per wave, the distinct
    bytes if the working set (distinct + alone + written) fits in ``l2``, else every
    program's loads."""
    n = waves.count
    every = sum((_per_wave(waves.wave, per_program, n) for per_program, _ in shared),
                torch.zeros(n, dtype=_F64))
    distinct = sum((d for _, d in shared), torch.zeros(n, dtype=_F64))
    own, stored = _per_wave(waves.wave, alone, n), _per_wave(waves.wave, written, n)
    fits = distinct + own + stored <= l2
    read = torch.where(fits, distinct, every) + own
    return float(read.sum()), float(stored.sum())


def _index_once(problem) -> int:
    return INDEX * (2 * problem.experts + 1)


# -- the grouped and dense GEMMs -----------------------------------------------------------------
def grouped_order(m_tiles: int, n_tiles: int, group_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row tile, column tile) of each program id of moe_gemm_kernel, in launch order: GROUP_M
    row tiles run through every column tile, row tiles fastest, before the next group."""
    pid = torch.arange(m_tiles * n_tiles)
    per_group = group_m * n_tiles
    first_m = pid // per_group * group_m
    rows = torch.clamp(m_tiles - first_m, max=group_m)
    return first_m + pid % per_group % rows, pid % per_group // rows


@_real
def gemm_cost(problem, *, routed: bool, kdim: int, ndim: int, bm: int, bn: int, bk: int,
              out_bytes: int, group_m: int, grid_m_tiles: int, row_tile: int, a_by_token: bool,
              arch: str, ctas_per_sm: int = 1, save_u: bool = False, read_u: bool = False,
              weighted: bool = False, part: bool = False, epilogue_flops: int = 0) -> Cost:
    """One grouped (``routed``) or dense (the shared expert: every token one row) GEMM launch.

    Order: the 1-D grid of M_TILES × NT programs (NT = ceil(N / BN)) runs in GROUP_M groups: a
    group's GROUP_M row tiles through column tile 0, then column tile 1, ..., then the next
    group (``grouped_order``). Working programs: the row tiles in use (routed: each expert's
    rows padded to the row tile, BM rows a tile, in expert order; dense: ceil(t / BM)); the
    rest exit. A wave is ``sms × ctas_per_sm`` consecutive working programs.

    Per program (row tile m of expert e, column tile n; v rows holding data, c = min(BN, N -
    n·BN) columns, e the element size):
      A: the v rows of m (x or d_out gathered by token; act or d_u by row), K·e each, with the
         row map and (weighted) the routing weights by row (4 + 4) · v: shared by m's column
         tiles; a token's x or d_out row is shared by its k experts' tiles
      B: W[e]'s column tile n, K·c·e: shared by every row tile of e
      alone: u by assignment (read_u), v·c·e; written: the epilogue's v·c·out_bytes, u
         (save_u) v·c·e, the <g, a> partial (part) 4·v.
    So within a wave that fits, each row tile counts once (again in each later wave that runs
    more of its column tiles) and each (expert, column tile) once; a wave that does not fit
    counts them per program. FLOPs: working row tiles · BM × NT·BN × ceil(K / BK)·BK × 2 on
    tensor cores (whole tiles), plus ``epilogue_flops`` per output element on the CUDA cores.
    """
    e = element_size(problem.dtype)
    box = machine(arch)
    tiles = routed_row_tiles(problem, bm, row_tile) if routed else \
        dense_row_tiles(problem.tokens, bm)
    n_tiles = triton.cdiv(ndim, bn)
    pid_m, pid_n = grouped_order(grid_m_tiles, n_tiles, group_m)
    working = pid_m < tiles.count
    pid_m, pid_n = pid_m[working], pid_n[working]
    waves = Waves.of(len(pid_m), box.sms * ctas_per_sm)
    v = tiles.valid[pid_m].to(_F64)
    c = torch.clamp(ndim - pid_n * bn, max=bn).to(_F64)
    a_rows = v * kdim * e
    row_data = v * (INDEX * routed + INDEX * weighted)
    b = c * kdim * e
    if routed and a_by_token:
        a_distinct = gathered(problem, waves.wave, waves.count, torch.zeros_like(pid_m),
                              torch.full_like(v, kdim * e), tiles, pid_m)
        shared = [(a_rows, a_distinct), (row_data, keyed(waves.wave, waves.count, pid_m, row_data))]
    else:
        shared = [(a_rows + row_data, keyed(waves.wave, waves.count, pid_m, a_rows + row_data))]
    shared.append((b, keyed(waves.wave, waves.count, tiles.expert[pid_m] * n_tiles + pid_n, b)))
    alone = v * c * e if read_u else torch.zeros_like(v)
    written = v * c * out_bytes + (v * c * e if save_u else 0) + (INDEX * v if part else 0)
    read, stored = wave_traffic(waves, box.l2_bytes, shared, alone, written)
    if routed:
        read += _index_once(problem)
    mma = 2 * (tiles.count * bm) * (n_tiles * bn) * (triton.cdiv(kdim, bk) * bk)
    rows = routed_rows(problem) if routed else problem.tokens
    return Cost(mma + epilogue_flops * rows * ndim, read, stored, mma_flops=mma, mma_rows=bm)


# -- the weight-gradient GEMMs -------------------------------------------------------------------
@_real
def wgrad_cost(problem, *, routed: bool, m: int, n: int, bm: int, bn: int, bk: int,
               p_by_token: bool, q_by_token: bool, p_weighted: bool, q_relu2: bool, arch: str,
               ctas_per_sm: int = 1) -> Cost:
    """grad[e] (+)= sum over e's rows of P[row, :m]ᵀ · Q[row, :n]: one program per (expert, BM×BN
    tile of the gradient) walks all the expert's rows, BK at a time.

    Order: the grid (E, MT, NT) (MT = ceil(m / BM), NT = ceil(n / BN)) runs the expert fastest:
    a wave of ``sms × ctas_per_sm`` programs covers every expert at one gradient tile (i, j)
    and a few at the next row tile i + 1. Programs of the same expert, which share its P and Q
    rows, run E programs apart: at E >= the wave, in different waves.

    Per program (expert e with r rows; mc, nc the tile's columns; e, g the element sizes):
      P[:, i] (d_out gathered by token, or d_u by row): r·mc·e, shared by e's NT column tiles;
         a token's d_out slice is shared by its k experts, all in the same wave: the wave
         counts each token once per row tile i it covers
      Q[:, j] (u by assignment, or x gathered by token): r·nc·e, shared by e's MT row tiles;
         x likewise once per token
      the row map and (p_weighted) the weights, 4·r (+ 4·r): shared by e's programs
      alone: the gradient tile when accumulating, mc·nc·g; written: mc·nc·g.
    So P counts about t·m·e (by token) or R·m·e (by row) per column tile j, and Q R·n·e (by
    assignment) or t·n·e (by token) per row tile i: the grid order puts each expert's re-reads
    E programs apart. FLOPs: sum over experts of ceil(rows_e / BK)·BK × MT·BM × NT·BN × 2 on
    tensor cores; on the CUDA cores the weighting (R·m·NT), relu² (2·R·n·MT) and the
    accumulation (E·m·n).
    """
    e, g = element_size(problem.dtype), element_size(problem.weight_grad_dtype)
    box = machine(arch)
    experts = problem.experts if routed else 1
    rows_of = _expert_rows(problem) if routed else torch.tensor([problem.tokens])
    whole = RowTiles(torch.arange(experts), torch.zeros(experts, dtype=torch.int64), rows_of,
                     (rows_of > 0).to(_F64))
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    pid = torch.arange(experts * m_tiles * n_tiles)
    ex, i, j = pid % experts, pid // experts % m_tiles, pid // (experts * m_tiles)
    waves = Waves.of(len(pid), box.sms * ctas_per_sm)
    r = rows_of[ex].to(_F64)
    mc = torch.clamp(m - i * bm, max=bm).to(_F64)
    nc = torch.clamp(n - j * bn, max=bn).to(_F64)
    w, count = waves.wave, waves.count

    def operand(by_token, block, cols, tiles_n):
        own = r * cols * e
        if routed and by_token:
            return own, gathered(problem, w, count, block, cols * e, whole, ex)
        return own, keyed(w, count, ex * tiles_n + block, own)

    shared = [operand(p_by_token, i, mc, m_tiles), operand(q_by_token, j, nc, n_tiles)]
    if routed:
        data = r * (INDEX + INDEX * p_weighted)
        shared.append((data, keyed(w, count, ex, data)))
    grad = mc * nc * g
    read, stored = wave_traffic(waves, box.l2_bytes, shared,
                                grad if problem.accumulate else torch.zeros_like(grad), grad)
    if routed:
        read += _index_once(problem)
    groups = balanced_rows(problem.assignments, experts) if routed else ((problem.tokens, 1),)
    rows = sum(rr * cc for rr, cc in groups)
    padded_rows = sum(cc * triton.cdiv(rr, bk) * bk for rr, cc in groups)
    mma = 2 * padded_rows * (m_tiles * bm) * (n_tiles * bn)
    other = (rows * m * n_tiles if p_weighted else 0) + (2 * rows * n * m_tiles if q_relu2 else 0) \
        + (experts * m * n if problem.accumulate else 0)
    return Cost(mma + other, read, stored, mma_flops=mma, mma_rows=bm)


# -- the dispatch --------------------------------------------------------------------------------
# 1-D grids over blocks of assignments (count, scatter) or expert chunks (scan): each program
# loads its own block; what every program loads (the offsets, E words) is in L2 and counts once.
def _part_bytes(problem, blocks: int, experts_padded: int) -> int:
    return INDEX * blocks * experts_padded


def count_cost(problem, blocks: int, experts_padded: int) -> Cost:
    """topk_ids read once (4·t·k), each program its block; one count per (block of
    assignments, expert) written."""
    return Cost(0, INDEX * problem.assignments, _part_bytes(problem, blocks, experts_padded))


def scan_cost(problem, blocks: int, experts_padded: int) -> Cost:
    """Each program its chunk of experts: the block counts read and rewritten as exclusive
    prefixes; counts [E] written."""
    part = _part_bytes(problem, blocks, experts_padded)
    return Cost(0, part, part + INDEX * problem.experts)


def offsets_cost(problem) -> Cost:
    """One program: counts read, offsets [E + 1] written."""
    return Cost(0, INDEX * problem.experts, INDEX * (problem.experts + 1))


def scatter_cost(problem, blocks: int, experts_padded: int) -> Cost:
    """topk_ids and each block's prefixes read by its program, offsets (every program reads all
    E, in L2) once; the row -> assignment map written (4·t·k: its padding rows are never
    written)."""
    read = INDEX * problem.assignments + _part_bytes(problem, blocks, experts_padded) + \
        INDEX * problem.experts
    return Cost(0, read, INDEX * problem.assignments)


# -- the fixed-order sums ------------------------------------------------------------------------
@_real
def combine_cost(problem, rows_per_program: int, bh: int, arch: str) -> Cost:
    """out[t] = the k fp32 rows of t (+ the shared expert's) summed and rounded.

    Order: the grid (TB = ceil(t / BT), HT = ceil(H / BH)) runs the token block fastest: a
    wave covers consecutive token blocks at one column block. Each program loads its own
    k fp32 row slices (4·BT·k·BH; the shared expert's 4·BT·BH) and the ids of its tokens
    (4·BT·k), which the HT column blocks of the token block share: TB programs apart, so in
    one wave only when TB < the wave. So: the fp32 rows [t·k, H] read once (4·t·k·H, passed
    from the down or dgrad-up GEMM: always counted), the shared rows (4·t·H), topk_ids once per
    column block when TB >= the wave (4·t·k·HT); out written (t·H·e). One add per row element
    read."""
    t, H, k = problem.tokens, problem.hidden, problem.top_k
    box = machine(arch)
    tb, ht = triton.cdiv(t, rows_per_program), triton.cdiv(H, bh)
    pid = torch.arange(tb * ht)
    block, col = pid % tb, pid // tb
    waves = Waves.of(len(pid), box.sms)
    rows = torch.clamp(t - block * rows_per_program, max=rows_per_program).to(_F64)
    cols = torch.clamp(H - col * bh, max=bh).to(_F64)
    ids = INDEX * k * rows
    alone = INDEX * rows * cols * (k + problem.has_shared)
    written = rows * cols * element_size(problem.dtype)
    read, stored = wave_traffic(waves, box.l2_bytes,
                                [(ids, keyed(waves.wave, waves.count, block, ids))], alone,
                                written)
    flops = t * H * (k + problem.has_shared)
    return Cost(flops, read, stored)


def weight_grad_reduce_cost(problem, parts: int) -> Cost:
    """d_topk_weights[a] = sum of its ``parts`` fp32 partials (one per column tile of the
    dgrad-down GEMM, passed through HBM: counted): a 1-D grid, each program its own block of
    assignments: partials 4·parts·t·k and topk_ids read, 4·t·k written."""
    A = problem.assignments
    return Cost(parts * A, INDEX * A * (parts + 1), INDEX * A)
