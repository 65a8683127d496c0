"""Routed ReLU2 experts: specialisations, buffer layouts and programs of the Triton kernels in
moe_kernels.py (fusedops.moe.contract).

Forward: the dispatch (count, scan, offsets, scatter), the up and down grouped GEMMs (and the
shared expert's dense ones), the fixed-order combine. Backward: the down and up dgrad GEMMs, the
routing-weight gradient's fixed-order sum, the weight-gradient GEMMs (and the shared expert's),
the combine. Operands a program does not have (the shared expert's buffers, u in an inference
forward, the routing weights of an unweighted GEMM) are compiled out, never aliased.

The activations (x, d_out read by token; out, d_x written by the combine) may be strided views:
their kernels take the row stride at launch (``Stride``, in 16-byte vectors: the contract's
``row_vector``), so a new stride reuses the compiled kernel.

Tiles come from the per-architecture table in moe_tiles.py (``config=`` a candidate of it);
every kernel spec carries its cost model from moe_cost.py.
"""

from __future__ import annotations

import math

import torch
import triton

from fusedops.core.dtypes import element_size, kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride, saved_piece, workspace_piece
from fusedops.core.target import target_arch
from fusedops.core.workspace import EMPTY, Layout

from . import moe_cost as C
from . import moe_kernels as K
from .moe_tiles import (MoETiles, candidates, dense_bm, gemm_blocks, max_rows, routed_bm, row_tile,
                        tiles_for, wgrad_blocks)
from .runtime import KernelSpec, numerics, pointer_type

BLOCK_A = 256        # assignments per dispatch program
EXPERT_CHUNK = 32    # experts per one-hot tile in the dispatch
SCAN_BLOCKS = 64     # dispatch blocks per step of the prefix scan
REDUCE_BLOCK = 256   # assignments per program of the routing-weight gradient's sum
COMBINE_ROWS = 16    # tokens per combine program

__all__ = ["backward_candidates", "backward_program", "backward_workspace", "forward_candidates",
           "forward_program", "forward_workspace", "max_rows", "row_tile", "saved_layout",
           "unsupported_reason"]

# moe_kernels' epilogues and operand row sources
EPI_UP, EPI_SCATTER, EPI_DGRAD_ACT = 0, 1, 2
BY_ROW, BY_TOKEN, BY_ASSIGNMENT = 0, 1, 2


def _dispatch_blocks(problem) -> int:
    return triton.cdiv(problem.assignments, BLOCK_A)


def _expert_chunk(problem) -> int:
    return min(EXPERT_CHUNK, max(2, triton.next_power_of_2(problem.experts)))


def _experts_padded(problem) -> int:
    chunk = _expert_chunk(problem)
    return triton.cdiv(problem.experts, chunk) * chunk


def _dispatch_pieces(problem):
    return [("counts", torch.int32, problem.experts), ("offsets", torch.int32, problem.experts + 1),
            ("sorted", torch.int32, max_rows(problem))]


# -- buffer layouts --------------------------------------------------------------------------------
def saved_layout(problem) -> Layout:
    """The dispatch (counts [E], offsets [E + 1], sorted [max_rows] int32) and u in x's dtype:
    [t·k, I] by assignment, and [t, I_shared] for the shared expert."""
    return Layout(_dispatch_pieces(problem) + [
        ("u", problem.dtype, problem.assignments * problem.intermediate),
        ("shared_u", problem.dtype, problem.tokens * problem.shared_intermediate)])


def forward_workspace(problem) -> Layout:
    """Dispatch block counts [NB, E_pad] int32, (the dispatch itself for is_inference), the
    activations [max_rows, I] (x's dtype), the weighted expert outputs [t·k, H] fp32, and the
    shared expert's [t, I_shared] activations and [t, H] fp32 output (the same for every
    candidate: the row tile is the table's)."""
    pieces = [("part", torch.int32, _dispatch_blocks(problem) * _experts_padded(problem))]
    if problem.is_inference:
        pieces += _dispatch_pieces(problem)
    t, H = problem.tokens, problem.hidden
    return Layout(pieces + [
        ("act", problem.dtype, max_rows(problem) * problem.intermediate),
        ("y", torch.float32, problem.assignments * H),
        ("shared_act", problem.dtype, t * problem.shared_intermediate),
        ("shared_y", torch.float32, t * H if problem.has_shared else 0)])


def _column_tiles(problem, tiles: MoETiles) -> int:
    """Column tiles of the dgrad-down GEMM (N = I): the routing-weight gradient's partials."""
    return triton.cdiv(problem.intermediate,
                       gemm_blocks(problem, problem.hidden, problem.intermediate, 16, tiles)[1])


