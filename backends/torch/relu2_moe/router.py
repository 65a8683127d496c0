"""The MoE router in plain torch (fusedops.relu2_moe.contract): selection by stable sorts (ties to the
lower index; a NaN choice or group score ranks as -inf), weights and the backward in the compute
dtype (fp32, or fp64 for fp64 logits). Device ops only: the backward drops ids outside [0, E)
and reports those other than -1 in the status word. logits and d_logits may be strided views:
nothing here needs a contiguous row (no ``view``), and the results are copied into the plan's
outputs whatever their strides."""

from __future__ import annotations

import torch

from fusedops.core.status import Status
from fusedops.relu2_moe.contract import NORM_EPS

from ..common import direct_program, report, unsupported_reason

__all__ = ["backward_program", "forward_program", "router_backward", "router_forward", "select",
           "unsupported_reason", "weights_of"]


def _descending(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def _nan_lowest(values: torch.Tensor) -> torch.Tensor:
    """NaN replaced by -inf: it ranks below every number (torch's sort would put it first)."""
    return torch.where(torch.isnan(values), float("-inf"), values)


def select(logits, top_k, *, correction_bias=None, n_group=1, topk_group=1, compute_dtype=torch.float32):
    """(scores [t, E], ids [t, k] int64): sigmoid scores and the selected experts in descending
    order of choice = scores + correction_bias (NaN as -inf), group-limited when n_group > 1
    (a NaN group score as -inf; experts of the groups left out are never taken, even below a
    -inf choice)."""
    s = torch.sigmoid(logits.to(compute_dtype))
    choice = _nan_lowest(s if correction_bias is None else s + correction_bias.to(compute_dtype))
    t, E = choice.shape
    if n_group == 1:
        return s, _descending(choice, top_k)
    grouped = choice.unflatten(1, (n_group, E // n_group))
    best_two = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
    group_score = _nan_lowest(best_two[..., 0] + best_two[..., 1])
    keep = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, _descending(group_score, topk_group), True)
    eligible = keep[:, :, None].expand(t, n_group, E // n_group).reshape(t, E)
    order = _descending(choice, E)                      # by choice, ties to the lower index
    first = _descending(eligible.gather(1, order).to(torch.int8), top_k)   # eligible first
    return s, order.gather(1, first)


def weights_of(scores_selected, norm_topk_prob: bool, scale: float):
    """Routing weights from the selected scores [t, k]."""
    w = scores_selected
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + NORM_EPS)
    return w * scale


def router_forward(logits, top_k, *, correction_bias=None, n_group=1, topk_group=1,
                   norm_topk_prob=True, routed_scaling_factor=1.0, compute_dtype=torch.float32):
    """(topk_weights [t, k] compute_dtype, topk_ids [t, k] int32)."""
    s, ids = select(logits, top_k, correction_bias=correction_bias, n_group=n_group,
                    topk_group=topk_group, compute_dtype=compute_dtype)
    w = weights_of(s.gather(1, ids), norm_topk_prob, routed_scaling_factor)
    return w, ids.to(torch.int32)


def router_backward(logits, topk_ids, d_topk_weights, *, norm_topk_prob=True,
                    routed_scaling_factor=1.0, compute_dtype=torch.float32, status=None):
    """d_logits [t, E] (compute_dtype) with the selection held fixed: a repeated id gets the sum
    of its slots' terms in slot order; an id outside [0, E) is dropped (r = 0, d_w not read)
    and, unless -1, reported in ``status``."""
    t, E = logits.shape
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    report(status, Status.EXPERT_ID, ~valid & (ids != -1))
    zero = torch.zeros((), dtype=compute_dtype, device=logits.device)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    r = torch.where(valid, torch.sigmoid(logits.to(compute_dtype)).gather(1, safe), zero)
    dw = torch.where(valid, d_topk_weights.to(compute_dtype), zero)
    c = routed_scaling_factor
    if norm_topk_prob:
        S = r.sum(-1, keepdim=True) + NORM_EPS
        dr = c * (dw / S - (dw * r).sum(-1, keepdim=True) / (S * S))
    else:
        dr = c * dw
    d_sel = dr * r * (1 - r)
    d_logits = torch.zeros(t, E, dtype=compute_dtype, device=logits.device)
    experts = torch.arange(E, device=logits.device)
    for j in range(ids.shape[1]):       # slot order: a repeated id sums its slots in order
        hit = valid[:, j:j + 1] & (ids[:, j:j + 1] == experts)
        d_logits = torch.where(hit, d_logits + d_sel[:, j:j + 1], d_logits)
    return d_logits


def forward_program(problem):
    def run(b):
        w, ids = router_forward(b["logits"], problem.top_k, correction_bias=b.get("correction_bias"),
                                n_group=problem.n_group, topk_group=problem.topk_group,
                                norm_topk_prob=problem.norm_topk_prob,
                                routed_scaling_factor=problem.routed_scaling_factor,
                                compute_dtype=problem.compute_dtype)
        b["topk_weights"].copy_(w)
        b["topk_ids"].copy_(ids)
    return direct_program(run)


def backward_program(problem):
    def run(b):
        b["d_logits"].copy_(router_backward(
            b["logits"], b["topk_ids"], b["d_topk_weights"], norm_topk_prob=problem.norm_topk_prob,
            routed_scaling_factor=problem.routed_scaling_factor, compute_dtype=problem.compute_dtype,
            status=b.get("status")))
    return direct_program(run)
