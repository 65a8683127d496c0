"""Routed ReLU2 MoE: the router and the expert path (contract, plans, eager wrappers, torch ops,
samples and oracle). See docs/relu2_moe.md."""

from .contract import DTYPES, LOGIT_DTYPES, MAX_GROUPS, NORM_EPS, MoEProblem, RouterProblem
from .plans import (MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward, moe_router,
                    moe_router_backward, relu2_moe_backward, relu2_moe_forward)

__all__ = ["MoERouter", "MoERouterBackward", "ReLU2MoEBackward", "ReLU2MoEForward", "moe_router",
           "moe_router_backward", "relu2_moe_backward", "relu2_moe_forward"]
