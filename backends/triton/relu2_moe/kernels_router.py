"""The MoE router's Triton kernels (fusedops.relu2_moe.contract): one program per BT tokens holds
their [BT, E] scores in registers; selection is k rounds of (max, lowest index attaining it) over the
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

from fusedops.core.status import Status

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
