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
