"""The routed ReLU2 MoE's contract: its problems, constants and math (docs/moe.md).

Nemotron 3's MoE layers: a sigmoid router with a selection bias, top-k of E non-gated experts
expert(x) = W_down · relu(W_up · x)², and an optional shared expert.

Router, per token (fp32; float64 in a reference plan):

    s      = sigmoid(logits)
    choice = s + correction_bias        (selection only; optional group-limited masking: the E
                                         experts form n_group groups, only the topk_group groups
                                         with the largest sum of their two best choices are
                                         eligible, ties to the lower group index)
    ids    = top_k(choice)              descending, ties to the lower expert index
    w      = s[ids] / (sum s[ids] + NORM_EPS) if norm_topk_prob, then · routed_scaling_factor

Router backward, the selection held fixed, with r = s[ids], S = sum r + NORM_EPS and
c = routed_scaling_factor: d_r_j = c · (d_w_j / S - sum_i d_w_i r_i / S²) (c · d_w_j without the
normalisation); d_logits[ids_j] = d_r_j · r_j (1 - r_j), zero for every unselected expert.

Experts, per assignment (t, j) with e = ids[t, j]:

    u_tj = W_up[e] x_t     a_tj = relu(u_tj)²     y_tj = W_down[e] a_tj
    out_t = sum_j w_tj · y_tj  (+ W_down_s relu(W_up_s x_t)², the shared expert)

u and a are rounded to x's dtype (as a bf16 model computes them), y and the sum over j stay fp32
and out is rounded once. An id outside [0, E) (use -1) drops the assignment: it contributes
nothing and gets a zero routing-weight gradient (padding tokens of a captured graph, experts
held by another rank).

Experts backward, with g_tj = W_down[e]ᵀ d_out_t:

    d_w_tj      = <g_tj, a_tj>                               fp32
    d_u_tj      = w_tj · g_tj · 2 relu(u_tj)                  rounded to x's dtype
    d_x_t       = sum_j W_up[e]ᵀ d_u_tj (+ the shared expert)  fp32, rounded once
    d_W_down[e] = sum d_y ⊗ a  with d_y = w · d_out rounded to x's dtype
    d_W_up[e]   = sum d_u ⊗ x                                 fp32, in weight_grad_dtype
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.dtypes import accumulator_dtype

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
"""x, the expert weights, out, d_out and d_x (float64: reference precision)."""

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Router logits (bf16/fp16 are read and computed in fp32)."""

MAX_GROUPS = 64
"""The most expert groups of a group-limited router."""

NORM_EPS = 1e-20
"""Added to the sum of the selected scores before the normalisation."""


@dataclass(frozen=True)
class RouterProblem:
    """Plan-time facts of the router (forward and backward)."""

    logits_dtype: torch.dtype
    tokens: int
    experts: int
    top_k: int
    n_group: int                    # 1: no group-limited selection
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    has_bias: bool
    device: torch.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The scores, weights and d_topk_weights: fp32 (float64 for float64 logits)."""
        return accumulator_dtype(self.logits_dtype)


@dataclass(frozen=True)
class MoEProblem:
    """Plan-time facts of the expert path (forward and backward)."""

    dtype: torch.dtype              # x, weights, out, d_out, d_x
    tokens: int                     # t (the plan's token count; unused tokens take id -1)
    hidden: int                     # H
    experts: int                    # E
    intermediate: int               # I
    top_k: int                      # k
    shared_intermediate: int        # I of the shared expert, 0 without one
    is_inference: bool              # forward: no saved buffer
    accumulate: bool                # backward: add weight gradients into the given buffers
    weight_grad_dtype: torch.dtype  # backward: d_w_up, d_w_down (and the shared ones)
    device: torch.device

    @property
    def assignments(self) -> int:
        return self.tokens * self.top_k

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    @property
    def weight_dtype(self) -> torch.dtype:
        """Routing weights and their gradient: fp32 (fp64 for fp64 inputs)."""
        return accumulator_dtype(self.dtype)


def weight_grad_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes the weight gradients may take for x of ``dtype``, the default first: fp32 or
    the weights' dtype (float64 only, for float64 inputs)."""
    return tuple(dict.fromkeys((torch.float64,) if dtype == torch.float64
                               else (torch.float32, dtype)))
