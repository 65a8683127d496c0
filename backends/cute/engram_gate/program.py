"""Engram saved-state gate: the CuTe DSL kernels' specialisations and programs for sm_90a/sm_100a
(the math: fusedops.engram_gate.contract; the kernels: kernels.py; their geometry: tiles.py;
their traffic: cost.py).
"""

import math

import torch

from fusedops.core.dtypes import element_size, kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride, workspace_piece
from fusedops.core.workspace import Layout
from fusedops.engram_gate.contract import DOT_CLAMP

from .. import compiler
from ..compiler import Arg, CuteKernel
from .cost import backward_cost, forward_cost, reduce_cost
from .kernels import (backward_grid, forward_grid, gate_bwd, gate_fwd, grad_weight_reduce,
                      reduce_grid)
from .tiles import (MAX_HELD_VECTORS, REDUCE_THREADS, RowGeometry, backward_blocks,
                    backward_shared_bytes, forward_shared_bytes, private_rows_shared, row_geometry)


__all__ = ["backward_program", "forward_program", "unsupported_reason"]


# -- specialisations ---------------------------------------------------------------------------
def _constexprs(problem, geo: RowGeometry, *extra) -> tuple[tuple[str, object], ...]:
    return (("DTYPE", compiler.cutlass_type(problem.dtype)), ("S", problem.streams),
            ("D", problem.hidden), ("VEC", geo.vec), ("THREADS", geo.threads),
            ("ITERS", geo.iters), *extra, ("SQRT_D", math.sqrt(problem.hidden)),
            ("DOT_MIN", DOT_CLAMP))


def forward_kernel(problem) -> CuteKernel:
    dt = problem.dtype
    args = (Arg("x", dt), Arg("kv", dt), Arg("weight", torch.float32), Arg("mask", torch.bool, 1),
            Arg("out", dt), Arg("saved", torch.float32), Arg("N", scalar="i32"),
            Arg("eps", scalar="f32"), *(Arg(name, scalar="i32") for name in FORWARD_STRIDES))
    geo = row_geometry(problem.hidden, problem.dtype)
    held = problem.streams * geo.iters <= MAX_HELD_VECTORS
    return CuteKernel("engram_gate_fwd", gate_fwd, args,
                      _constexprs(problem, geo, ("X_HELD", held), ("HAS_MASK", problem.has_mask)),
                      forward_grid, dynamic_shared_bytes=forward_shared_bytes(problem, geo),
                      threads=geo.threads, launch_grid=tuple(forward_grid(N=problem.tokens)),
                      cost=forward_cost(problem))


def backward_kernel(problem) -> CuteKernel:
    dt = problem.dtype
    args = (Arg("x", dt), Arg("kv", dt), Arg("weight", torch.float32), Arg("saved", torch.float32),
            Arg("grad_out", dt), Arg("grad_x", dt), Arg("grad_kv", dt),
            Arg("partials", torch.float32), Arg("N", scalar="i32"),
            Arg("TOKENS_PER_BLOCK", scalar="i32"), Arg("BLOCKS", scalar="i32", launch_only=True),
            *(Arg(name, scalar="i32") for name in BACKWARD_STRIDES))
    geo = row_geometry(problem.hidden, problem.dtype)
    shared = private_rows_shared(geo)
    blocks = backward_blocks(problem)[1]
    return CuteKernel("engram_gate_bwd", gate_bwd, args,
                      _constexprs(problem, geo, ("SHARED", shared)), backward_grid,
                      dynamic_shared_bytes=backward_shared_bytes(geo, shared), threads=geo.threads,
                      launch_grid=tuple(backward_grid(S=problem.streams, BLOCKS=blocks)),
                      cost=backward_cost(problem))


def reduce_kernel(problem) -> CuteKernel:
    args = (Arg("partials", torch.float32), Arg("grad_weight", torch.float32),
            Arg("NUM_PARTIALS", scalar="i32"))
    sd = problem.streams * problem.hidden
    return CuteKernel("engram_gate_grad_weight_reduce", grad_weight_reduce, args,
                      (("SD", sd), ("ACCUMULATE", problem.accumulate)), reduce_grid,
                      threads=REDUCE_THREADS, launch_grid=tuple(reduce_grid(SD=sd)),
                      cost=reduce_cost(problem))
# the row strides each kernel reads from the tensors execute() is handed (in 16-byte units)
FORWARD_STRIDES = {"sxn": ("x", 0), "sxs": ("x", 1), "skvn": ("kv", 0), "son": ("out", 0),
                   "sos": ("out", 1)}
BACKWARD_STRIDES = {"sxn": ("x", 0), "sxs": ("x", 1), "skvn": ("kv", 0), "sgn": ("grad_out", 0),
                    "sgs": ("grad_out", 1), "sgxn": ("grad_x", 0), "sgxs": ("grad_x", 1),
                    "sgkvn": ("grad_kv", 0)}


def _strides(problem, table) -> dict:
    vec = 16 // element_size(problem.dtype)
    return {arg: Stride(tensor, dim, vec) for arg, (tensor, dim) in table.items()}


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("cute gate kernels", problem.dtype)


def backward_workspace(problem) -> Layout:
    """One fp32 grad_weight partial row [S, D] per token block: 4·S·D·blocks bytes."""
    blocks = backward_blocks(problem)[1]
    return Layout([("partials", torch.float32, blocks * problem.streams * problem.hidden)])


def forward_program(problem) -> Program:
    mask = "mask" if problem.has_mask else None     # absent: a null pointer, never read
    return Program(stages=(Stage(forward_kernel(problem),
                                 dict(mask=mask, N=problem.tokens, eps=problem.eps,
                                      **_strides(problem, FORWARD_STRIDES))),))


def backward_program(problem) -> Program:
    per_block, blocks = backward_blocks(problem)
    partials = workspace_piece("partials")
    return Program(workspace=backward_workspace(problem), stages=(
        Stage(backward_kernel(problem), dict(partials=partials, N=problem.tokens,
                                             TOKENS_PER_BLOCK=per_block, BLOCKS=blocks,
                                             **_strides(problem, BACKWARD_STRIDES))),
        Stage(reduce_kernel(problem), dict(partials=partials, NUM_PARTIALS=blocks)),
    ))
