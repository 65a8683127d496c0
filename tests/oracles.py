"""Independent float64 implementations of the operator contracts, differentiated by autograd.

Written from the specs, separately from fusedops.backends.torch, so the reference backend is
checked against math it does not share code with.
"""

from __future__ import annotations

import torch


def mamba2_sequential(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      dt_limit=(0.0, float("inf")), initial_states=None, cu_seqlens=None):
    """specs/mamba2.md forward as the token-by-token recurrence, in float64; returns
    (y [b, l, h, p], final_states [nseq, h, p, n]). Differentiable by autograd."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    u = dt + (dt_bias.double() if dt_bias is not None else 0.0)
    if dt_softplus:
        u = torch.where(u > 20.0, u, torch.log1p(torch.exp(torch.clamp(u, max=20.0))))
    dtv = torch.clamp(u, min=dt_limit[0], max=dt_limit[1])
    if cu_seqlens is None:
        spans = [(row, 0, l) for row in range(b)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
    heads_per_group = h // g
    ys = torch.zeros(b, l, h, p, dtype=torch.float64, device=x.device)
    finals = []
    for s, (row, t0, t1) in enumerate(spans):
        state = (initial_states[s].double().clone() if initial_states is not None
                 else torch.zeros(h, p, n, dtype=torch.float64, device=x.device))
        rows = []
        for t in range(t0, t1):
            Bt = B[row, t].repeat_interleave(heads_per_group, 0)        # [h, n]
            Ct = C[row, t].repeat_interleave(heads_per_group, 0)
            decay = torch.exp(dtv[row, t] * A.double())                  # [h]
            state = decay[:, None, None] * state + (dtv[row, t][:, None] * x[row, t])[..., None] * Bt[:, None, :]
            yt = torch.einsum("hpn,hn->hp", state, Ct)
            if D is not None:
                yt = yt + (D.double()[:, None] if D.dim() == 1 else D.double()) * x[row, t]
            if z is not None:
                zt = z[row, t].double()
                yt = yt * zt * torch.sigmoid(zt)
            rows.append(yt)
        if rows:
            ys = ys.index_put((torch.tensor([row] * len(rows)), torch.arange(t0, t1)), torch.stack(rows))
        finals.append(state)
    return ys, torch.stack(finals)


def moe_router(logits, top_k, bias=None, n_group=1, topk_group=1, norm=True, scale=1.0):
    """specs/moe.md router token by token in float64 with explicit tie rules (the lower index
    wins); returns (weights [t, k] float64 differentiable w.r.t. logits, ids [t, k] int64)."""
    s = torch.sigmoid(logits.double())
    choice = (s + (bias.double() if bias is not None else 0.0)).detach().tolist()
    t, E = s.shape
    size = E // n_group
    ids = []
    for row in choice:
        eligible = set(range(E))
        if n_group > 1:
            def group_score(g):
                best = sorted(row[g * size:(g + 1) * size], reverse=True)
                return best[0] + best[1]
            groups = sorted(range(n_group), key=lambda g: (-group_score(g), g))[:topk_group]
            eligible = {e for e in range(E) if e // size in groups}
        ids.append(sorted(eligible, key=lambda e: (-row[e], e))[:top_k])
    ids = torch.tensor(ids, dtype=torch.int64, device=logits.device).reshape(t, top_k)
    w = s.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


def relu2_moe(x, w_up, w_down, ids, weights, shared_w_up=None, shared_w_down=None):
    """specs/moe.md experts assignment by assignment in float64 (no intermediate rounding);
    ids outside [0, E) contribute nothing. Differentiable by autograd."""
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
