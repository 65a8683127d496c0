"""Engram saved-state gate in plain torch (the reference math of specs/engram_gate.md)."""

from __future__ import annotations

import math

import torch

# The clamp of the signed square root, as the fp32 value the kernels compare against.
DOT_CLAMP = float(torch.tensor(1e-6, dtype=torch.float32))


def gate_forward(x, kv, weight, mask, eps: float, compute_dtype=torch.float32):
    """Returns ``(out, saved)``: out in x.dtype, saved [N, S, 4] = (gate, dot, rstd_x, rstd_k)
    in ``compute_dtype``. All arithmetic in ``compute_dtype``; out is rounded once."""
    n, s, d = x.shape
    xf = x.to(compute_dtype)
    kvf = kv.to(compute_dtype).view(n, s + 1, d)
    k, v = kvf[:, :s], kvf[:, s]
    w = weight.to(compute_dtype)
    rx = 1.0 / torch.sqrt(xf.square().mean(-1) + eps)
    rk = 1.0 / torch.sqrt(k.square().mean(-1) + eps)
    dot = (xf * w * k).sum(-1) * rx * rk / math.sqrt(d)
    r = torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(DOT_CLAMP))
    gate = torch.sigmoid(r)
    out = xf + gate[..., None] * v[:, None]
    if mask is not None:
        gate = torch.where(mask[:, None], gate, torch.zeros((), dtype=compute_dtype, device=x.device))
        out = torch.where(mask[:, None, None], out, xf)
    return out.to(x.dtype), torch.stack((gate, dot, rx, rk), dim=-1)


def gate_backward(x, kv, weight, saved, grad_out, compute_dtype=torch.float32):
    """Returns ``(grad_x, grad_kv, grad_weight)``: grad_x/grad_kv in x.dtype (each rounded
    once), grad_weight [S, D] in ``compute_dtype``. ``saved`` comes from the matching forward."""
    n, s, d = x.shape
    xf = x.to(compute_dtype)
    kvf = kv.to(compute_dtype).view(n, s + 1, d)
    k, v = kvf[:, :s], kvf[:, s]
    w = weight.to(compute_dtype)
    g = grad_out.to(compute_dtype)
    gate, dot, rx, rk = saved.to(compute_dtype).unbind(-1)
    dgate = (g * v[:, None]).sum(-1)
    # gate == 0 (masked tokens) contributes no derivative even when a masked value is not finite
    live = (dot.abs() >= DOT_CLAMP) & (gate != 0)
    slope = 0.5 / torch.sqrt(dot.abs().clamp_min(DOT_CLAMP))
    ddot = torch.where(live, dgate * gate * (1 - gate) * slope, torch.zeros_like(dgate))
    coef = ddot * rx * rk / math.sqrt(d)
    grad_x = g + coef[..., None] * w * k - (ddot * dot * rx * rx / d)[..., None] * xf
    grad_k = coef[..., None] * w * xf - (ddot * dot * rk * rk / d)[..., None] * k
    grad_v = (gate[..., None] * g).sum(1)
    grad_weight = (coef[..., None] * xf * k).sum(0)
    grad_kv = torch.cat((grad_k.reshape(n, s * d), grad_v), dim=1)
    return grad_x.to(x.dtype), grad_kv.to(x.dtype), grad_weight


def unsupported_reason(problem) -> str | None:
    return None


def backward_workspace_size(problem) -> int:
    return 0


def _compute_dtype(problem) -> torch.dtype:
    return torch.float64 if problem.dtype == torch.float64 else torch.float32


def forward_launcher(problem):
    compute_dtype = _compute_dtype(problem)

    def launch(x, kv, weight, mask, out, saved, *, stream):
        o, sv = gate_forward(x, kv, weight, mask, problem.eps, compute_dtype)
        out.copy_(o)
        saved.copy_(sv)
    return launch


def backward_launcher(problem):
    compute_dtype = _compute_dtype(problem)

    def launch(x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight, workspace, *, stream):
        gx, gkv, gw = gate_backward(x, kv, weight, saved, grad_out, compute_dtype)
        grad_x.copy_(gx)
        grad_kv.copy_(gkv)
        if problem.accumulate:
            grad_weight.add_(gw)
        else:
            grad_weight.copy_(gw)
    return launch
