"""The routed ReLU2 MoE's registry entry: the router and the expert path as one family."""

from __future__ import annotations

import torch

from ..opinfo import ROUNDED_ONCE, OpInfo, Tolerance
from . import samples
from .oracle import oracle
from .ops import moe_router as moe_router_op
from .ops import relu2_moe
from .plans import (MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward, moe_router,
                    moe_router_backward, relu2_moe_backward, relu2_moe_forward)

# against the float64 oracle, which rounds nothing: u, a, d_u and d_y are rounded to x's dtype
# (one rounding each, u = 6e-8 / 4.9e-4 / 3.9e-3) before the next product
EXPERT_TOLERANCE = {
    torch.float64: Tolerance(1e-12, 1e-11, "float64 against float64"),
    torch.float32: Tolerance(1e-5, 5e-5, "fp32 products and sums in another order"),
    torch.float16: Tolerance(2e-3, 1e-2, "u, a, d_u, d_y rounded to fp16 before the next product"),
    torch.bfloat16: Tolerance(8e-3, 3e-2, "u, a, d_u, d_y rounded to bf16 before the next product"),
}
ROUTER_WEIGHTS = Tolerance(1e-6, 1e-6, "fp32 sigmoid and normalisation")
SAME_SELECTION = Tolerance(0.0, 0.0, "the same experts in the same order")


def tolerance(name: str, dtype: torch.dtype) -> Tolerance:
    """topk_ids: exact; topk_weights: fp32 router math (float64 for float64); every expert
    result and d_logits (which carries d_topk_weights' error): EXPERT_TOLERANCE of x's dtype."""
    if name == "topk_ids":
        return SAME_SELECTION
    if name == "topk_weights":
        return ROUNDED_ONCE[torch.float64] if dtype == torch.float64 else ROUTER_WEIGHTS
    return EXPERT_TOLERANCE[dtype]


INFO = OpInfo(
    name="relu2_moe", title="Routed ReLU2 MoE (router and experts)", doc="docs/relu2_moe.md",
    plans=(MoERouter, ReLU2MoEForward, ReLU2MoEBackward, MoERouterBackward),
    eager=(moe_router, relu2_moe_forward, relu2_moe_backward, moe_router_backward),
    torch_ops=(moe_router_op, relu2_moe),
    cases=samples.cases, production=samples.production, plan_calls=samples.plan_calls,
    run=samples.run, oracle=oracle, tolerance=tolerance, index_fuzz=samples.index_fuzz,
    demo_limit=8e-3,   # fp32 math, each bf16 output rounded once
    bench=("relu2_moe",),
    emulated_cases=("small:1", "edge:3"))
