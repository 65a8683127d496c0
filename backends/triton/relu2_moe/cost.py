"""The FLOP and HBM-traffic model of the Triton MoE expert kernels (docs/performance.md, "How
traffic is counted"; docs/relu2_moe.md, "Performance model"), counted from each kernel's tiles, loop
structure and program order.

Routing: the models take the production shapes' uniform routing at its mean
(``fusedops.relu2_moe.contract.balanced_rows``: every expert gets t·k / E rows, every id valid, each
token k distinct experts).

Reuse: programs start in launch order (a 1-D grid by program id; a 2-D grid with its first
dimension fastest); a grouped-GEMM program past offsets[E] exits after one load and takes no
slot. A tile a program loads hits in the L2 when the previous program that loaded it is at most
G programs earlier (``l2_reuse.reuse_traffic``: G = half the L2 over the mean bytes a program
moves); otherwise, and the first time, it counts. A token's x or d_out row that the tiles of
its k experts gather counts once per expert: those tiles lie hundreds of programs apart (every
expert's row tiles run through all their column tiles in turn), beyond G at every production
shape. What a program loads alone, and every store, counts once. Masked loads (padding rows,
columns past N) move nothing; the tensor cores still multiply the padded tile, so MMA FLOPs
count whole tiles. The few index words every program reads (offsets, counts: 4(2E + 1) bytes)
count once. Values passed between kernels through HBM (u, d_u, the per-assignment rows the
combine sums, the <g, a> partials) count on both sides. Integer work (the dispatch's compares
and prefix sums) counts no FLOPs.

Strides: x, d_out, out and d_x (and the router's logits, d_logits) may be strided views; the
kernels load and store each row's elements and nothing between rows, so no count depends on the
strides (a row that starts 16 bytes into a 32-byte sector touches one sector more, at most 32
bytes a row; not counted).

The counts are torch computations on the CPU; a plan built under a fake-tensor mode (the torch
ops' fake implementations, torch.compile tracing) still gets real numbers (``_real``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.machines import machine
from fusedops.relu2_moe.contract import balanced_rows

from ..l2_reuse import reuse_traffic

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
    tile), in dispatch order: expert, index within the expert, rows holding data."""

    expert: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor

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
    valid = torch.clamp(rows[expert] - index * bm, 0, bm)
    return RowTiles(expert, index, valid)


def dense_row_tiles(tokens: int, bm: int) -> RowTiles:
    """The shared expert's row tiles: ceil(t / BM), one expert, rows = tokens."""
    n = triton.cdiv(tokens, bm)
    index = torch.arange(n)
    valid = torch.clamp(tokens - index * bm, 0, bm)
    return RowTiles(torch.zeros(n, dtype=torch.int64), index, valid)


def _index_once(problem) -> int:
    return INDEX * (2 * problem.experts + 1)


