"""The MoE router in Triton (fusedops.moe.contract): one program per BT tokens holds their
[BT, E] scores in registers; selection is k rounds of (max, lowest index attaining it), so ties
go to the lower index and the result does not depend on the thread layout."""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage
from fusedops.moe.contract import NORM_EPS

from .runtime import KernelSpec, pointer_type

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def lowest_argmax(values, index, NONE: tl.constexpr):
    """(max over axis 1, the lowest index attaining it) of values [BT, N]."""
    best = tl.max(values, axis=1)
    return best, tl.min(tl.where(values == best[:, None], index[None, :], NONE), axis=1)


@triton.jit
def moe_router_fwd_kernel(logits_ptr, correction_bias_ptr, topk_weights_ptr, topk_ids_ptr, T,
                          scale, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                          KP: tl.constexpr, BT: tl.constexpr, N_GROUP: tl.constexpr,
                          GP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                          NORM_EPS: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    e = tl.arange(0, EP)
    e_ok = e < E
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + e[None, :],
                     mask=row_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    s = tl.sigmoid(logits)
    choice = s
    if HAS_BIAS:
        choice += tl.load(correction_bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    choice = tl.where(e_ok[None, :], choice, NEG_INF)
    if N_GROUP > 1:
        group = e // (E // N_GROUP)            # >= N_GROUP for the padding columns
        g = tl.arange(0, GP)
        group_score = tl.full([BT, GP], NEG_INF, tl.float32)
        for gi in tl.static_range(N_GROUP):
            member = tl.where((group == gi)[None, :], choice, NEG_INF)
            first, at = lowest_argmax(member, e, EP)
            second = tl.max(tl.where(e[None, :] == at[:, None], NEG_INF, member), axis=1)
            group_score = tl.where((g == gi)[None, :], (first + second)[:, None], group_score)
        eligible = tl.zeros([BT, EP], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            _, pick = lowest_argmax(group_score, g, GP)
            eligible = eligible | (group[None, :] == pick[:, None])
            group_score = tl.where(g[None, :] == pick[:, None], NEG_INF, group_score)
        choice = tl.where(eligible, choice, NEG_INF)
    slot = tl.arange(0, KP)
    w = tl.zeros([BT, KP], dtype=tl.float32)
    ids = tl.zeros([BT, KP], dtype=tl.int32)
    for j in tl.static_range(K):
        _, at = lowest_argmax(choice, e, EP)
        hit = e[None, :] == at[:, None]
        w = tl.where((slot == j)[None, :], tl.sum(tl.where(hit, s, 0.0), axis=1)[:, None], w)
        ids = tl.where((slot == j)[None, :], at[:, None], ids)
        choice = tl.where(hit, NEG_INF, choice)
    if NORM:
        w = w / (tl.sum(w, axis=1) + NORM_EPS)[:, None]
    w = w * scale
    out = rows[:, None].to(tl.int64) * K + slot[None, :]
    ok = row_ok[:, None] & (slot < K)[None, :]
    tl.store(topk_weights_ptr + out, w, mask=ok)
    tl.store(topk_ids_ptr + out, ids, mask=ok)


@triton.jit
def moe_router_bwd_kernel(logits_ptr, topk_ids_ptr, d_topk_weights_ptr, d_logits_ptr, T, scale,
                          E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          BT: tl.constexpr, NORM: tl.constexpr, NORM_EPS: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    slot = tl.arange(0, KP)
    at_k = rows[:, None].to(tl.int64) * K + slot[None, :]
    ids = tl.load(topk_ids_ptr + at_k, mask=row_ok[:, None] & (slot < K)[None, :], other=-1)
    ok = (ids >= 0) & (ids < E)
    r = tl.sigmoid(tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + ids, mask=ok,
                           other=0.0).to(tl.float32))
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
    for j in tl.static_range(K):
        in_slot = (slot == j)[None, :]
        at = tl.sum(tl.where(in_slot, ids, 0), axis=1)
        grad = tl.where(e[None, :] == at[:, None], tl.sum(tl.where(in_slot, d_sel, 0.0), axis=1)[:, None],
                        grad)
    tl.store(d_logits_ptr + rows[:, None].to(tl.int64) * E + e[None, :],
             grad.to(d_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & (e < E)[None, :])


# -- specialisations and programs ----------------------------------------------------------------
def _rows_per_program(problem) -> int:
    return max(1, min(64, 1024 // triton.next_power_of_2(problem.experts)))


def _grid(problem) -> tuple[int]:
    return (triton.cdiv(max(problem.tokens, 1), _rows_per_program(problem)),)


def _constexprs(problem) -> dict:
    return dict(E=problem.experts, EP=triton.next_power_of_2(problem.experts), K=problem.top_k,
                KP=triton.next_power_of_2(problem.top_k), BT=_rows_per_program(problem))


def forward_spec(problem) -> KernelSpec:
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("correction_bias_ptr", "*fp32" if problem.has_bias else None),
            ("topk_weights_ptr", "*fp32"), ("topk_ids_ptr", "*i32"), ("T", "i32"),
            ("scale", "fp32"))
    const = dict(_constexprs(problem), N_GROUP=problem.n_group,
                 GP=triton.next_power_of_2(problem.n_group), TOPK_GROUP=problem.topk_group,
                 NORM=problem.norm_topk_prob, NORM_EPS=NORM_EPS, HAS_BIAS=problem.has_bias)
    return KernelSpec.make(moe_router_fwd_kernel, args, const, _grid(problem))


def backward_spec(problem) -> KernelSpec:
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("topk_ids_ptr", "*i32"), ("d_topk_weights_ptr", "*fp32"),
            ("d_logits_ptr", lt), ("T", "i32"), ("scale", "fp32"))
    const = dict(_constexprs(problem), NORM=problem.norm_topk_prob, NORM_EPS=NORM_EPS)
    return KernelSpec.make(moe_router_bwd_kernel, args, const, _grid(problem))


# -- the backend surface ---------------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton router kernels", problem.logits_dtype)


def forward_program(problem) -> Program:
    return Program(stages=(Stage(forward_spec(problem), dict(
        T=problem.tokens, scale=problem.routed_scaling_factor)),))


def backward_program(problem) -> Program:
    return Program(stages=(Stage(backward_spec(problem), dict(
        T=problem.tokens, scale=problem.routed_scaling_factor)),))
