"""Independent float64 math of the MoE contract, differentiated by autograd: written from the
contract, separately from the torch backend (token by token, assignment by assignment, with
explicit tie rules), so the reference is checked against math it does not share code with."""

from __future__ import annotations

import math

import torch

WEIGHT_NAMES = ("x", "w_up", "w_down", "topk_weights", "shared_w_up", "shared_w_down")


def _nan_lowest(value: float) -> float:
    return float("-inf") if math.isnan(value) else value


def router(logits, top_k, bias=None, n_group=1, topk_group=1, norm=True, scale=1.0):
    """The router token by token in float64 with explicit tie rules (the lower index wins; a NaN
    choice or group score ranks as -inf); returns (weights [t, k] float64, differentiable
    w.r.t. logits; ids [t, k] int64)."""
    s = torch.sigmoid(logits.double())
    choice = [[_nan_lowest(v) for v in row]
              for row in (s + (bias.double() if bias is not None else 0.0)).detach().tolist()]
    t, E = s.shape
    size = E // n_group
    ids = []
    for row in choice:
        eligible = set(range(E))
        if n_group > 1:
            def group_score(g):
                best = sorted(row[g * size:(g + 1) * size], reverse=True)
                return _nan_lowest(best[0] + best[1])
            groups = sorted(range(n_group), key=lambda g: (-group_score(g), g))[:topk_group]
            eligible = {e for e in range(E) if e // size in groups}
        ids.append(sorted(eligible, key=lambda e: (-row[e], e))[:top_k])
    ids = torch.tensor(ids, dtype=torch.int64, device=logits.device).reshape(t, top_k)
    w = s.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def experts(x, w_up, w_down, ids, weights, shared_w_up=None, shared_w_down=None):
    """The experts assignment by assignment in float64 (no intermediate rounding); ids outside
    [0, E) contribute nothing. Differentiable by autograd."""
    x, w_up, w_down, weights = (v.double() for v in (x, w_up, w_down, weights))
    t, k = ids.shape
    rows = []
    for i in range(t):
        out = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
        for j in range(k):
            e = int(ids[i, j])
            if 0 <= e < w_up.shape[0]:
                a = torch.relu(w_up[e] @ x[i]) ** 2
                out = out + weights[i, j] * (w_down[e] @ a)
        if shared_w_up is not None:
            out = out + shared_w_down.double() @ torch.relu(shared_w_up.double() @ x[i]) ** 2
        rows.append(out)
    return torch.stack(rows)


def expert_results(tensors) -> dict[str, torch.Tensor]:
    """out and every gradient (d_x, d_topk_weights, d_w_up, d_w_down[, d_shared_w_up,
    d_shared_w_down]) of the expert path for ``tensors`` (x, w_up, w_down, topk_ids,
    topk_weights, d_out and optionally the shared expert), in float64 on the CPU."""
    names = [n for n in WEIGHT_NAMES if tensors.get(n) is not None]
    leaves = {n: tensors[n].detach().cpu().double().requires_grad_() for n in names}
    out = experts(leaves["x"], leaves["w_up"], leaves["w_down"], tensors["topk_ids"].cpu(),
                  leaves["topk_weights"], leaves.get("shared_w_up"), leaves.get("shared_w_down"))
    grads = torch.autograd.grad(out, list(leaves.values()), tensors["d_out"].cpu().double())
    return dict(out=out.detach(), **{"d_" + n: g for n, g in zip(names, grads)})


def oracle(case) -> dict[str, torch.Tensor]:
    """Every result of an MoE case (the names ``samples.run`` returns), in float64: the router's
    weights and ids, the experts' out and gradients, and d_logits through the weights (a
    router-only case, without expert weights: d_logits from its own d_topk_weights)."""
    t = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.tensors.items()}
    o = case.options
    logits = t["logits"].double().requires_grad_()
    weights, ids = router(logits, o["top_k"], t.get("correction_bias"), o.get("n_group", 1),
                          o.get("topk_group", 1), o.get("norm_topk_prob", True),
                          o.get("routed_scaling_factor", 1.0))
    if t.get("x") is None:
        d_logits, = torch.autograd.grad(weights, logits, t["d_topk_weights"].double())
        return dict(topk_weights=weights.detach(), topk_ids=ids.to(torch.int32),
                    d_logits=d_logits)
    results = expert_results(dict(t, topk_ids=ids, topk_weights=weights.detach()))
    d_logits, = torch.autograd.grad(weights, logits, results["d_topk_weights"])
    return dict(topk_weights=weights.detach(), topk_ids=ids.to(torch.int32), **results,
                d_logits=d_logits)
