"""The routed ReLU2 experts in plain torch (fusedops.relu2_moe.contract): a loop over the experts that
hold assignments, each on the rows routed to it, with the operator's rounding points (u, a, the
weighted rows per assignment and the weighted a of d_W_down in x's dtype; the sums over j and the
shared expert's product in the compute dtype, outputs rounded once). Per-assignment buffers
summed over j in order keep it deterministic on every device. The backward recomputes u: this
backend saves nothing.

The dispatch is a stable sort of the assignments by expert; the per-expert counts are read on
the host to split it (free on the CPU; a synchronisation on CUDA, so the torch backend is not
CUDA-graph capturable: the Triton backend is). An id outside [0, E) drops the assignment (it is
sorted past every expert and never read); one other than -1 sets Status.EXPERT_ID.

x and d_out may be strided views (their rows are gathered by index or multiplied in place, never
``view``-ed), and out and d_x are copied into whatever views the plan is handed.
"""

from __future__ import annotations

import torch

from fusedops.core.dtypes import accumulator_dtype
from fusedops.core.status import Status

from ..common import direct_program, report, unsupported_reason

__all__ = ["backward_program", "experts_backward", "experts_forward", "forward_program",
           "unsupported_reason"]


def _routing(ids: torch.Tensor, weights: torch.Tensor, experts: int, cd, status):
    """(ids int64 [t, k] with every dropped id -1, weights in cd with 0 where dropped); reports
    the ids outside [0, E) other than -1."""
    ids = ids.long()
    valid = (ids >= 0) & (ids < experts)
    report(status, Status.EXPERT_ID, ~valid & (ids != -1))
    return (torch.where(valid, ids, torch.full_like(ids, -1)),
            torch.where(valid, weights.to(cd), torch.zeros((), dtype=cd, device=ids.device)))


def _dispatch(ids: torch.Tensor, experts: int):
    """[(expert, assignment indices into the flattened [t·k] ids)] for every expert that holds
    assignments, in expert order; the rows of one expert in assignment order (a stable sort)."""
    flat = ids.reshape(-1)
    key = torch.where(flat < 0, torch.full_like(flat, experts), flat)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=experts + 1)[:experts].tolist()   # the host read
    out, start = [], 0
    for e, count in enumerate(counts):
        if count:
            out.append((e, order[start:start + count]))
        start += count
    return out


def _up(x_rows, w_up, cd):
    """(u, a) of one expert on its rows, rounded to x's dtype."""
    u = (x_rows.to(cd) @ w_up.to(cd).T).to(x_rows.dtype)
    return u, torch.relu(u.to(cd)).square().to(x_rows.dtype)


def _rounded(v, like):
    """``v`` (compute dtype) rounded to ``like``'s dtype and back."""
    return v.to(like.dtype).to(v.dtype)


def _expert_forward(x_rows, w_up, w_down, cd):
    """(u, a, y) of one expert on its rows: u, a rounded to x's dtype, y in cd."""
    u, a = _up(x_rows, w_up, cd)
    return u, a, a.to(cd) @ w_down.to(cd).T


def experts_forward(x, w_up, w_down, topk_ids, topk_weights, shared_w_up=None, shared_w_down=None,
                    status=None):
    """out [t, H] in x's dtype: sum_j round(w_tj · W_down[e] relu(W_up[e] x_t)²) (+ the shared
    expert), each weighted row rounded to x's dtype, summed in the compute dtype and rounded
    once."""
    cd = accumulator_dtype(x.dtype)
    t, H = x.shape
    k = topk_ids.shape[1]
    ids, weights = _routing(topk_ids, topk_weights, w_up.shape[0], cd, status)
    per_slot = torch.zeros(t * k, H, dtype=cd, device=x.device)
    flat_weights = weights.reshape(-1)
    for e, rows in _dispatch(ids, w_up.shape[0]):
        _, _, y = _expert_forward(x[rows // k], w_up[e], w_down[e], cd)
        per_slot.index_copy_(0, rows, _rounded(y * flat_weights[rows, None], x))
    out = per_slot.view(t, k, H).sum(1)
    if shared_w_up is not None:
        out = out + _expert_forward(x, shared_w_up, shared_w_down, cd)[2]
    return out.to(x.dtype)


def _expert_backward(x_rows, d_rows, weights, w_up, w_down, cd):
    """One expert's backward on its rows (x and d_out of the tokens routed to it, their routing
    weights): (<d_out, W_down a> per row, dx rows, d_w_up, d_w_down) in cd, with
    d_u = w · (W_downᵀ d_out) · 2relu(u) and w · a rounded to x's dtype per row (the dx rows
    stay in cd: the caller rounds the routed ones)."""
    u, a = _up(x_rows, w_up, cd)
    g = d_rows.to(cd) @ w_down.to(cd)                           # W_downᵀ d_out
    d_weight = (g * a.to(cd)).sum(-1)
    d_u = _rounded(weights[:, None] * g * 2 * torch.relu(u.to(cd)), x_rows)
    a_w = _rounded(weights[:, None] * a.to(cd), x_rows)
    return d_weight, d_u @ w_up.to(cd), d_u.T @ x_rows.to(cd), d_rows.to(cd).T @ a_w


def experts_backward(x, w_up, w_down, topk_ids, topk_weights, d_out, shared_w_up=None,
                     shared_w_down=None, status=None):
    """dict of d_x (x's dtype: the per-assignment rows rounded to it, summed with the shared
    expert's in the compute dtype and rounded once), d_topk_weights and the weight gradients
    (compute dtype)."""
    cd = accumulator_dtype(x.dtype)
    t, H = x.shape
    k = topk_ids.shape[1]
    ids, weights = _routing(topk_ids, topk_weights, w_up.shape[0], cd, status)
    per_slot = torch.zeros(t * k, H, dtype=cd, device=x.device)
    d_weights = torch.zeros(t * k, dtype=cd, device=x.device)
    d_w_up = torch.zeros(w_up.shape, dtype=cd, device=x.device)
    d_w_down = torch.zeros(w_down.shape, dtype=cd, device=x.device)
    flat_weights = weights.reshape(-1)
    for e, rows in _dispatch(ids, w_up.shape[0]):
        tokens = rows // k
        dw, dx, d_w_up[e], d_w_down[e] = _expert_backward(x[tokens], d_out[tokens],
                                                          flat_weights[rows], w_up[e], w_down[e], cd)
        d_weights.index_copy_(0, rows, dw)
        per_slot.index_copy_(0, rows, _rounded(dx, x))
    d_x = per_slot.view(t, k, H).sum(1)
    grads = dict(d_topk_weights=d_weights.view(t, k), d_w_up=d_w_up, d_w_down=d_w_down)
    if shared_w_up is not None:
        _, dx, grads["d_shared_w_up"], grads["d_shared_w_down"] = _expert_backward(
            x, d_out, torch.ones(t, dtype=cd, device=x.device), shared_w_up, shared_w_down, cd)
        d_x = d_x + dx
    grads["d_x"] = d_x.to(x.dtype)
    return grads


def _shared(b):
    return dict(shared_w_up=b.get("shared_w_up"), shared_w_down=b.get("shared_w_down"),
                status=b.get("status"))


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
