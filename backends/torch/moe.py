"""The routed ReLU2 experts in plain torch (fusedops.moe.contract): a loop over the experts that
hold tokens, with the operator's rounding points (u and a in x's dtype, y and the sums in the
compute dtype, outputs rounded once). Per-assignment buffers summed over j in order keep it
deterministic on every device. The backward recomputes u: this backend saves nothing. It loops
over the experts on the host (a device read): a reference, not a graph-capturable path.
"""

from __future__ import annotations

import torch

from fusedops.core.dtypes import accumulator_dtype

from .common import direct_program, unsupported_reason

__all__ = ["backward_program", "experts_backward", "experts_forward", "forward_program",
           "unsupported_reason"]


def _assignments(ids: torch.Tensor, experts: int):
    """[(e, token index, slot index)] for the experts that hold assignments, in expert order;
    the order within an expert is the flat assignment order t·k + j."""
    flat = ids.reshape(-1).long()
    k = ids.shape[1]
    valid = (flat >= 0) & (flat < experts)
    order = torch.argsort(torch.where(valid, flat, torch.full_like(flat, experts)), stable=True)
    counts = torch.bincount(flat[valid], minlength=experts).tolist()
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            a = order[start:start + n]
            groups.append((e, a // k, a % k))
        start += n
    return groups


def _expert_forward(x_rows, w_up, w_down, cd):
    """(u, a, y) of one expert on its rows: u, a rounded to x's dtype, y in cd."""
    u = (x_rows.to(cd) @ w_up.to(cd).T).to(x_rows.dtype)
    a = torch.relu(u.to(cd)).square().to(x_rows.dtype)
    return u, a, a.to(cd) @ w_down.to(cd).T


def experts_forward(x, w_up, w_down, topk_ids, topk_weights, shared_w_up=None, shared_w_down=None):
    """out [t, H] in x's dtype: sum_j w_tj · W_down[e] relu(W_up[e] x_t)² (+ the shared expert),
    summed in the compute dtype and rounded once."""
    cd = accumulator_dtype(x.dtype)
    t, H = x.shape
    k = topk_ids.shape[1]
    per_slot = torch.zeros(t, k, H, dtype=cd, device=x.device)
    for e, tok, slot in _assignments(topk_ids, w_up.shape[0]):
        _, _, y = _expert_forward(x[tok], w_up[e], w_down[e], cd)
        per_slot[tok, slot] = y * topk_weights[tok, slot].to(cd)[:, None]
    out = per_slot.sum(1)
    if shared_w_up is not None:
        out = out + _expert_forward(x, shared_w_up, shared_w_down, cd)[2]
    return out.to(x.dtype)


def _expert_backward(x_rows, d_out_rows, scale, w_up, w_down, cd):
    """One expert's backward on its rows: (d_weight, dx rows, d_w_up, d_w_down) in cd, with
    d_y = scale · d_out rounded to x's dtype as the weight-gradient operand."""
    u, a, _ = _expert_forward(x_rows, w_up, w_down, cd)
    g = d_out_rows.to(cd) @ w_down.to(cd)                       # W_downᵀ d_out
    d_weight = (g * a.to(cd)).sum(-1)                           # <d_out, W_down a>
    relu_u = torch.relu(u.to(cd))
    d_u = (scale[:, None] * g * 2 * relu_u).to(x_rows.dtype)
    d_y = (scale[:, None] * d_out_rows.to(cd)).to(x_rows.dtype)
    dx_rows = d_u.to(cd) @ w_up.to(cd)
    return d_weight, dx_rows, d_u.to(cd).T @ x_rows.to(cd), d_y.to(cd).T @ a.to(cd)


def experts_backward(x, w_up, w_down, topk_ids, topk_weights, d_out, shared_w_up=None,
                     shared_w_down=None):
    """dict of d_x (x's dtype), d_topk_weights and the weight gradients (compute dtype)."""
    cd = accumulator_dtype(x.dtype)
    t, H = x.shape
    k = topk_ids.shape[1]
    per_slot = torch.zeros(t, k, H, dtype=cd, device=x.device)
    d_weights = torch.zeros(t, k, dtype=cd, device=x.device)
    d_w_up = torch.zeros(w_up.shape, dtype=cd, device=x.device)
    d_w_down = torch.zeros(w_down.shape, dtype=cd, device=x.device)
    for e, tok, slot in _assignments(topk_ids, w_up.shape[0]):
        dw, dx, d_w_up[e], d_w_down[e] = _expert_backward(
            x[tok], d_out[tok], topk_weights[tok, slot].to(cd), w_up[e], w_down[e], cd)
        d_weights[tok, slot] = dw
        per_slot[tok, slot] = dx
    d_x = per_slot.sum(1)
    grads = dict(d_topk_weights=d_weights, d_w_up=d_w_up, d_w_down=d_w_down)
    if shared_w_up is not None:
        _, dx, grads["d_shared_w_up"], grads["d_shared_w_down"] = _expert_backward(
            x, d_out, torch.ones(t, dtype=cd, device=x.device), shared_w_up, shared_w_down, cd)
        d_x = d_x + dx
    grads["d_x"] = d_x.to(x.dtype)
    return grads


def _shared(b):
    return dict(shared_w_up=b.get("shared_w_up"), shared_w_down=b.get("shared_w_down"))


def forward_program(problem):
    def run(b):
        b["out"].copy_(experts_forward(b["x"], b["w_up"], b["w_down"], b["topk_ids"],
                                       b["topk_weights"], **_shared(b)))
    return direct_program(run)


def backward_program(problem):
    accumulated = ("d_w_up", "d_w_down", "d_shared_w_up", "d_shared_w_down")

    def run(b):
        grads = experts_backward(b["x"], b["w_up"], b["w_down"], b["topk_ids"], b["topk_weights"],
                                 b["d_out"], **_shared(b))
        for name, value in grads.items():
            if problem.accumulate and name in accumulated:
                b[name].copy_(b[name].to(value.dtype) + value)
            else:
                b[name].copy_(value)
    return direct_program(run)
