"""Mamba2 inference: the Triton kernels' specialisations and programs for the state update and the
rollback (the math: fusedops.mamba2_inference.contract; the kernels: kernels.py; their tiles:
tiles.py; their traffic: cost.py).
"""

from __future__ import annotations

import torch
import triton

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride
from fusedops.mamba2_inference.contract import SOFTPLUS_THRESHOLD, DecodeProblem

from .. import interpreter_active
from ..runtime import KernelSpec, pointer_type
from .cost import rollback_cost, update_cost
from .kernels import ssd_rollback_kernel, ssd_state_update_kernel
from .tiles import DecodeTiles, head_dim_rows, candidates, tiles_for


update_candidates = candidates


rollback_candidates = candidates


def update_spec(problem, tiles: DecodeTiles | None = None) -> KernelSpec:
    """The state update over the T tokens: one program per (row, head, head-dim tile)."""
    tiles = tiles or tiles_for(problem)
    bp = head_dim_rows(problem, tiles)
    xt, st = pointer_type(problem.dtype), pointer_type(problem.state_dtype)

    def present(flag, triton_type):
        return triton_type if flag else None
    bt = pointer_type(problem.b_dtype)
    args = (("state_ptr", st), ("x_ptr", xt), ("dt_ptr", pointer_type(problem.dt_dtype)),
            ("A_ptr", "*fp32"), ("B_ptr", bt), ("C_ptr", bt),
            ("D_ptr", present(problem.has_D, "*fp32")), ("z_ptr", present(problem.has_z, xt)),
            ("dt_bias_ptr", present(problem.has_dt_bias, "*fp32")),
            ("state_batch_indices_ptr", present(problem.has_indices, "*i32")),
            ("rng_seed_ptr", present(problem.stochastic, "*i64")),
            ("rng_offset_ptr", present(problem.stochastic, "*i64")), ("y_ptr", xt),
            ("snapshots_ptr", present(problem.has_snapshots, st)),
            ("status_ptr", present(problem.has_status, "*i32")),
            *((name, "i64") for name in UPDATE_STRIDES if name.endswith("_b")),
            ("dt_min", "fp32"), ("dt_max", "fp32"))
    bn = triton.next_power_of_2(problem.state)
    constexprs = dict(H=problem.heads, G=problem.groups, P=problem.head_dim,
                      N=problem.state, BP=bp, BN=bn,
                      PERIOD=problem.checkpoint_period, HAS_D=problem.has_D,
                      D_PER_CHANNEL=problem.D_per_channel, HAS_Z=problem.has_z,
                      HAS_BIAS=problem.has_dt_bias, SOFTPLUS=problem.dt_softplus,
                      HAS_INDICES=problem.has_indices, STOCHASTIC=problem.stochastic,
                      HAS_SNAPSHOTS=problem.has_snapshots,
                      EXACT_NEAREST=interpreter_active() and problem.state_dtype == torch.bfloat16,
                      SOFTPLUS_THRESHOLD=SOFTPLUS_THRESHOLD, HAS_STATUS=problem.has_status,
                      VX=problem.vector, VB=problem.bc_vector, VDT=problem.dt_vector)
    warps = max(1, min(tiles.MAX_WARPS, bp * bn // tiles.ELEMENTS_PER_WARP))
    grid = (problem.batch, problem.heads, triton.cdiv(problem.head_dim, bp))
    # with Philox, ptxas otherwise settles at ~72 registers and keeps a small stack frame
    return KernelSpec.make(ssd_state_update_kernel, args, constexprs, grid, num_warps=warps,
                           num_stages=1, maxnreg=128 if problem.stochastic else None,
                           cost=update_cost(problem, bp))


def rollback_spec(problem, tiles: DecodeTiles | None = None) -> KernelSpec:
    """The rollback: one program per (row, tile of the [h, p, n] state)."""
    tiles = tiles or tiles_for(problem)
    st = pointer_type(problem.state_dtype)
    block = min(tiles.ROLLBACK_BLOCK, triton.next_power_of_2(problem.state_numel))
    constexprs = dict(T=problem.tokens, NUMEL=problem.state_numel, BLOCK=block,
                      HAS_INDICES=problem.has_indices, HAS_STATUS=problem.has_status)
    args = (("state_ptr", st), ("snapshots_ptr", st), ("accepted_ptr", "*i32"),
            ("state_batch_indices_ptr", "*i32" if problem.has_indices else None),
            ("status_ptr", "*i32" if problem.has_status else None))
    return KernelSpec.make(ssd_rollback_kernel, args, constexprs,
                           (problem.batch, triton.cdiv(problem.state_numel, block)), num_warps=4,
                           num_stages=1, cost=rollback_cost(problem, block))


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    """Why the Triton kernels cannot serve ``problem`` (None: every dtype the plans take)."""
    dtype = problem.dtype if isinstance(problem, DecodeProblem) else problem.state_dtype
    return kernel_dtype_reason("Triton Mamba2 inference kernels", dtype)


UPDATE_STRIDES = {"stride_x_b": ("x", 0), "stride_x_t": ("x", 1), "stride_x_h": ("x", 2),
                  "stride_dt_b": ("dt", 0), "stride_dt_t": ("dt", 1),
                  "stride_B_b": ("B", 0), "stride_B_t": ("B", 1), "stride_B_g": ("B", 2),
                  "stride_C_b": ("C", 0), "stride_C_t": ("C", 1), "stride_C_g": ("C", 2),
                  "stride_z_b": ("z", 0), "stride_z_t": ("z", 1), "stride_z_h": ("z", 2),
                  "stride_y_b": ("y", 0), "stride_y_t": ("y", 1), "stride_y_h": ("y", 2)}


"""The update kernel's stride arguments: (tensor, dim)."""


def _update_strides(problem) -> dict:
    """The stride binds, in units of each operand's vector (z's are 0 without z)."""
    units = dict(x=problem.vector, z=problem.vector, y=problem.vector, B=problem.bc_vector,
                 C=problem.bc_vector, dt=problem.dt_vector)
    return {arg: Stride(tensor, dim, units[tensor]) if tensor != "z" or problem.has_z else 0
            for arg, (tensor, dim) in UPDATE_STRIDES.items()}


def update_program(problem, config: DecodeTiles | None = None) -> Program:
    """One launch: every row, head and head-dim tile over the T tokens (blocks: the table's
    entry for the plan's architecture, or ``config``)."""
    lo, hi = problem.dt_limit
    return Program(stages=(Stage(update_spec(problem, config),
                                 dict(SLOTS=problem.slots, T=problem.tokens, dt_min=lo,
                                      dt_max=hi, **_update_strides(problem))),))


def rollback_program(problem, config: DecodeTiles | None = None) -> Program:
    """One launch: every row's accepted snapshot, tile by tile, into its slot."""
    return Program(stages=(Stage(rollback_spec(problem, config), dict(SLOTS=problem.slots)),))
