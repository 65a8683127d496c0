"""The MoE router in plain torch (fusedops.moe.contract): selection by stable sorts (ties to the
lower index), weights and the backward in the compute dtype (fp32, or fp64 for fp64 logits)."""

from __future__ import annotations

import torch

from fusedops.moe.contract import NORM_EPS

from .common import direct_program, unsupported_reason

__all__ = ["backward_program", "forward_program", "router_backward", "router_forward", "select",
           "unsupported_reason", "weights_of"]


def _descending(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the last dim, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select(logits, top_k, *, correction_bias=None, n_group=1, topk_group=1, compute_dtype=torch.float32):
    """(scores [t, E], ids [t, k] int64): sigmoid scores and the selected experts in descending
    order of choice = scores + correction_bias, group-limited when n_group > 1."""
    s = torch.sigmoid(logits.to(compute_dtype))
    choice = s if correction_bias is None else s + correction_bias.to(compute_dtype)
    t, E = choice.shape
    if n_group > 1:
        grouped = choice.view(t, n_group, E // n_group)
        best_two = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :2]
        group_score = best_two[..., 0] + best_two[..., 1]
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, _descending(group_score, topk_group), True)
        eligible = keep[:, :, None].expand(t, n_group, E // n_group).reshape(t, E)
        choice = choice.masked_fill(~eligible, float("-inf"))
    return s, _descending(choice, top_k)


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
                    routed_scaling_factor=1.0, compute_dtype=torch.float32):
    """d_logits [t, E] (compute_dtype) with the selection held fixed; ids outside [0, E) are
    skipped."""
    t, E = logits.shape
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < E)
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    r = torch.sigmoid(logits.to(compute_dtype)).gather(1, safe) * valid
    dw = d_topk_weights.to(compute_dtype) * valid
    c = routed_scaling_factor
    if norm_topk_prob:
        S = r.sum(-1, keepdim=True) + NORM_EPS
        dr = c * (dw / S - (dw * r).sum(-1, keepdim=True) / (S * S))
    else:
        dr = c * dw
    d_logits = torch.zeros(t, E, dtype=compute_dtype, device=logits.device)
    d_logits.scatter_add_(1, safe, torch.where(valid, dr * r * (1 - r), torch.zeros_like(dr)))
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
            routed_scaling_factor=problem.routed_scaling_factor, compute_dtype=problem.compute_dtype))
    return direct_program(run)
