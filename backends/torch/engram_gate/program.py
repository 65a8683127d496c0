"""Engram saved-state gate in plain torch (the reference math of fusedops.engram_gate.contract)."""

from __future__ import annotations

import math

import torch

from fusedops.core.dtypes import accumulator_dtype
from fusedops.engram_gate.contract import DOT_CLAMP

from ..common import direct_program, unsupported_reason

__all__ = ["backward_program", "forward_program", "gate_backward", "gate_forward",
           "unsupported_reason"]


def gate_forward(x, kv, weight, mask, eps: float, compute_dtype=torch.float32):
    """Returns ``(out, saved)``: out in x.dtype, saved [N, S, 4] = (gate, dot, rstd_x, rstd_k)
    in ``compute_dtype``. All arithmetic in ``compute_dtype``; out is rounded once."""
    n, s, d = x.shape
    xf = x.to(compute_dtype)
    kvf = kv.to(compute_dtype).unflatten(1, (s + 1, d))
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
    kvf = kv.to(compute_dtype).unflatten(1, (s + 1, d))
    k, v = kvf[:, :s], kvf[:, s]
    w = weight.to(compute_dtype)
    g = grad_out.to(compute_dtype)
    gate, dot, rx, rk = saved.to(compute_dtype).unbind(-1)
    dgate = (g * v[:, None]).sum(-1)
    # a masked token (gate == 0) is isolated: nothing of its x, kv or saved statistics reaches a
    # gradient, even when they are not finite (selected away, never multiplied by zero)
    token = gate != 0
    live = (dot.abs() >= DOT_CLAMP) & token
    zero = torch.zeros((), dtype=compute_dtype, device=x.device)
    slope = 0.5 / torch.sqrt(dot.abs().clamp_min(DOT_CLAMP))
    ddot = torch.where(live, dgate * gate * (1 - gate) * slope, zero)
    coef = torch.where(token, ddot * rx * rk / math.sqrt(d), zero)
    c_x = torch.where(token, ddot * dot * rx * rx / d, zero)
    c_k = torch.where(token, ddot * dot * rk * rk / d, zero)
    keep = token[..., None]
    grad_x = g + torch.where(keep, coef[..., None] * w * k - c_x[..., None] * xf, zero)
    grad_k = torch.where(keep, coef[..., None] * w * xf - c_k[..., None] * k, zero)
    grad_v = torch.where(keep, gate[..., None] * g, zero).sum(1)
    grad_weight = torch.where(keep, coef[..., None] * xf * k, zero).sum(0)
    grad_kv = torch.cat((grad_k.reshape(n, s * d), grad_v), dim=1)
    return grad_x.to(x.dtype), grad_kv.to(x.dtype), grad_weight


def forward_program(problem):
    compute = accumulator_dtype(problem.dtype)

    def run(b):
        out, saved = gate_forward(b["x"], b["kv"], b["weight"], b.get("mask"), problem.eps, compute)
        b["out"].copy_(out)
        b["saved"].copy_(saved)
    return direct_program(run)


def backward_program(problem):
    compute = accumulator_dtype(problem.dtype)

    def run(b):
        gx, gkv, gw = gate_backward(b["x"], b["kv"], b["weight"], b["saved"], b["grad_out"], compute)
        b["grad_x"].copy_(gx)
        b["grad_kv"].copy_(gkv)
        if problem.accumulate:
            b["grad_weight"].add_(gw)
        else:
            b["grad_weight"].copy_(gw)
    return direct_program(run)