def backward_workspace(problem, tiles: MoETiles | None = None) -> Layout:
    """d_u [max_rows, I] (x's dtype), the per-assignment d_x rows [t·k, H] fp32, the routing
    weight gradient's partial sums [I / BN, t·k] fp32 (BN: the configuration's), and the
    shared expert's d_u [t, I_shared] and d_x [t, H] fp32."""
    tiles = tiles or tiles_for(problem)
    t, H = problem.tokens, problem.hidden
    return Layout([
        ("d_u", problem.dtype, max_rows(problem) * problem.intermediate),
        ("dx", torch.float32, problem.assignments * H),
        ("dw_part", torch.float32, _column_tiles(problem, tiles) * problem.assignments),
        ("shared_d_u", problem.dtype, t * problem.shared_intermediate),
        ("shared_dx", torch.float32, t * H if problem.has_shared else 0)])


# -- specialisations -------------------------------------------------------------------------------
def _numerics(problem) -> dict:
    """UPCAST/IEEE, and EXACT: round to bf16 explicitly where the interpreter truncates."""
    flags = numerics(problem.dtype)
    return dict(flags, EXACT=flags["UPCAST"])


def _weight_strides(problem, shared: bool) -> dict[str, tuple[int, int, int]]:
    """(W_up as [k = H, n = I], W_down as [k = I, n = H], W_down as [k = H, n = I],
    W_up as [k = I, n = H]) strides (expert, k, n)."""
    H, I = problem.hidden, problem.shared_intermediate if shared else problem.intermediate
    return dict(up=(I * H, 1, H), down=(H * I, 1, I), down_t=(H * I, I, 1), up_t=(I * H, H, 1))


def _row_stride(problem, tensor: str) -> Stride:
    """The row stride of activation ``tensor`` [t, H] (x, d_out, out, d_x) in vectors of
    ``problem.row_vector`` elements (the plan's own buffers keep constexpr widths)."""
    return Stride(tensor, 0, problem.row_vector)


def _dispatch_bind(home) -> dict:
    return dict(sorted_ptr=home("sorted"), offsets_ptr=home("offsets"), counts_ptr=home("counts"))


def _epilogue_flops(epilogue: int, weighted: bool) -> int:
    """CUDA-core FLOPs per output element: UP relu and square; SCATTER the routing weight (when
    weighted); DGRAD_ACT relu and 2·relu(u)·g, and when weighted the square, the <g, a> product
    and sum and the weight."""
    if epilogue == EPI_UP:
        return 2
    if epilogue == EPI_SCATTER:
        return int(weighted)
    return 7 if weighted else 3


