"""Engram saved-state gate: the Triton kernels' specialisations and programs (the math:
fusedops.engram_gate.contract; the kernels: kernels.py; their tiles: tiles.py; their traffic:
cost.py). The workspace holds one fp32 grad_weight partial row per backward token block.
"""

from __future__ import annotations

import math

import torch
import triton

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride, workspace_piece
from fusedops.core.workspace import Layout
from fusedops.engram_gate.contract import DOT_CLAMP

from ..runtime import KernelSpec, pointer_type
from .cost import backward_cost, forward_cost, reduce_cost
from .kernels import (engram_gate_bwd_held_kernel, engram_gate_bwd_kernel, engram_gate_fwd_kernel,
                      engram_gate_weight_reduce_kernel)
from .tiles import (GateTiles, REDUCE_TILE, backward_blocks, candidates, max_backward_blocks,
                    row_layout, tiles_for, vector_elements)


def _row_constexprs(problem, bd: int) -> dict:
    return dict(S=problem.streams, D=problem.hidden, BLOCK_D=bd,
                NUM_CHUNKS=triton.cdiv(problem.hidden, bd), SQRT_D=math.sqrt(problem.hidden),
                DOT_MIN=DOT_CLAMP, VEC=vector_elements(problem))
# the row strides each kernel reads from the tensors execute() is handed, by argument name
FORWARD_STRIDES = {"stride_xn": ("x", 0), "stride_xs": ("x", 1), "stride_kvn": ("kv", 0),
                   "stride_outn": ("out", 0), "stride_outs": ("out", 1)}
BACKWARD_STRIDES = {"stride_xn": ("x", 0), "stride_xs": ("x", 1), "stride_kvn": ("kv", 0),
                    "stride_gn": ("grad_out", 0), "stride_gs": ("grad_out", 1),
                    "stride_gxn": ("grad_x", 0), "stride_gxs": ("grad_x", 1),
                    "stride_gkvn": ("grad_kv", 0)}


def _strides(problem, table) -> dict:
    vec = vector_elements(problem)
    return {arg: Stride(tensor, dim, vec) for arg, (tensor, dim) in table.items()}


def forward_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    tiles = tiles or tiles_for(problem)
    t = pointer_type(problem.dtype)
    args = (("x", t), ("kv", t), ("weight", "*fp32"), ("mask", "*i1" if problem.has_mask else None),
            ("out", t), ("saved", "*fp32"), ("eps", "fp32"))
    layout = row_layout(problem, tiles)
    constexprs = dict(_row_constexprs(problem, layout.block), HELD=layout.held,
                      HAS_MASK=problem.has_mask)
    return KernelSpec.make(engram_gate_fwd_kernel, args, constexprs, (problem.tokens,),
                           num_warps=layout.warps, cost=forward_cost(problem, layout))


def backward_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    tiles = tiles or tiles_for(problem)
    t = pointer_type(problem.dtype)
    args = (("x", t), ("kv", t), ("weight", "*fp32"), ("saved", "*fp32"), ("grad_out", t),
            ("grad_x", t), ("grad_kv", t), ("partials", "*fp32"))
    layout = row_layout(problem, tiles, "bwd")
    blocks = backward_blocks(problem, tiles)[1]
    if layout.held:
        kernel, grid = engram_gate_bwd_held_kernel, (problem.streams + 1, blocks)
    else:
        kernel, grid = engram_gate_bwd_kernel, (problem.streams + 1, blocks, layout.chunks)
    return KernelSpec.make(kernel, args, _row_constexprs(problem, layout.block), grid,
                           num_warps=layout.warps, cost=backward_cost(problem, layout, tiles))


def reduce_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    """grad_weight (+)= the sum of the partial rows; specialised on the most rows any N gives."""
    tiles = tiles or tiles_for(problem)
    block_p = triton.next_power_of_2(max_backward_blocks(problem, tiles))
    block_c = max(16, REDUCE_TILE // block_p)
    sd = problem.streams * problem.hidden
    return KernelSpec.make(engram_gate_weight_reduce_kernel,
                           (("partials", "*fp32"), ("grad_weight", "*fp32")),
                           dict(SD=sd, BLOCK_P=block_p, BLOCK_C=block_c,
                                ACCUMULATE=problem.accumulate),
                           (triton.cdiv(sd, block_c),), num_warps=8,
                           cost=reduce_cost(problem, tiles))


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton gate kernels", problem.dtype)


def backward_workspace(problem, tiles: GateTiles | None = None) -> Layout:
    """One fp32 grad_weight partial row [S, D] per token block: 4·S·D·blocks bytes."""
    blocks = backward_blocks(problem, tiles)[1]
    return Layout([("partials", torch.float32, blocks * problem.streams * problem.hidden)])


def forward_program(problem, config: GateTiles | None = None) -> Program:
    return Program(stages=(Stage(forward_spec(problem, config),
                                 dict(eps=problem.eps, **_strides(problem, FORWARD_STRIDES))),))


def backward_program(problem, config: GateTiles | None = None) -> Program:
    tiles = config or tiles_for(problem)
    per_block, blocks = backward_blocks(problem, tiles)
    partials = workspace_piece("partials")
    return Program(workspace=backward_workspace(problem, tiles), stages=(
        Stage(backward_spec(problem, tiles), dict(partials=partials, N=problem.tokens,
                                                  TOKENS_PER_BLOCK=per_block,
                                                  **_strides(problem, BACKWARD_STRIDES))),
        Stage(reduce_spec(problem, tiles), dict(partials=partials, NUM_PARTIALS=blocks)),
    ))


forward_candidates = candidates


backward_candidates = candidates
