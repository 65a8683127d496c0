"""The MoE router in Triton (fusedops.relu2_moe.contract): one program per BT tokens holds their
[BT, E] scores in registers; selection is k rounds of (max, lowest index attaining it) over the
experts still available, so ties go to the lower index and the result does not depend on the
thread layout. A NaN choice (or group) score is replaced by -inf before any reduction, and the
available set (eligible, not yet taken) is a mask rather than a -inf value, so the k ids are
always distinct eligible experts in [0, E) whatever the logits hold. The backward drops ids
outside [0, E) and reports those other than -1 in the status word. Tokens per program come from
the router's per-architecture table (tiles.ROUTER_TILES, ``config=`` a candidate).

logits and d_logits may be strided views: the kernels take their row strides at launch in units
of VEC elements (a 16-byte vector, the contract's ``row_vector``; 1 where a row of E logits is
not a whole number of vectors and the plans take them contiguous)."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size, kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride
from fusedops.core.status import Status
from fusedops.relu2_moe.contract import NORM_EPS, ROUTER_FLOPS_PER_SCORE

from .tiles import RouterTiles, router_candidates, router_tiles_for
from ..runtime import KernelSpec, pointer_type
from ..primitives import report

NEG_INF = tl.constexpr(float("-inf"))
EXPERT_ID = tl.constexpr(int(Status.EXPERT_ID))


@triton.jit
def nan_lowest(values):
    """NaN replaced by -inf: it ranks below every number."""
    return tl.where(values != values, NEG_INF, values)


@triton.jit
def lowest_argmax(values, avail, index, NONE: tl.constexpr):
    """(max over axis 1 of the available entries, the lowest available index attaining it) of
    values [BT, N] without NaN; every row has an available entry."""
    masked = tl.where(avail, values, NEG_INF)
    best = tl.max(masked, axis=1)
    return best, tl.min(tl.where(avail & (masked == best[:, None]), index[None, :], NONE), axis=1)


@triton.jit
def moe_router_fwd_kernel(logits_ptr, correction_bias_ptr, topk_weights_ptr, topk_ids_ptr, T,
                          scale, stride_logits, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                          KP: tl.constexpr, BT: tl.constexpr, N_GROUP: tl.constexpr,
                          GP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                          NORM_EPS: tl.constexpr, HAS_BIAS: tl.constexpr, VEC: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    e = tl.arange(0, EP)
    e_ok = e < E
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * (stride_logits * VEC) + e[None, :],
                     mask=row_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    s = tl.sigmoid(logits)
    choice = s
    if HAS_BIAS:
        choice += tl.load(correction_bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    choice = nan_lowest(choice)
    avail = tl.broadcast_to(e_ok[None, :], [BT, EP])       # the real experts, not yet taken
    if N_GROUP > 1:
        group = e // (E // N_GROUP)            # >= N_GROUP for the padding columns
        g = tl.arange(0, GP)
        group_score = tl.full([BT, GP], NEG_INF, tl.float32)
        for gi in tl.static_range(N_GROUP):
            member = avail & (group == gi)[None, :]
            first, at = lowest_argmax(choice, member, e, EP)
            second, _ = lowest_argmax(choice, member & (e[None, :] != at[:, None]), e, EP)
            group_score = tl.where((g == gi)[None, :], nan_lowest(first + second)[:, None],
                                   group_score)
        open_group = tl.broadcast_to((g < N_GROUP)[None, :], [BT, GP])
        eligible = tl.zeros([BT, EP], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, pick = lowest_argmax(group_score, open_group, g, GP)
            eligible = eligible | (group[None, :] == pick[:, None])
            open_group = open_group & (g[None, :] != pick[:, None])
        avail = avail & eligible
    slot = tl.arange(0, KP)
    w = tl.zeros([BT, KP], dtype=tl.float32)
    ids = tl.zeros([BT, KP], dtype=tl.int32)
    for j in tl.static_range(K):
        _, at = lowest_argmax(choice, avail, e, EP)
        hit = e[None, :] == at[:, None]
        w = tl.where((slot == j)[None, :], tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], w)
        ids = tl.where((slot == j)[None, :], at[:, None], ids)
        avail = avail & (e[None, :] != at[:, None])
    if NORM:
        w = w / (tl.sum(w, axis=1) + NORM_EPS)[:, None]
    w = w * scale
    out = rows[:, None].to(tl.int64) * K + slot[None, :]
    ok = row_ok[:, None] & (slot < K)[None, :]
    tl.store(topk_weights_ptr + out, w, mask=ok)
    tl.store(topk_ids_ptr + out, ids, mask=ok)


@triton.jit
def moe_router_bwd_kernel(logits_ptr, topk_ids_ptr, d_topk_weights_ptr, d_logits_ptr, status_ptr,
                          T, scale, stride_logits, stride_d_logits, E: tl.constexpr,
                          EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr,
                          NORM: tl.constexpr, NORM_EPS: tl.constexpr, HAS_STATUS: tl.constexpr,
                          VEC: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    slot = tl.arange(0, KP)
    at_k = rows[:, None].to(tl.int64) * K + slot[None, :]
    ids = tl.load(topk_ids_ptr + at_k, mask=row_ok[:, None] & (slot < K)[None, :], other=-1)
    ok = (ids >= 0) & (ids < E)
    report(status_ptr, ~ok & (ids != -1), EXPERT_ID, HAS_STATUS)    # -1: padding, no bit
    r = tl.sigmoid(tl.load(logits_ptr + rows[:, None].to(tl.int64) * (stride_logits * VEC) + ids,
                           mask=ok, other=0.0).to(tl.float32))
    r = tl.where(ok, r, 0.0)
    dw = tl.load(d_topk_weights_ptr + at_k, mask=ok, other=0.0)
    if NORM:
        total = tl.sum(r, axis=1)[:, None] + NORM_EPS
        dr = scale * (dw / total - tl.sum(dw * r, axis=1)[:, None] / (total * total))
    else:
        dr = scale * dw
    d_sel = tl.where(ok, dr * r * (1.0 - r), 0.0)
    ids = tl.where(ok, ids, -1)
    e = tl.arange(0, EP)
    grad = tl.zeros([BT, EP], dtype=tl.float32)
    for j in tl.static_range(K):        # slot order: a repeated id sums its slots in order
        in_slot = (slot == j)[None, :]
        at = tl.sum(tl.where(in_slot, ids, 0), axis=1)
        grad = tl.where(e[None, :] == at[:, None],
                        grad + tl.sum(tl.where(in_slot, d_sel, 0.0), axis=1)[:, None], grad)
    tl.store(d_logits_ptr + rows[:, None].to(tl.int64) * (stride_d_logits * VEC) + e[None, :],
             grad.to(d_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & (e < E)[None, :])


# -- specialisations and programs ----------------------------------------------------------------
SECTOR = 32     # bytes: the DRAM access granularity a gathered 4-byte logit costs


def _rows_per_program(problem, tiles: RouterTiles) -> int:
    return max(1, min(64, tiles.scores // triton.next_power_of_2(problem.experts)))


def _grid(problem, tiles: RouterTiles) -> tuple[int]:
    return (triton.cdiv(max(problem.tokens, 1), _rows_per_program(problem, tiles)),)


def _constexprs(problem, tiles: RouterTiles) -> dict:
    return dict(E=problem.experts, EP=triton.next_power_of_2(problem.experts), K=problem.top_k,
                KP=triton.next_power_of_2(problem.top_k), BT=_rows_per_program(problem, tiles),
                VEC=problem.row_vector)


def _strides(problem, *tensors: str) -> dict:
    """The row strides of the [t, E] views, in vectors of ``problem.row_vector`` elements."""
    return {f"stride_{name}": Stride(name, 0, problem.row_vector) for name in tensors}


def forward_cost(problem) -> Cost:
    """A 1-D grid, one program per BT tokens in token order (docs/performance.md, "How traffic
    is counted"): no two programs load the same logits, so each token's logits row counts once
    (t·E·l; the padded columns past E are masked); the bias, which every program loads in full
    (4·E bytes, in L2), once; topk_weights and topk_ids written (t·k·(4 + 4)).
    FLOPs per score: the sigmoid, the bias add and k selection rounds of a max and a compare
    (ROUTER_FLOPS_PER_SCORE + 2·(k - 1)), and the group scores (4 per score and group round)
    when grouped."""
    t, E, k = problem.tokens, problem.experts, problem.top_k
    read = t * E * element_size(problem.logits_dtype) + (4 * E if problem.has_bias else 0)
    groups = 4 * (problem.n_group + problem.topk_group) if problem.n_group > 1 else 0
    flops = t * E * (ROUTER_FLOPS_PER_SCORE + 2 * (k - 1) + groups)
    return Cost(flops, read, t * k * 8)


def backward_cost(problem) -> Cost:
    """A 1-D grid, one program per BT tokens, each loading only its own tokens' data (no re-read
    to credit): topk_ids and d_topk_weights read (t·k·(4 + 4)); the k selected logits of each
    token are gathered, one 32-byte sector each (at most the whole row, t·min(k·32, E·l));
    d_logits [t, E] written whole (zeros off the selection). FLOPs: about 12 per slot for the
    sigmoid and the normalisation terms, and the slot-order scatter (2 per score and slot)."""
    t, E, k = problem.tokens, problem.experts, problem.top_k
    l = element_size(problem.logits_dtype)
    read = t * k * 8 + t * min(k * SECTOR, E * l)
    return Cost(t * k * 12 + 2 * t * E * k, read, t * E * l)


def forward_spec(problem, tiles: RouterTiles | None = None) -> KernelSpec:
    tiles = tiles or router_tiles_for(problem)
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("correction_bias_ptr", "*fp32" if problem.has_bias else None),
            ("topk_weights_ptr", "*fp32"), ("topk_ids_ptr", "*i32"), ("T", "i32"),
            ("scale", "fp32"), ("stride_logits", "i32"))
    const = dict(_constexprs(problem, tiles), N_GROUP=problem.n_group,
                 GP=triton.next_power_of_2(problem.n_group), TOPK_GROUP=problem.topk_group,
                 NORM=problem.norm_topk_prob, NORM_EPS=NORM_EPS, HAS_BIAS=problem.has_bias)
    return KernelSpec.make(moe_router_fwd_kernel, args, const, _grid(problem, tiles),
                           num_warps=tiles.warps, cost=forward_cost(problem))


def backward_spec(problem, tiles: RouterTiles | None = None) -> KernelSpec:
    tiles = tiles or router_tiles_for(problem)
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("topk_ids_ptr", "*i32"), ("d_topk_weights_ptr", "*fp32"),
            ("d_logits_ptr", lt), ("status_ptr", "*i32" if problem.has_status else None),
            ("T", "i32"), ("scale", "fp32"), ("stride_logits", "i32"), ("stride_d_logits", "i32"))
    const = dict(_constexprs(problem, tiles), NORM=problem.norm_topk_prob, NORM_EPS=NORM_EPS,
                 HAS_STATUS=problem.has_status)
    return KernelSpec.make(moe_router_bwd_kernel, args, const, _grid(problem, tiles),
                           num_warps=tiles.warps, cost=backward_cost(problem))


# -- the backend surface ---------------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton router kernels", problem.logits_dtype)


def forward_program(problem, config: RouterTiles | None = None) -> Program:
    return Program(stages=(Stage(forward_spec(problem, config), dict(
        T=problem.tokens, scale=problem.routed_scaling_factor,
        **_strides(problem, "logits"))),))


def backward_program(problem, config: RouterTiles | None = None) -> Program:
    return Program(stages=(Stage(backward_spec(problem, config), dict(
        T=problem.tokens, scale=problem.routed_scaling_factor,
        **_strides(problem, "logits", "d_logits"))),))


forward_candidates = router_candidates
backward_candidates = router_candidates
