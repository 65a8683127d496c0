"""Engram gate: the Triton kernels' bytes and FLOPs, from their row layout and grid (the counting
rules of docs/performance.md).
"""

from __future__ import annotations

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.engram_gate.contract import BACKWARD_FLOPS_PER_ELEMENT, FORWARD_FLOPS_PER_ELEMENT

from .tiles import GateTiles, RowLayout, backward_blocks


def forward_cost(problem, layout: RowLayout) -> Cost:
    """Per token: x, the S keys and v once, the mask; out and saved written. A streamed row
    (``layout`` not held) reads x again for out and v per stream inside the same program:
    those re-reads come from L2 (the reuse-distance rule of docs/performance.md, a gap of no
    program). The weight (S·D fp32, read by every program) is counted once: it stays in L2."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    read = n * (2 * s + 1) * d * e + s * d * 4 + (n if problem.has_mask else 0)
    return Cost(FORWARD_FLOPS_PER_ELEMENT * n * s * d, read, n * s * d * e + n * s * 16)


def backward_cost(problem, layout: RowLayout, tiles: GateTiles) -> Cost:
    """Every input row once: x, k and g of each stream, v, and saved (16 B per token and
    stream). The S stream programs of a token block and its grad_v program are adjacent in
    launch order (the grid's stream index fastest) and walk the block's tokens in the same
    order, so the v row every stream program reads and the g rows and gates the grad_v program
    reads again are S programs or fewer from the previous read, as are a streamed row's re-reads
    per chunk inside one program: by the reuse-distance rule (docs/performance.md) they come from
    L2. Written: grad_x, grad_k, grad_v and one fp32 partial row per block. The weight is
    counted once (L2)."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    blocks = backward_blocks(problem, tiles)[1]
    read = n * s * (3 * d * e + 16) + n * d * e + s * d * 4
    written = n * (2 * s + 1) * d * e + blocks * s * d * 4
    return Cost(BACKWARD_FLOPS_PER_ELEMENT * n * s * d, read, written)


def reduce_cost(problem, tiles: GateTiles) -> Cost:
    """The grad_weight reduce: every partial row read once (and grad_weight when accumulating),
    grad_weight written once; one add per partial element."""
    sd = problem.streams * problem.hidden
    blocks = backward_blocks(problem, tiles)[1]
    return Cost(blocks * sd, (blocks + problem.accumulate) * sd * 4, sd * 4)
