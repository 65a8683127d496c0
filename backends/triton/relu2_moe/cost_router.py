"""The MoE router's Triton kernels: bytes and FLOPs, from their grid (the counting rules of
docs/performance.md).
"""

from __future__ import annotations

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.relu2_moe.contract import ROUTER_FLOPS_PER_SCORE


# -- specialisations and programs ----------------------------------------------------------------
SECTOR = 32     # bytes: the DRAM access granularity a gathered 4-byte logit costs


def forward_cost(problem) -> Cost:
    """A 1-D grid, one program per BT tokens in token order (docs/performance.md, "How traffic
    is counted"): no two programs load the same logits, so each token's logits row counts once
    (t·E·l; the padded columns past E are masked); the bias, which every program loads in full
    (4·E bytes, in L2), once; topk_weights and topk_ids written (t·k·(4 + 4)).
    FLOPs per score: the sigmoid, the bias add and k selection rounds of a max and a compare
    (ROUTER_FLOPS_PER_SCORE + 2·(k - 1)), and the group scores (4 per score and group round)
    when grouped."""
    t, E, k = problem.tokens, problem.experts, problem.top_k
    read = t * E * element_size(problem.logits_dtype) + (4 * E if problem.has_bias else 0)
    groups = 4 * (problem.n_group + problem.topk_group) if problem.n_group > 1 else 0
    flops = t * E * (ROUTER_FLOPS_PER_SCORE + 2 * (k - 1) + groups)
    return Cost(flops, read, t * k * 8)


def backward_cost(problem) -> Cost:
    """A 1-D grid, one program per BT tokens, each loading only its own tokens' data (no re-read
    to credit): topk_ids and d_topk_weights read (t·k·(4 + 4)); the k selected logits of each
    token are gathered, one 32-byte sector each (at most the whole row, t·min(k·32, E·l));
    d_logits [t, E] written whole (zeros off the selection). FLOPs: about 12 per slot for the
    sigmoid and the normalisation terms, and the slot-order scatter (2 per score and slot)."""
    t, E, k = problem.tokens, problem.experts, problem.top_k
    l = element_size(problem.logits_dtype)
    read = t * k * 8 + t * min(k * SECTOR, E * l)
    return Cost(t * k * 12 + 2 * t * E * k, read, t * E * l)
