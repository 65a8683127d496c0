"""The MoE router's Triton programs: specialisations of its kernels (kernels_router.py) for a
problem, from the router's per-architecture table (tiles.ROUTER_TILES, ``config=`` a candidate),
with their traffic (cost_router.py). The math: fusedops.relu2_moe.contract.
"""

from __future__ import annotations

import triton

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride
from fusedops.relu2_moe.contract import NORM_EPS

from ..runtime import KernelSpec, pointer_type
from .cost_router import backward_cost, forward_cost
from .kernels_router import moe_router_bwd_kernel, moe_router_fwd_kernel
from .tiles import RouterTiles, router_candidates, router_tiles_for


def _rows_per_program(problem, tiles: RouterTiles) -> int:
    return max(1, min(64, tiles.scores // triton.next_power_of_2(problem.experts)))


def _grid(problem, tiles: RouterTiles) -> tuple[int]:
    return (triton.cdiv(max(problem.tokens, 1), _rows_per_program(problem, tiles)),)


def _constexprs(problem, tiles: RouterTiles) -> dict:
    return dict(E=problem.experts, EP=triton.next_power_of_2(problem.experts), K=problem.top_k,
                KP=triton.next_power_of_2(problem.top_k), BT=_rows_per_program(problem, tiles),
                VEC=problem.row_vector)


def _strides(problem, *tensors: str) -> dict:
    """The row strides of the [t, E] views, in vectors of ``problem.row_vector`` elements."""
    return {f"stride_{name}": Stride(name, 0, problem.row_vector) for name in tensors}


def forward_spec(problem, tiles: RouterTiles | None = None) -> KernelSpec:
    tiles = tiles or router_tiles_for(problem)
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("correction_bias_ptr", "*fp32" if problem.has_bias else None),
            ("topk_weights_ptr", "*fp32"), ("topk_ids_ptr", "*i32"), ("scale", "fp32"))
    const = dict(_constexprs(problem, tiles), N_GROUP=problem.n_group,
                 GP=triton.next_power_of_2(problem.n_group), TOPK_GROUP=problem.topk_group,
                 NORM=problem.norm_topk_prob, NORM_EPS=NORM_EPS, HAS_BIAS=problem.has_bias)
    return KernelSpec.make(moe_router_fwd_kernel, args, const, _grid(problem, tiles),
                           num_warps=tiles.warps, cost=forward_cost(problem))


def backward_spec(problem, tiles: RouterTiles | None = None) -> KernelSpec:
    tiles = tiles or router_tiles_for(problem)
    lt = pointer_type(problem.logits_dtype)
    args = (("logits_ptr", lt), ("topk_ids_ptr", "*i32"), ("d_topk_weights_ptr", "*fp32"),
            ("d_logits_ptr", lt), ("status_ptr", "*i32" if problem.has_status else None),
            ("scale", "fp32"))
    const = dict(_constexprs(problem, tiles), NORM=problem.norm_topk_prob, NORM_EPS=NORM_EPS,
                 HAS_STATUS=problem.has_status)
    return KernelSpec.make(moe_router_bwd_kernel, args, const, _grid(problem, tiles),
                           num_warps=tiles.warps, cost=backward_cost(problem))


# -- the backend surface ---------------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton router kernels", problem.logits_dtype)


def forward_program(problem, config: RouterTiles | None = None) -> Program:
    return Program(stages=(Stage(forward_spec(problem, config), dict(
        T=problem.tokens, scale=problem.routed_scaling_factor,
        **_strides(problem, "logits"))),))


def backward_program(problem, config: RouterTiles | None = None) -> Program:
    return Program(stages=(Stage(backward_spec(problem, config), dict(
        T=problem.tokens, scale=problem.routed_scaling_factor,
        **_strides(problem, "logits", "d_logits"))),))


forward_candidates = router_candidates


backward_candidates = router_candidates
