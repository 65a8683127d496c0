"""Independent float64 math of the row scale, differentiated by autograd."""

from __future__ import annotations

import torch


def oracle(case) -> dict[str, torch.Tensor]:
    """y, grad_x and grad_weight of a case, in float64 on the CPU."""
    t = {k: v.detach().cpu().double() for k, v in case.tensors.items()}
    x, w = t["x"].requires_grad_(), t["weight"].requires_grad_()
    y = x * w
    grad_x, grad_weight = torch.autograd.grad((y * t["grad_y"]).sum(), (x, w))
    return dict(y=y.detach(), grad_x=grad_x, grad_weight=grad_weight)
