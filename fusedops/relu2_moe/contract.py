"""The routed ReLU2 MoE's contract: its problems, constants and math (docs/relu2_moe.md).

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

NaN in the selection: a NaN choice score (a NaN logit or bias) ranks as -inf, below every number,
ties to the lower expert index; a NaN group score (the sum of two infinities of opposite sign)
likewise, ties to the lower group index; ineligible experts of unselected groups are never
taken. So ids always hold k distinct experts in [0, E). The weights are computed from s as
above: a NaN score gives a NaN weight (with norm_topk_prob, the token's every weight).

Router backward, the selection held fixed, with r = s[ids], S = sum r + NORM_EPS and
c = routed_scaling_factor: d_r_j = c · (d_w_j / S - sum_i d_w_i r_i / S²) (c · d_w_j without the
normalisation); d_logits[e] = sum over the j with ids_j = e of d_r_j · r_j (1 - r_j) (one term
for the router's distinct ids; in slot order for a repeated id), zero for every other expert. An
id outside [0, E) is dropped: it adds nothing, and its r_j counts 0 in S (the index-data rules
below).

Experts, per assignment (t, j) with e = ids[t, j]:

    u_tj = W_up[e] x_t     a_tj = relu(u_tj)²     y_tj = W_down[e] a_tj
    out_t = sum_j (w_tj · y_tj)  (+ W_down_s relu(W_up_s x_t)², the shared expert)

u, a and each weighted row w_tj · y_tj are rounded to x's dtype (as a bf16 model computes them:
the rows are what passes between the expert GEMMs and the sum over j); the sum over j and the
shared expert's product stay fp32 and out is rounded once. A repeated id in a token's row is two
assignments of the same expert.

Layouts (docs/relu2_moe.md, "Strided activations"): the activations x, out, d_out and d_x [t, H], the
router's logits and d_logits [t, E] may be views (the last dimension contiguous, the row stride
a multiple of 16 bytes) whenever a row is a whole number of 16-byte vectors (``row_vector``);
the parameters, the routing data and their gradients are contiguous.

Index data (docs/plans.md, "Index data"): an id outside [0, E) drops the assignment: it adds
nothing to out, d_x, the weight gradients or d_logits, and its d_topk_weights entry is 0 (its
routing weight is never read, so it may hold anything). -1 is padding (unused tokens of a
captured graph, experts held by another rank): valid, no status bit; any other id outside
[0, E) sets Status.EXPERT_ID in the plans' optional status word. The backward reads the
dispatch its forward saved: give it the forward's topk_ids.

Experts backward, with g_tj = W_down[e]ᵀ d_out_t:

    d_w_tj      = <g_tj, a_tj>                               fp32
    d_u_tj      = w_tj · g_tj · 2 relu(u_tj)                  rounded to x's dtype
    d_x_t       = sum_j (W_up[e]ᵀ d_u_tj) (+ the shared expert) each routed row rounded to x's
                                                             dtype, the sum fp32, rounded once
    d_W_down[e] = sum d_out ⊗ (w · a)  with w · a rounded to x's dtype
    d_W_up[e]   = sum d_u ⊗ x                                 fp32, in weight_grad_dtype
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.checks import row_vector  # noqa: F401  (the plans' stride unit)
from ..core.cost import Cost
from ..core.dtypes import accumulator_dtype, element_size

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
    has_status: bool = False        # backward: report invalid ids into a status word

    @property
    def compute_dtype(self) -> torch.dtype:
        """The scores, weights and d_topk_weights: fp32 (float64 for float64 logits)."""
        return accumulator_dtype(self.logits_dtype)

    @property
    def row_vector(self) -> int:
        """The unit of the logits' and d_logits' row strides (``row_vector``)."""
        return row_vector(self.experts, self.logits_dtype)


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
    has_status: bool = False        # report invalid ids into a status word

    @property
    def assignments(self) -> int:
        return self.tokens * self.top_k

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    @property
    def row_vector(self) -> int:
        """The unit of the row strides of x, out, d_out and d_x (``row_vector``)."""
        return row_vector(self.hidden, self.dtype)

    @property
    def weight_dtype(self) -> torch.dtype:
        """Routing weights and their gradient: fp32 (fp64 for fp64 inputs)."""
        return accumulator_dtype(self.dtype)


def weight_grad_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes the weight gradients may take for x of ``dtype``, the default first: fp32 or
    the weights' dtype (float64 only, for float64 inputs)."""
    return tuple(dict.fromkeys((torch.float64,) if dtype == torch.float64
                               else (torch.float32, dtype)))


# -- floors (docs/performance.md, "How traffic is counted"; docs/relu2_moe.md, "Performance model") -----
ROUTER_FLOPS_PER_SCORE = 5
"""Per router score: the sigmoid (exp, add, reciprocal), the bias add and one compare of a
top-k pass."""


