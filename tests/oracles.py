"""Independent float64 implementations of the operator contracts, differentiated by autograd.

Written from the specs, separately from fusedops.backends.torch, so the reference backend is
checked against math it does not share code with.
"""

from __future__ import annotations

import torch


def engram_gate(x, kv, weight, mask, eps, clamp=1e-6):
    """specs/engram_gate.md forward in float64; returns (out, gate, dot, rstd_x, rstd_k)."""
    x, kv, w = x.double(), kv.double(), weight.double()
    n, s, d = x.shape
    keys = kv[:, : s * d].reshape(n, s, d)
    value = kv[:, s * d:]
    rstd_x = torch.rsqrt(x.pow(2).sum(-1) / d + eps)
    rstd_k = torch.rsqrt(keys.pow(2).sum(-1) / d + eps)
    dot = torch.einsum("nsd,sd,nsd->ns", x, w, keys) * rstd_x * rstd_k / d ** 0.5
    signed_root = dot.sign() * dot.abs().clamp_min(clamp).sqrt()
    gate = torch.sigmoid(signed_root)
    if mask is not None:
        gate = torch.where(mask[:, None], gate, torch.zeros_like(gate))
    out = x + gate[..., None] * value[:, None, :]
    if mask is not None:
        out = torch.where(mask[:, None, None], out, x)
    return out, gate, dot, rstd_x, rstd_k


def engram_gate_grads(x, kv, weight, mask, eps, grad_out):
    """(grad_x, grad_kv, grad_weight) of sum(out * grad_out) by autograd, in float64."""
    x = x.detach().double().requires_grad_()
    kv = kv.detach().double().requires_grad_()
    weight = weight.detach().double().requires_grad_()
    out = engram_gate(x, kv, weight, mask, eps)[0]
    return torch.autograd.grad((out * grad_out.double()).sum(), (x, kv, weight))


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