def gemm_stage(problem, tiles: MoETiles, *, routed: bool, kdim: int, ndim: int, strides,
               epilogue: int, a_by_token: bool, a, b, out, out_dtype=None, weighted: bool = False,
               u=None, part=None, home=saved_piece) -> Stage:
    """One grouped GEMM launch: A (``a``, gathered by token or read by row) times W[e] (``b``
    through ``strides``) into ``out`` with ``epilogue`` (EPI_*). ``u``: the u buffer
    the epilogue writes (EPI_UP) or reads (EPI_DGRAD_ACT); ``part``: the <g, a> partials;
    ``weighted``: scale by the routing weights; ``home``: where the dispatch lives. Absent
    operands are compiled out."""
    bm = routed_bm(problem, tiles) if routed else dense_bm(problem, tiles)
    bm, bn, bk, warps = gemm_blocks(problem, kdim, ndim, bm, tiles)
    t = pointer_type(problem.dtype)
    index = "*i32" if routed else None
    args = (("a_ptr", t), ("b_ptr", t), ("sorted_ptr", index), ("offsets_ptr", index),
            ("counts_ptr", index), ("weight_ptr", "*fp32" if weighted else None),
            ("u_ptr", None if u is None else t),
            ("out_ptr", pointer_type(out_dtype or problem.dtype)),
            ("part_ptr", None if part is None else "*fp32"), ("T", "i32"), ("M_TILES", "i32"),
            ("stride_a", "i32" if a_by_token else None))
    be, bks, bns = strides
    const = dict(K_TOP=problem.top_k if routed else 1, E=problem.experts if routed else 1,
                 KDIM=kdim, NDIM=ndim, STRIDE_BE=be, STRIDE_BK=bks, STRIDE_BN=bns, ROUTED=routed,
                 A_BY_TOKEN=a_by_token, EPILOGUE=epilogue, WEIGHTED=weighted,
                 SAVE_U=epilogue == EPI_UP and u is not None, BM=bm, BN=bn, BK=bk,
                 GROUP_M=tiles.group_m,
                 STEPS=max(1, math.ceil(math.log2(max(problem.experts, 2)))) + 1,
                 VEC=problem.row_vector, **_numerics(problem))
    m_tiles = triton.cdiv(max_rows(problem) if routed else problem.tokens, bm)
    out_bytes = element_size(out_dtype or problem.dtype)
    cost = C.gemm_cost(problem, routed=routed, kdim=kdim, ndim=ndim, bm=bm, bn=bn, bk=bk,
                       out_bytes=out_bytes, group_m=tiles.group_m, grid_m_tiles=m_tiles,
                       row_tile=row_tile(problem, tiles), a_by_token=a_by_token,
                       arch=target_arch(problem.device), ctas_per_sm=tiles.ctas_per_sm,
                       save_u=const["SAVE_U"], read_u=epilogue == EPI_DGRAD_ACT,
                       weighted=weighted, part=part is not None,
                       epilogue_flops=_epilogue_flops(epilogue, weighted))
    spec = KernelSpec.make(K.moe_gemm_kernel, args, const, (m_tiles * triton.cdiv(ndim, bn),),
                           num_warps=warps, num_stages=tiles.stages, cost=cost)
    bind = dict(a_ptr=a, b_ptr=b, out_ptr=out, T=problem.tokens, M_TILES=m_tiles)
    if a_by_token:
        bind["stride_a"] = _row_stride(problem, a)
    if routed:
        bind.update(_dispatch_bind(home))
    if weighted:
        bind["weight_ptr"] = "topk_weights"
    if u is not None:
        bind["u_ptr"] = u
    if part is not None:
        bind["part_ptr"] = part
    return Stage(spec, bind)


def wgrad_stage(problem, tiles: MoETiles, *, routed: bool, m: int, n: int, p_source: int,
                p_weighted: bool, q_source: int, q_relu2: bool, p, q, grad) -> Stage:
    """grad[e] (+)= sum over e's rows of P[row, m] · Q[row, n] (rows of P and Q: BY_*)."""
    t = pointer_type(problem.dtype)
    index = "*i32" if routed else None
    args = (("p_ptr", t), ("q_ptr", t), ("sorted_ptr", index), ("offsets_ptr", index),
            ("counts_ptr", index), ("weight_ptr", "*fp32" if p_weighted else None),
            ("grad_ptr", pointer_type(problem.weight_grad_dtype)), ("T", "i32"),
            ("stride_p", "i32" if p_source == BY_TOKEN else None),
            ("stride_q", "i32" if q_source == BY_TOKEN else None))
    bm, bn, bk, warps = wgrad_blocks(problem, m, n, tiles)
    const = dict(K_TOP=problem.top_k if routed else 1, E=problem.experts if routed else 1, M=m,
                 N=n, ROUTED=routed, P_SOURCE=p_source, P_WEIGHTED=p_weighted, Q_SOURCE=q_source,
                 Q_RELU2=q_relu2, ACCUMULATE=problem.accumulate, BM=bm, BN=bn, BK=bk,
                 VEC=problem.row_vector, **_numerics(problem))
    grid = (const["E"], triton.cdiv(m, bm), triton.cdiv(n, bn))
    cost = C.wgrad_cost(problem, routed=routed, m=m, n=n, bm=bm, bn=bn, bk=bk,
                        p_by_token=p_source == BY_TOKEN, q_by_token=q_source == BY_TOKEN,
                        p_weighted=p_weighted, q_relu2=q_relu2,
                        arch=target_arch(problem.device), ctas_per_sm=tiles.ctas_per_sm)
    spec = KernelSpec.make(K.moe_wgrad_kernel, args, const, grid, num_warps=warps,
                           num_stages=tiles.wgrad_stages, cost=cost)
    bind = dict(p_ptr=p, q_ptr=q, grad_ptr=grad, T=problem.tokens)
    if p_source == BY_TOKEN:
        bind["stride_p"] = _row_stride(problem, p)
    if q_source == BY_TOKEN:
        bind["stride_q"] = _row_stride(problem, q)
    if routed:
        bind.update(_dispatch_bind(saved_piece))
    if p_weighted:
        bind["weight_ptr"] = "topk_weights"
    return Stage(spec, bind)