def balanced_rows(assignments: int, experts: int) -> tuple[tuple[int, int], ...]:
    """The routing the cost models assume: the uniform routing of the production shapes taken at
    its mean, every expert receiving t·k / E assignments (r = t·k mod E of them one more).
    Returns ((rows, number of experts with that many rows), ...). A random uniform routing
    spreads the counts by about sqrt(t·k / E) around the mean, which pads a few more row
    tiles; the model leaves that out."""
    q, r = divmod(assignments, experts)
    return tuple((rows, n) for rows, n in ((q + 1, r), (q, experts - r)) if n)


def experts_used(problem: MoEProblem) -> int:
    """Experts that receive at least one assignment under the balanced routing."""
    return min(problem.experts, problem.assignments)


def expert_forward_mma_flops(problem: MoEProblem) -> int:
    """The two products per assignment (2·H·I multiply-adds each, ×2 FLOPs) and the shared
    expert's two per token."""
    H = problem.hidden
    return 2 * problem.assignments * 2 * H * problem.intermediate + \
        2 * problem.tokens * 2 * H * problem.shared_intermediate


def _weight_bytes(problem: MoEProblem) -> int:
    """W_up and W_down of the experts any token selects, and the shared expert's, once."""
    e, H = element_size(problem.dtype), problem.hidden
    return (experts_used(problem) * 2 * H * problem.intermediate
            + 2 * H * problem.shared_intermediate) * e


def _u_bytes(problem: MoEProblem) -> int:
    """u per assignment [t·k, I] and the shared expert's [t, I_s], x's dtype."""
    return (problem.assignments * problem.intermediate
            + problem.tokens * problem.shared_intermediate) * element_size(problem.dtype)


def forward_floor(problem: MoEProblem) -> Cost:
    """The least any forward needs: x, topk_ids, topk_weights and each selected expert's
    weights (and the shared expert's) read once, out written once; a training forward also
    writes u once (what the backward needs: saving it is cheaper than recomputing the up
    product, docs/relu2_moe.md). FLOPs: 2·t·k·(2·H·I) + 2·t·(2·H·I_s) on tensor cores, plus relu²,
    the weighting and the sum over the k experts on the CUDA cores."""
    t, H, A = problem.tokens, problem.hidden, problem.assignments
    e, w = element_size(problem.dtype), element_size(problem.weight_dtype)
    read = t * H * e + A * (4 + w) + _weight_bytes(problem)
    written = t * H * e + (0 if problem.is_inference else _u_bytes(problem))
    mma = expert_forward_mma_flops(problem)
    other = 2 * (A * problem.intermediate + problem.tokens * problem.shared_intermediate) \
        + 2 * A * H + t * H * problem.has_shared
    return Cost(mma + other, read, written, mma_flops=mma)


def backward_floor(problem: MoEProblem) -> Cost:
    """The least any backward needs: x, d_out, topk_ids, topk_weights, the saved u and each
    selected expert's weights read once; d_x, d_topk_weights and every expert's weight
    gradients (weight_grad_dtype) written once, and read once when accumulating. FLOPs: the two
    data-gradient and the two weight-gradient products, twice the forward's, on tensor cores,
    plus d_u and the <g, a> dot products on the CUDA cores."""
    t, H, I, A = problem.tokens, problem.hidden, problem.intermediate, problem.assignments
    e, w = element_size(problem.dtype), element_size(problem.weight_dtype)
    grads = (problem.experts * 2 * H * I + 2 * H * problem.shared_intermediate) * \
        element_size(problem.weight_grad_dtype)
    read = 2 * t * H * e + A * (4 + w) + _weight_bytes(problem) + _u_bytes(problem) + \
        (grads if problem.accumulate else 0)
    written = t * H * e + A * w + grads
    mma = 2 * expert_forward_mma_flops(problem)
    other = 6 * (A * I + t * problem.shared_intermediate)
    return Cost(mma + other, read, written, mma_flops=mma)


def router_forward_floor(problem: RouterProblem) -> Cost:
    """The logits (and the bias) read once, topk_weights and topk_ids written once; the scores,
    the bias add and a top-k pass per score."""
    t, E, k = problem.tokens, problem.experts, problem.top_k
    read = t * E * element_size(problem.logits_dtype) + (E * 4 if problem.has_bias else 0)
    written = t * k * (element_size(problem.compute_dtype) + 4)
    return Cost(t * E * ROUTER_FLOPS_PER_SCORE, read, written)


def router_backward_floor(problem: RouterProblem) -> Cost:
    """topk_ids, d_topk_weights and the k selected logits of each token read once (4 bytes
    each: the math needs no more), d_logits [t, E] written once."""
    t, E, k = problem.tokens, problem.experts, problem.top_k
    l, c = element_size(problem.logits_dtype), element_size(problem.compute_dtype)
    return Cost(t * k * 12, t * k * (4 + c + l), t * E * l)