# -- the grouped and dense GEMMs -----------------------------------------------------------------
def grouped_order(m_tiles: int, n_tiles: int, group_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row tile, column tile) of each program id of moe_gemm_kernel (and of the tiles of one
    expert in moe_wgrad_kernel), in launch order: GROUP_M row tiles run through every column
    tile, row tiles fastest, before the next group."""
    pid = torch.arange(m_tiles * n_tiles)
    per_group = group_m * n_tiles
    first_m = pid // per_group * group_m
    rows = torch.clamp(m_tiles - first_m, max=group_m)
    return first_m + pid % per_group % rows, pid % per_group // rows


@_real
def gemm_cost(problem, *, routed: bool, kdim: int, ndim: int, bm: int, bn: int, bk: int,
              group_m: int, grid_m_tiles: int, row_tile: int, arch: str,
              epilogue_read: str | None = None, a_relu2: bool = False, weighted: bool = False,
              part: bool = False, epilogue_flops: int = 0, swap: bool = False,
              act: bool = False) -> Cost:
    """One grouped (``routed``) or dense (the shared expert: every token one row) GEMM launch.

    Order: the 1-D grid of M_TILES × NT programs (NT = ceil(N / BN)) runs in GROUP_M groups: a
    group's GROUP_M row tiles through column tile 0, then column tile 1, ..., then the next
    group (``grouped_order``). Working programs: the row tiles in use (routed: each expert's
    rows padded to the row tile, BM rows a tile, in expert order; dense: ceil(t / BM)); the
    rest exit.

    Per program (row tile m of expert e, column tile n; v rows holding data, c = min(BN, N -
    n·BN) columns, e the element size):
      A: the v rows of m (x or d_out gathered by token, u by assignment, d_u by row), K·e each,
         with the row map and (weighted) the routing weights, (4 + 4) · v: shared by m's
         column tiles, GROUP_M programs apart
      B: W[e]'s column tile n, K·c·e: shared by e's row tiles of the group, a program apart
      alone: u by assignment (``epilogue_read`` "u"), v·c·e; or the k rows of each token
         (``epilogue_read`` "rows"), k·v·c·e, with their ids 4·k·v; written: v·c·e (u, the
         per-assignment rows, d_u or out, all in x's dtype), the <g, a> partial (part) 4·v.
    FLOPs: working row tiles · BM × NT·BN × ceil(K / BK)·BK × 2 on tensor cores (whole tiles),
    plus ``epilogue_flops`` per output element and, with ``a_relu2``, relu(u)² (2 per element
    of A, redone for every column tile) on the CUDA cores. ``swap``: the product computed
    transposed, the column tile the MMA's M (the same FLOPs). ``act``: the UP epilogue also
    writes relu(u)², v·c·e more (2 FLOPs an element).
    """
    e = element_size(problem.dtype)
    box = machine(arch)
    tiles = routed_row_tiles(problem, bm, row_tile) if routed else \
        dense_row_tiles(problem.tokens, bm)
    n_tiles = triton.cdiv(ndim, bn)
    pid_m, pid_n = grouped_order(grid_m_tiles, n_tiles, group_m)
    working = pid_m < tiles.count
    pid_m, pid_n = pid_m[working], pid_n[working]
    programs = len(pid_m)
    prog = torch.arange(programs)
    v = tiles.valid[pid_m].to(_F64)
    c = torch.clamp(ndim - pid_n * bn, max=bn).to(_F64)
    a_bytes = v * (kdim * e + INDEX * routed + INDEX * weighted)
    loads = [(prog, pid_m, a_bytes),
             (prog, tiles.expert[pid_m] * n_tiles + pid_n, c * kdim * e)]
    k = problem.top_k
    alone = {None: torch.zeros_like(v), "u": v * c * e,
             "rows": v * k * (c * e + INDEX)}[epilogue_read]
    written = v * c * e * (1 + act) + (INDEX * v if part else 0)
    read, stored = reuse_traffic(programs, loads, alone, written, box.l2_bytes)
    if routed:
        read += _index_once(problem)
    mma = 2 * (tiles.count * bm) * (n_tiles * bn) * (triton.cdiv(kdim, bk) * bk)
    rows = routed_rows(problem) if routed else problem.tokens
    transform = 2 * float((v * kdim).sum()) if a_relu2 else 0
    epilogue = (epilogue_flops + 2 * act) * rows * ndim
    return Cost(mma + epilogue + transform, read, stored, mma_flops=mma,
                mma_rows=bn if swap else bm)


# -- the weight-gradient GEMMs -------------------------------------------------------------------
@dataclass(frozen=True)
class WgradItems:
    """The work items of one routed weight-gradient launch that do work, in launch order (the
    experts' own, or a row of ``kernels.moe_wgrad_split_kernel``'s table): expert, chunk of
    its rows, rows, whether the sum goes to a split-K slot, and the slots it adds."""

    expert: torch.Tensor
    chunk: torch.Tensor
    rows: torch.Tensor
    to_slot: torch.Tensor
    parts: torch.Tensor


def wgrad_items(rows_of: torch.Tensor, split: int, chunk: int, slots: int) -> WgradItems:
    """The working items of a weight-gradient launch over experts of ``rows_of`` rows: split 0,
    every expert whole; split 1, every expert, those of more than ``chunk`` rows with none (their
    tile rewritten as it is); split 2, the chunks past the first of those (at most ``slots``),
    each to a slot; split 3, their first chunks, each adding its expert's slots."""
    n = rows_of.to(torch.int64)
    experts = torch.arange(len(n))
    big = n > chunk if split else torch.zeros_like(n, dtype=torch.bool)
    extra = torch.where(big, (n + chunk - 1) // max(chunk, 1) - 1, 0)
    if split in (0, 1):
        zero = torch.zeros_like(n)
        return WgradItems(experts, zero, torch.where(big, 0, n), zero.bool(), zero)
    if split == 3:
        e = experts[big]
        zero = torch.zeros_like(e)
        return WgradItems(e, zero, torch.full_like(e, chunk), zero.bool(), extra[big])
    e = torch.repeat_interleave(experts, extra)[:slots]
    c = torch.arange(len(e)) - (torch.cumsum(extra, 0) - extra)[e] + 1
    rows = torch.clamp(n[e] - c * chunk, max=chunk)
    return WgradItems(e, c, rows, torch.ones_like(e, dtype=torch.bool), torch.zeros_like(e))


def wgrad_split_cost(problem, slots: int) -> Cost:
    """The split-K work table: one program reads counts and offsets (4·2E) and writes 2·slots
    rows of 8 int32."""
    return Cost(0, INDEX * 2 * problem.experts, INDEX * 8 * 2 * slots)


@_real
def wgrad_cost(problem, *, routed: bool, m: int, n: int, bm: int, bn: int, bk: int,
               group_m: int, a_relu2: bool, a_weighted: bool, arch: str, split: int = 0,
               chunk: int = 0, slots: int = 0) -> Cost:
    """grad[e] (+)= sum over e's rows of A[row, :m]ᵀ · B[token, :n]: one program per (work
    item, BM×BN tile of the gradient) walks the item's rows, BK at a time. A work item is an
    expert, or with split-K (``split`` 1, 2 and 3, ``wgrad_items``) a chunk of at most
    ``chunk`` of its rows; under the balanced routing no expert passes ``chunk``, so the
    second and third launches have no work and the first is the unsplit launch.

    Order: the item slowest (items × MT × NT programs, MT = ceil(m / BM), NT = ceil(n / BN));
    inside an item GROUP_M row tiles run through every column tile (``grouped_order``).

    Per program (an item of r rows; mc, nc the tile's columns; e, g the element sizes):
      A[:, i] (d_u by row, or u by assignment): r·mc·e, shared by the item's NT column tiles
      B[:, j] (x or d_out gathered by token): r·nc·e, shared by the item's MT row tiles
      the row map and (a_weighted) the weights, 4·r (+ 4·r): shared by the item's programs
      alone: the gradient tile when accumulating, mc·nc·g, and the item's slots' tiles,
        4·mc·nc each; written: mc·nc·g, or 4·mc·nc into a slot.
    FLOPs: sum over items of ceil(r / BK)·BK × MT·BM × NT·BN × 2 on tensor cores; on the CUDA
    cores A's transform per program (relu² 2, the weight 1 per element of A[:, i]) and the
    additions of the buffer (accumulating) and of the slots (m·n each).
    """
    e, g = element_size(problem.dtype), element_size(problem.weight_grad_dtype)
    box = machine(arch)
    rows_of = _expert_rows(problem) if routed else torch.tensor([problem.tokens])
    items = wgrad_items(rows_of, split, chunk, slots)
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    tile_i, tile_j = grouped_order(m_tiles, n_tiles, group_m)
    per = m_tiles * n_tiles
    programs = len(items.expert) * per
    prog = torch.arange(programs)
    item, i, j = prog // per, tile_i[prog % per], tile_j[prog % per]
    r = items.rows[item].to(_F64)
    chunks = int(items.chunk.max()) + 1 if len(items.chunk) else 1
    part = items.expert[item] * chunks + items.chunk[item]
    mc = torch.clamp(m - i * bm, max=bm).to(_F64)
    nc = torch.clamp(n - j * bn, max=bn).to(_F64)
    loads = [(prog, part * m_tiles + i, r * mc * e), (prog, part * n_tiles + j, r * nc * e)]
    if routed:
        loads.append((prog, part, r * (INDEX + INDEX * a_weighted)))
    to_slot = items.to_slot[item]
    parts = items.parts[item].to(_F64)
    grad = mc * nc * g
    alone = torch.where(to_slot, 0.0, grad if problem.accumulate else 0.0) + parts * mc * nc * 4
    stored = torch.where(to_slot, mc * nc * 4, grad)
    read, written = reuse_traffic(programs, loads, alone, stored, box.l2_bytes)
    if routed:
        read += _index_once(problem)
    padded_rows = int(((items.rows + bk - 1) // bk * bk).sum())
    mma = 2 * padded_rows * (m_tiles * bm) * (n_tiles * bn)
    transform = float((r * mc).sum()) * (2 * a_relu2 + a_weighted)
    finals = int((~items.to_slot).sum())
    other = transform + m * n * (finals * problem.accumulate + int(items.parts.sum()))
    return Cost(mma + other, read, written, mma_flops=mma, mma_rows=bm)


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
    """out[t] = the k rows of t (x's dtype) summed in fp32 and rounded (no shared expert: with
    one, its down GEMM's epilogue sums them, ``gemm_cost`` with ``epilogue_read="rows"``).

    Order: the grid (TB = ceil(t / BT), HT = ceil(H / BH)) runs the token block fastest. Each
    program loads its own k row slices (BT·k·BH·e) and the ids of its tokens (4·BT·k), which
    the HT column blocks of the token block share, TB programs apart. So: the rows [t·k, H] read
    once (passed from the down or dgrad-up GEMM: always counted), topk_ids once or per column
    block; out written (t·H·e). One add per row element read."""
    t, H, k = problem.tokens, problem.hidden, problem.top_k
    e = element_size(problem.dtype)
    box = machine(arch)
    tb, ht = triton.cdiv(t, rows_per_program), triton.cdiv(H, bh)
    pid = torch.arange(tb * ht)
    block, col = pid % tb, pid // tb
    rows = torch.clamp(t - block * rows_per_program, max=rows_per_program).to(_F64)
    cols = torch.clamp(H - col * bh, max=bh).to(_F64)
    read, stored = reuse_traffic(len(pid), [(pid, block, INDEX * k * rows)],
                                 rows * cols * k * e, rows * cols * e, box.l2_bytes)
    return Cost(t * H * k, read, stored)


def weight_grad_reduce_cost(problem, parts: int) -> Cost:
    """d_topk_weights[a] = sum of its ``parts`` fp32 partials (one per column tile of the
    dgrad-down GEMM, passed through HBM: counted): a 1-D grid, each program its own block of
    assignments: partials 4·parts·t·k and topk_ids read, 4·t·k written."""
    A = problem.assignments
    return Cost(parts * A, INDEX * A * (parts + 1), INDEX * A)