def dispatch_stages(problem, home) -> tuple[Stage, ...]:
    """count, scan, offsets, scatter: topk_ids -> counts, offsets, sorted (in ``home``)."""
    E, chunk, e_pad = problem.experts, _expert_chunk(problem), _experts_padded(problem)
    block = dict(E=E, E_PAD=e_pad, EC=chunk, BLOCK_A=BLOCK_A)
    blocks = (_dispatch_blocks(problem),)
    part, A = workspace_piece("part"), problem.assignments
    status = "*i32" if problem.has_status else None
    count = KernelSpec.make(K.moe_count_kernel, (("ids_ptr", "*i32"), ("part_ptr", "*i32"),
                                                 ("status_ptr", status), ("A", "i32")),
                            dict(block, HAS_STATUS=problem.has_status), blocks,
                            cost=C.count_cost(problem, blocks[0], e_pad))
    scan = KernelSpec.make(K.moe_scan_kernel, (("part_ptr", "*i32"), ("counts_ptr", "*i32"),
                                               ("NB", "i32")),
                           dict(E=E, E_PAD=e_pad, EC=chunk, BB=SCAN_BLOCKS), (e_pad // chunk,),
                           cost=C.scan_cost(problem, blocks[0], e_pad))
    offsets = KernelSpec.make(K.moe_offsets_kernel,
                              (("counts_ptr", "*i32"), ("offsets_ptr", "*i32")),
                              dict(E=E, EP=triton.next_power_of_2(E), TILE=row_tile(problem)), (1,),
                              cost=C.offsets_cost(problem))
    scatter = KernelSpec.make(K.moe_scatter_kernel,
                              (("ids_ptr", "*i32"), ("part_ptr", "*i32"), ("offsets_ptr", "*i32"),
                               ("sorted_ptr", "*i32"), ("A", "i32")), block, blocks,
                              cost=C.scatter_cost(problem, blocks[0], e_pad))
    return (Stage(count, dict(ids_ptr="topk_ids", part_ptr=part, A=A)),
            Stage(scan, dict(part_ptr=part, counts_ptr=home("counts"), NB=blocks[0])),
            Stage(offsets, dict(counts_ptr=home("counts"), offsets_ptr=home("offsets"))),
            Stage(scatter, dict(ids_ptr="topk_ids", part_ptr=part, offsets_ptr=home("offsets"),
                                sorted_ptr=home("sorted"), A=A)))


def combine_stage(problem, buf, shared, out: str) -> Stage:
    """out[t] = the sum over j (in order) of the fp32 rows ``buf`` (+ ``shared``), rounded once."""
    bh = min(256, max(16, triton.next_power_of_2(problem.hidden)))
    args = (("buf_ptr", "*fp32"), ("shared_ptr", "*fp32" if problem.has_shared else None),
            ("ids_ptr", "*i32"), ("out_ptr", pointer_type(problem.dtype)), ("T", "i32"),
            ("stride_out", "i32"))
    const = dict(K_TOP=problem.top_k, E=problem.experts, H=problem.hidden,
                 HAS_SHARED=problem.has_shared, BT=COMBINE_ROWS, BH=bh,
                 EXACT=_numerics(problem)["EXACT"], VEC=problem.row_vector)
    grid = (triton.cdiv(problem.tokens, COMBINE_ROWS), triton.cdiv(problem.hidden, bh))
    spec = KernelSpec.make(K.moe_combine_kernel, args, const, grid,
                           cost=C.combine_cost(problem, COMBINE_ROWS, bh,
                                               target_arch(problem.device)))
    bind = dict(buf_ptr=buf, ids_ptr="topk_ids", out_ptr=out, T=problem.tokens,
                stride_out=_row_stride(problem, out))
    if problem.has_shared:
        bind["shared_ptr"] = shared
    return Stage(spec, bind)


def weight_grad_reduce_stage(problem, tiles: MoETiles) -> Stage:
    """d_topk_weights[a] = the sum over the column tiles (in order) of the <g, a> partials."""
    parts = _column_tiles(problem, tiles)
    spec = KernelSpec.make(K.moe_weight_grad_reduce_kernel,
                           (("part_ptr", "*fp32"), ("ids_ptr", "*i32"), ("dw_ptr", "*fp32"),
                            ("status_ptr", "*i32" if problem.has_status else None), ("A", "i32")),
                           dict(E=problem.experts, PARTS=parts,
                                BLOCK=REDUCE_BLOCK, HAS_STATUS=problem.has_status),
                           (triton.cdiv(problem.assignments, REDUCE_BLOCK),),
                           cost=C.weight_grad_reduce_cost(problem, parts))
    return Stage(spec, dict(part_ptr=workspace_piece("dw_part"), ids_ptr="topk_ids",
                            dw_ptr="d_topk_weights", A=problem.assignments))


# -- the backend surface ---------------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton MoE kernels", problem.dtype)


def _expert_forward_stages(problem, tiles: MoETiles, shared: bool, home) -> list[Stage]:
    """The up GEMM (u saved unless is_inference, relu(u)² to the workspace) and the down GEMM
    (fp32 rows, weighted when routed) of the routed experts or of the shared expert."""
    H = problem.hidden
    inter = problem.shared_intermediate if shared else problem.intermediate
    routed = not shared
    pre = "shared_" if shared else ""
    ws = workspace_piece
    st = _weight_strides(problem, shared)
    u = None if problem.is_inference else saved_piece(pre + "u")
    return [
        gemm_stage(problem, tiles, routed=routed, kdim=H, ndim=inter, strides=st["up"],
                   epilogue=EPI_UP, a_by_token=True, a="x", b=pre + "w_up", out=ws(pre + "act"),
                   u=u, home=home),
        gemm_stage(problem, tiles, routed=routed, kdim=inter, ndim=H, strides=st["down"],
                   epilogue=EPI_SCATTER, a_by_token=False, a=ws(pre + "act"), b=pre + "w_down",
                   out=ws(pre + "y"), out_dtype=torch.float32, weighted=routed, home=home)]


def forward_program(problem, config: MoETiles | None = None) -> Program:
    tiles = config or tiles_for(problem)
    home = workspace_piece if problem.is_inference else saved_piece
    stages = [*dispatch_stages(problem, home), *_expert_forward_stages(problem, tiles, False, home)]
    if problem.has_shared:
        stages += _expert_forward_stages(problem, tiles, True, home)
    stages.append(combine_stage(problem, workspace_piece("y"), workspace_piece("shared_y"), "out"))
    return Program(workspace=forward_workspace(problem),
                   saved=EMPTY if problem.is_inference else saved_layout(problem),
                   stages=tuple(stages))


def _expert_backward_stages(problem, tiles: MoETiles, shared: bool) -> list[Stage]:
    """dgrad down, dgrad up (and, routed, the routing-weight gradient), wgrad down, wgrad up of
    the routed experts or of the shared expert."""
    H = problem.hidden
    inter = problem.shared_intermediate if shared else problem.intermediate
    routed = not shared
    pre = "shared_" if shared else ""
    ws, u = workspace_piece, saved_piece(pre + "u")
    st = _weight_strides(problem, shared)
    stages = [
        gemm_stage(problem, tiles, routed=routed, kdim=H, ndim=inter, strides=st["down_t"],
                   epilogue=EPI_DGRAD_ACT, a_by_token=True, a="d_out", b=pre + "w_down",
                   out=ws(pre + "d_u"), weighted=routed, u=u,
                   part=ws("dw_part") if routed else None),
        gemm_stage(problem, tiles, routed=routed, kdim=inter, ndim=H, strides=st["up_t"],
                   epilogue=EPI_SCATTER, a_by_token=False, a=ws(pre + "d_u"), b=pre + "w_up",
                   out=ws(pre + "dx"), out_dtype=torch.float32)]
    if routed:
        stages.append(weight_grad_reduce_stage(problem, tiles))
    stages += [
        wgrad_stage(problem, tiles, routed=routed, m=H, n=inter, p_source=BY_TOKEN,
                    p_weighted=routed, q_source=BY_ASSIGNMENT, q_relu2=True, p="d_out", q=u,
                    grad=f"d_{pre}w_down"),
        wgrad_stage(problem, tiles, routed=routed, m=inter, n=H, p_source=BY_ROW, p_weighted=False,
                    q_source=BY_TOKEN, q_relu2=False, p=ws(pre + "d_u"), q="x",
                    grad=f"d_{pre}w_up")]
    return stages


def backward_program(problem, config: MoETiles | None = None) -> Program:
    tiles = config or tiles_for(problem)
    stages = _expert_backward_stages(problem, tiles, shared=False)
    if problem.has_shared:
        stages += _expert_backward_stages(problem, tiles, shared=True)
    stages.append(combine_stage(problem, workspace_piece("dx"), workspace_piece("shared_dx"),
                                "d_x"))
    return Program(workspace=backward_workspace(problem, tiles), saved=saved_layout(problem),
                   stages=tuple(stages))


forward_candidates = candidates
backward_candidates = candidates
