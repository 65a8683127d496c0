"""Independent float64 math of the gate contract, differentiated by autograd: written from the
contract, separately from the torch backend, so the reference is checked against math it does
not share code with."""

from __future__ import annotations

import torch


def gate_forward(x, kv, weight, mask, eps, clamp=1e-6):
    """The forward in float64; returns (out, gate, dot, rstd_x, rstd_k)."""
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


def gate_gradients(x, kv, weight, mask, eps, grad_out):
    """(grad_x, grad_kv, grad_weight) of sum(out * grad_out) by autograd, in float64."""
    x = x.detach().cpu().double().requires_grad_()
    kv = kv.detach().cpu().double().requires_grad_()
    weight = weight.detach().cpu().double().requires_grad_()
    mask = None if mask is None else mask.cpu()
    out = gate_forward(x, kv, weight, mask, eps)[0]
    return torch.autograd.grad((out * grad_out.cpu().double()).sum(), (x, kv, weight))


def oracle(case) -> dict[str, torch.Tensor]:
    """Every result of a gate case (the names ``samples.run`` returns), in float64."""
    t = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.tensors.items()}
    eps = case.options.get("eps", 1e-20)
    out, gate, dot, rx, rk = gate_forward(t["x"], t["kv"], t["weight"], t["mask"], eps)
    grad_x, grad_kv, grad_weight = gate_gradients(t["x"], t["kv"], t["weight"], t["mask"], eps,
                                                  t["grad_out"])
    return dict(out=out, saved=torch.stack((gate, dot, rx, rk), -1), grad_x=grad_x,
                grad_kv=grad_kv, grad_weight=grad_weight)
