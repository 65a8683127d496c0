"""The MoE router in Triton: one program per BT tokens holds their [BT, E] scores in registers;
selection is k rounds of (max, lowest index attaining it), so ties go to the lower index and the
result does not depend on the thread layout."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .compiler import KernelSpec, make_launcher, pointer_type

NEG_INF = tl.constexpr(float("-inf"))
NORM_EPS = tl.constexpr(1e-20)


@triton.jit
def lowest_argmax(values, index, NONE: tl.constexpr):
    """(max over axis 1, the lowest index attaining it) of values [BT, N]."""
    best = tl.max(values, axis=1)
    return best, tl.min(tl.where(values == best[:, None], index[None, :], NONE), axis=1)


@triton.jit
def moe_router_fwd_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, scale,
                          E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          BT: tl.constexpr, N_GROUP: tl.constexpr, GP: tl.constexpr,
                          TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    e = tl.arange(0, EP)
    e_ok = e < E
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + e[None, :],
                     mask=row_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    s = tl.sigmoid(logits)
    choice = s
    if HAS_BIAS:
        choice += tl.load(bias_ptr + e, mask=e_ok, other=0.0)[None, :]
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
    tl.store(weights_ptr + out, w, mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)


@triton.jit
def moe_router_bwd_kernel(logits_ptr, ids_ptr, dw_ptr, dlogits_ptr, T, scale,
                          E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                          BT: tl.constexpr, NORM: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    slot = tl.arange(0, KP)
    at_k = rows[:, None].to(tl.int64) * K + slot[None, :]
    ids = tl.load(ids_ptr + at_k, mask=row_ok[:, None] & (slot < K)[None, :], other=-1)
    ok = (ids >= 0) & (ids < E)
    r = tl.sigmoid(tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + ids, mask=ok,
                           other=0.0).to(tl.float32))
    r = tl.where(ok, r, 0.0)
    dw = tl.load(dw_ptr + at_k, mask=ok, other=0.0)
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
    tl.store(dlogits_ptr + rows[:, None].to(tl.int64) * E + e[None, :],
             grad.to(dlogits_ptr.dtype.element_ty), mask=row_ok[:, None] & (e < E)[None, :])


# -- specialisations and launchers ---------------------------------------------------------------
def _rows_per_program(problem) -> int:
    return max(1, min(64, 1024 // triton.next_power_of_2(problem.experts)))


def forward_spec(problem) -> KernelSpec:
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("bias_ptr", "*fp32"), ("weights_ptr", "*fp32"), ("ids_ptr", "*i32"),
            ("T", "i32"), ("scale", "fp32"))
    const = dict(E=problem.experts, EP=triton.next_power_of_2(problem.experts), K=problem.top_k,
                 KP=triton.next_power_of_2(problem.top_k), BT=_rows_per_program(problem),
                 N_GROUP=problem.n_group, GP=triton.next_power_of_2(problem.n_group),
                 TOPK_GROUP=problem.topk_group, NORM=problem.norm_topk_prob,
                 HAS_BIAS=problem.has_bias)
    return KernelSpec(moe_router_fwd_kernel, args + tuple((k, "constexpr") for k in const),
                      tuple(const.items()), num_warps=4)


def backward_spec(problem) -> KernelSpec:
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("ids_ptr", "*i32"), ("dw_ptr", "*fp32"), ("dlogits_ptr", lt),
            ("T", "i32"), ("scale", "fp32"))
    const = dict(E=problem.experts, EP=triton.next_power_of_2(problem.experts), K=problem.top_k,
                 KP=triton.next_power_of_2(problem.top_k), BT=_rows_per_program(problem),
                 NORM=problem.norm_topk_prob)
    return KernelSpec(moe_router_bwd_kernel, args + tuple((k, "constexpr") for k in const),
                      tuple(const.items()), num_warps=4)


def unsupported_reason(problem) -> str | None:
    if problem.logits_dtype == torch.float64:
        return "the Triton router takes fp32/bf16/fp16 logits, not float64 (use backend='torch')"
    return None


def _grid(problem):
    return (triton.cdiv(max(problem.tokens, 1), _rows_per_program(problem)), 1, 1)


def forward_launcher(problem):
    launch_kernel = make_launcher(forward_spec(problem), _grid(problem), problem.device)

    def launch(t, *, stream):
        bias = t["correction_bias"] if problem.has_bias else t["topk_weights"]
        launch_kernel(t["logits"], bias, t["topk_weights"], t["topk_ids"], problem.tokens,
                      problem.routed_scaling_factor, stream=stream)
    return launch


def backward_launcher(problem):
    launch_kernel = make_launcher(backward_spec(problem), _grid(problem), problem.device)

    def launch(t, *, stream):
        launch_kernel(t["logits"], t["topk_ids"], t["d_topk_weights"], t["d_logits"],
                      problem.tokens, problem.routed_scaling_factor, stream=stream)
    return launch


def aot_specs():
    """Nemotron 3 Nano (E=128, k=6, no groups, scale 2.5) and Super-like (E=512, k=22) routers,
    and a DeepSeek-style grouped one (E=256, 8 groups, top-4 groups, k=8)."""
    from fusedops.moe import RouterProblem
    cpu = torch.device("cpu")
    for label, E, k, groups, top_groups in (("nano E128 k6", 128, 6, 1, 1),
                                            ("super E512 k22", 512, 22, 1, 1),
                                            ("grouped E256 k8 g8/4", 256, 8, 8, 4)):
        p = RouterProblem(torch.float32, 8192, E, k, groups, top_groups, True, 2.5, True, cpu)
        yield f"router {label} fwd", forward_spec(p)
        yield f"router {label} bwd", backward_spec(p)
