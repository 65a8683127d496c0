"""Engram gate (CuTe DSL): the kernels' bytes and FLOPs, from their geometry and grid (the counting
rules of docs/performance.md).
"""

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.engram_gate.contract import BACKWARD_FLOPS_PER_ELEMENT, FORWARD_FLOPS_PER_ELEMENT

from .tiles import backward_blocks


def forward_cost(problem) -> Cost:
    """x, the keys and v once (x read again for out when not held: from L1/L2, the same CTA read
    it just before), the mask; the weight once (L2); out and saved written."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    read = n * (2 * s + 1) * d * e + s * d * 4 + (n if problem.has_mask else 0)
    return Cost(FORWARD_FLOPS_PER_ELEMENT * n * s * d, read, n * s * d * e + n * s * 16)


def backward_cost(problem) -> Cost:
    """Every input row once: the S stream CTAs of a token block and its grad_v CTA are adjacent
    in launch order and walk the same tokens, so v (read by each stream CTA) and the g rows and
    gates (read again by the grad_v CTA) come from L2 (reuse distance, docs/performance.md), as
    does g read again by its stream CTA right after the dgate barrier (L1, no gap); the weight
    row, read once per stream CTA (into its private row), is counted once (L2). Written: grad_x,
    grad_k, grad_v and one fp32 partial row per block."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    blocks = backward_blocks(problem)[1]
    read = n * s * (3 * d * e + 16) + n * d * e + s * d * 4
    written = n * (2 * s + 1) * d * e + blocks * s * d * 4
    return Cost(BACKWARD_FLOPS_PER_ELEMENT * n * s * d, read, written)


def reduce_cost(problem) -> Cost:
    """Every partial row read once (and grad_weight when accumulating), grad_weight written."""
    sd, blocks = problem.streams * problem.hidden, backward_blocks(problem)[1]
    return Cost(blocks * sd, (blocks + problem.accumulate) * sd * 4, sd * 4)
