"""Routed ReLU2 experts: specialisations, buffer layouts and programs of the Triton kernels in
kernels.py (fusedops.relu2_moe.contract).

Forward: the dispatch (count, scan, offsets, scatter), the up GEMM (u by assignment) and the down
GEMM (relu(u)² formed in registers, the weighted rows per assignment in x's dtype), then the
shared expert's up GEMM and its down GEMM, whose epilogue adds the k rows of each token (without
a shared expert, the combine kernel sums them). Backward: the down and up dgrad GEMMs, the
routing-weight gradient's fixed-order sum, the weight-gradient GEMMs (routed, with a
deterministic split-K for experts holding more than a chunk of rows: ``wgrad_stages``), then the
shared expert's, whose up dgrad sums the rows of d_x (or the combine) and whose two weight
gradients share one launch where the tile table says (``dense_wgrad_pair_stage``). Operands a
program does not have (the shared expert's buffers, the routing weights of an unweighted GEMM)
are compiled out, never aliased.

The activations (x, d_out read by token; out, d_x written by the combining epilogue or kernel)
may be strided views: their kernels take the row stride at launch (``Stride``, in 16-byte
vectors: the contract's ``row_vector``), so a new stride reuses the compiled kernel.

Tiles come from the per-architecture table in tiles.py (``config=`` a candidate of it);
every kernel spec carries its cost model from cost.py.
"""

from __future__ import annotations

import math

import torch
import triton

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride, saved_piece, workspace_piece
from fusedops.core.target import target_arch
from fusedops.core.workspace import EMPTY, Layout

from . import cost as C
from . import kernels as K
from .tiles import (MoETiles, candidates, dense_bm, gemm_blocks, gemm_tile, max_rows, routed_bm,
                    row_tile, tiles_for, wgrad_blocks, wgrad_split)
from ..runtime import KernelSpec, numerics, pointer_type

BLOCK_A = 256        # assignments per dispatch program
EXPERT_CHUNK = 32    # experts per one-hot tile in the dispatch
SCAN_BLOCKS = 64     # dispatch blocks per step of the prefix scan
REDUCE_BLOCK = 256   # assignments per program of the routing-weight gradient's sum
COMBINE_ROWS = 16    # tokens per combine program

__all__ = ["backward_candidates", "backward_program", "backward_workspace", "forward_candidates",
           "forward_program", "forward_workspace", "max_rows", "row_tile", "saved_layout",
           "unsupported_reason"]

# kernels' epilogues and operand row sources
EPI_UP, EPI_SCATTER, EPI_DGRAD_ACT, EPI_COMBINE = 0, 1, 2, 3
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
def _u_pieces(problem):
    """u by assignment [t·k, I] and the shared expert's [t, I_shared], x's dtype."""
    return [("u", problem.dtype, problem.assignments * problem.intermediate),
            ("shared_u", problem.dtype, problem.tokens * problem.shared_intermediate)]


def saved_layout(problem) -> Layout:
    """The dispatch (counts [E], offsets [E + 1], sorted [max_rows] int32) and u in x's dtype:
    [t·k, I] by assignment, and [t, I_shared] for the shared expert."""
    return Layout(_dispatch_pieces(problem) + _u_pieces(problem))


def forward_workspace(problem, tiles: MoETiles | None = None) -> Layout:
    """Dispatch block counts [NB, E_pad] int32, (the dispatch and u for is_inference), the
    weighted expert outputs per assignment [t·k, H] in x's dtype and, where the routed down GEMM
    computes its product transposed (``down_reads_act``), a = relu(u)² [t·k, I] in x's dtype."""
    tiles = tiles or tiles_for(problem)
    pieces = [("part", torch.int32, _dispatch_blocks(problem) * _experts_padded(problem))]
    if problem.is_inference:
        pieces += _dispatch_pieces(problem) + _u_pieces(problem)
    if down_reads_act(problem, tiles):
        pieces.append(("act", problem.dtype, problem.assignments * problem.intermediate))
    return Layout(pieces + [("rows", problem.dtype, problem.assignments * problem.hidden)])


def down_reads_act(problem, tiles: MoETiles) -> bool:
    """Whether the routed down GEMM reads a = relu(u)², written by the up GEMM's epilogue, rather
    than forming it from u on its register operand: when it computes its product transposed
    (``swapped``), which puts u on the shared-memory side (decode-sized row tiles on sm_90 and
    sm_100)."""
    bm = routed_bm(problem, tiles)
    bn = gemm_blocks(problem, problem.intermediate, problem.hidden, bm, tiles, relu2=True)[1]
    return swapped(problem, bm, bn)


def _column_tiles(problem, tiles: MoETiles) -> int:
    """Column tiles of the dgrad-down GEMM (N = I): the routing-weight gradient's partials."""
    bn = gemm_blocks(problem, problem.hidden, problem.intermediate, routed_bm(problem, tiles),
                     tiles, fused=True)[1]
    return triton.cdiv(problem.intermediate, bn)


def _wgrad_split(problem, tiles: MoETiles) -> tuple[int, int]:
    """(slots, chunk) of the routed weight gradients (``tiles.wgrad_split``)."""
    bk = wgrad_blocks(problem, problem.intermediate, problem.hidden, tiles)[2]
    return wgrad_split(problem, tiles, bk)


def backward_workspace(problem, tiles: MoETiles | None = None) -> Layout:
    """d_u [max_rows, I] by row (x's dtype), the d_x rows per assignment [t·k, H] (x's dtype),
    the routing weight gradient's partial sums [I / BN, t·k] fp32 (BN: the configuration's),
    the shared expert's d_u [t, I_shared], and the routed weight gradients' split-K work table
    [2·slots, 8] int32 and slots [slots, I·H] fp32 (``wgrad_split``; both GEMMs use them in
    turn)."""
    tiles = tiles or tiles_for(problem)
    slots = _wgrad_split(problem, tiles)[0]
    table = 2 * slots * 8
    return Layout([
        ("d_u", problem.dtype, max_rows(problem) * problem.intermediate),
        ("rows", problem.dtype, problem.assignments * problem.hidden),
        ("dw_part", torch.float32, _column_tiles(problem, tiles) * problem.assignments),
        ("shared_d_u", problem.dtype, problem.tokens * problem.shared_intermediate),
        ("wgrad_table", torch.int32, table),
        ("wgrad_part", torch.float32, slots * problem.intermediate * problem.hidden)])


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


def _epilogue_flops(epilogue: int, weighted: bool, top_k: int) -> int:
    """CUDA-core FLOPs per output element: SCATTER the routing weight (when weighted);
    DGRAD_ACT relu and 2·relu(u)·g, and when weighted the square, the <g, a> product and sum
    and the weight; COMBINE the k rows and the product added."""
    if epilogue == EPI_UP:
        return 0
    if epilogue == EPI_SCATTER:
        return int(weighted)
    if epilogue == EPI_COMBINE:
        return top_k
    return 7 if weighted else 3


def swapped(problem, bm: int, bn: int) -> bool:
    """Whether a grouped GEMM computes its product transposed (``SWAP``): on sm_90 and sm_100,
    whose warpgroup and tcgen05 MMAs need 64 rows, when its row tile has fewer and its column
    tile at least 64 (sm_80's mma.sync takes 16-row tiles as they are)."""
    return target_arch(problem.device) != "sm_80" and bm < 64 <= bn


def gemm_stage(problem, tiles: MoETiles, *, routed: bool, kdim: int, ndim: int, strides,
               epilogue: int, a_source: int, a, b, out, a_relu2: bool = False,
               weighted: bool = False, u=None, part=None, rows=None, act=None,
               home=saved_piece) -> Stage:
    """One grouped GEMM launch: A (``a``, read by ``a_source``: BY_TOKEN gathered, BY_ASSIGNMENT,
    BY_ROW; ``a_relu2``: relu(A)² in registers) times W[e] (``b`` through ``strides``) into
    ``out`` with ``epilogue`` (EPI_*). ``u``: the u buffer the DGRAD_ACT epilogue reads;
    ``part``: the <g, a> partials; ``rows``: the per-assignment rows a COMBINE epilogue adds
    (``out`` is then the strided out or d_x); ``act``: where an UP epilogue also writes relu(u)²;
    ``weighted``: scale by the routing weights; ``home``: where the dispatch lives. Absent
    operands are compiled out."""
    combine = epilogue == EPI_COMBINE
    bm = routed_bm(problem, tiles) if routed else dense_bm(problem, tiles)
    fused = combine or epilogue == EPI_DGRAD_ACT
    bm, bn, bk, warps, stages = gemm_blocks(problem, kdim, ndim, bm, tiles, fused=fused,
                                            relu2=a_relu2)
    maxnreg = gemm_tile(tiles, bm, fused, a_relu2).maxnreg if warps == 8 else None
    group_m = tiles.group_m if routed else tiles.dense_group_m
    t = pointer_type(problem.dtype)
    index = "*i32" if routed else None
    args = (("a_ptr", t), ("b_ptr", t), ("sorted_ptr", index), ("offsets_ptr", index),
            ("counts_ptr", index), ("weight_ptr", "*fp32" if weighted else None),
            ("u_ptr", None if u is None else t), ("out_ptr", t),
            ("act_ptr", None if act is None else t),
            ("part_ptr", None if part is None else "*fp32"),
            ("rows_ptr", t if combine else None), ("ids_ptr", "*i32" if combine else None),
            ("stride_a", "i32" if a_source == BY_TOKEN else None),
            ("stride_out", "i32" if combine else None))
    be, bks, bns = strides
    const = dict(K_TOP=problem.top_k, E=problem.experts, KDIM=kdim, NDIM=ndim, STRIDE_BE=be,
                 STRIDE_BK=bks, STRIDE_BN=bns, ROUTED=routed, A_SOURCE=a_source, A_RELU2=a_relu2,
                 EPILOGUE=epilogue, WEIGHTED=weighted, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                 STEPS=max(1, math.ceil(math.log2(max(problem.experts, 2)))) + 1,
                 VEC=problem.row_vector, SWAP=swapped(problem, bm, bn),
                 QUARTERS=fused and tiles.epilogue_quarters,
                 **_numerics(problem))
    m_tiles = triton.cdiv(max_rows(problem) if routed else problem.tokens, bm)
    cost = C.gemm_cost(problem, routed=routed, kdim=kdim, ndim=ndim, bm=bm, bn=bn, bk=bk,
                       group_m=group_m, grid_m_tiles=m_tiles,
                       row_tile=row_tile(problem, tiles), arch=target_arch(problem.device),
                       epilogue_read="u" if u is not None else "rows" if combine else None,
                       a_relu2=a_relu2, weighted=weighted, part=part is not None,
                       epilogue_flops=_epilogue_flops(epilogue, weighted, problem.top_k),
                       swap=const["SWAP"], act=act is not None)
    spec = KernelSpec.make(K.moe_gemm_kernel, args, const, (m_tiles * triton.cdiv(ndim, bn),),
                           num_warps=warps, num_stages=stages, maxnreg=maxnreg, cost=cost)
    bind = dict(a_ptr=a, b_ptr=b, out_ptr=out, T=problem.tokens, M_TILES=m_tiles)
    if a_source == BY_TOKEN:
        bind["stride_a"] = _row_stride(problem, a)
    if routed:
        bind.update(_dispatch_bind(home))
    if weighted:
        bind["weight_ptr"] = "topk_weights"
    if u is not None:
        bind["u_ptr"] = u
    if act is not None:
        bind["act_ptr"] = act
    if part is not None:
        bind["part_ptr"] = part
    if combine:
        bind.update(rows_ptr=rows, ids_ptr="topk_ids", stride_out=_row_stride(problem, out))
    return Stage(spec, bind)


def wgrad_stages(problem, tiles: MoETiles, *, routed: bool, inter: int, a_source: int,
                 a_relu2: bool, a_weighted: bool, transposed: bool, a, b, grad) -> list[Stage]:
    """grad[e] (+)= the sum over e's rows of A[row, :inter]ᵀ · B[token, :H]: A = ``a`` (d_u by
    row, or u by assignment turned into relu(u)² (``a_relu2``) times the routing weight
    (``a_weighted``)), B = ``b`` (x or d_out) by token; ``grad`` [E, inter, H], or [E, H, inter]
    when ``transposed``. Routed with split-K slots (``wgrad_split``): three launches, the
    experts within a chunk, the chunks past a split expert's first (into the slots), and the
    split experts' first chunks plus their slots, in order."""
    t = pointer_type(problem.dtype)
    index = "*i32" if routed else None
    H = problem.hidden
    slots, chunk = _wgrad_split(problem, tiles) if routed else (0, 0)
    args = (("a_ptr", t), ("b_ptr", t), ("sorted_ptr", index), ("offsets_ptr", index),
            ("counts_ptr", index), ("weight_ptr", "*fp32" if a_weighted else None),
            ("grad_ptr", pointer_type(problem.weight_grad_dtype)),
            ("table_ptr", "*i32" if slots else None), ("part_ptr", "*fp32" if slots else None))
    bm, bn, bk, warps = wgrad_blocks(problem, inter, H, tiles)
    group_m = tiles.wgrad_group_m if routed else tiles.dense_wgrad_group_m
    experts = problem.experts if routed else 1
    const = dict(K_TOP=problem.top_k if routed else 1, E=experts,
                 M=inter, N=H, ROUTED=routed, A_SOURCE=a_source, A_RELU2=a_relu2,
                 A_WEIGHTED=a_weighted, TRANSPOSED=transposed, ACCUMULATE=problem.accumulate,
                 BM=bm, BN=bn, BK=bk, GROUP_M=group_m, SPLIT=0, CHUNK=chunk, SLOTS=slots,
                 VEC=problem.row_vector,
                 **_numerics(problem))
    bind = dict(a_ptr=a, b_ptr=b, grad_ptr=grad, T=problem.tokens,
                stride_b=_row_stride(problem, b))
    if routed:
        bind.update(_dispatch_bind(saved_piece))
    if a_weighted:
        bind["weight_ptr"] = "topk_weights"
    if slots:
        bind.update(table_ptr=workspace_piece("wgrad_table"),
                    part_ptr=workspace_piece("wgrad_part"))
    tiles_per = triton.cdiv(inter, bm) * triton.cdiv(H, bn)
    launches = ((0, experts),) if not slots else ((1, experts), (2, slots), (3, slots))
    stages = []
    for split, items in launches:
        cost = C.wgrad_cost(problem, routed=routed, m=inter, n=H, bm=bm, bn=bn, bk=bk,
                            group_m=group_m, a_relu2=a_relu2, a_weighted=a_weighted,
                            arch=target_arch(problem.device), split=split, chunk=chunk,
                            slots=slots)
        spec = KernelSpec.make(K.moe_wgrad_kernel, args, dict(const, SPLIT=split),
                               (items * tiles_per,), num_warps=warps,
                               num_stages=tiles.wgrad_stages, maxnreg=tiles.wgrad_maxnreg,
                               cost=cost)
        stages.append(Stage(spec, bind))
    return stages


def dense_wgrad_pair_stage(problem, tiles: MoETiles, u, d_u) -> Stage:
    """The shared expert's two weight gradients in one launch (``moe_dense_wgrad_pair_kernel``,
    where the table's ``dense_wgrad_pair`` says): d_shared_w_up [I_s, H] (+)= d_uᵀ · x, then
    d_shared_w_down [H, I_s] (+)= (relu(u)²)ᵀ · d_out, stored transposed; one tiling of
    [I_s, H] for both, so the second's tiles fill the first's last wave."""
    t, grad = pointer_type(problem.dtype), pointer_type(problem.weight_grad_dtype)
    H, inter = problem.hidden, problem.shared_intermediate
    bm, bn, bk, warps = wgrad_blocks(problem, inter, H, tiles)
    group_m = tiles.dense_wgrad_group_m
    args = (("a0_ptr", t), ("b0_ptr", t), ("grad0_ptr", grad), ("a1_ptr", t), ("b1_ptr", t),
            ("grad1_ptr", grad))
    const = dict(M=inter, N=H, SOURCE_0=BY_ROW, RELU2_0=False, TRANSPOSED_0=False,
                 SOURCE_1=BY_ASSIGNMENT, RELU2_1=True, TRANSPOSED_1=True,
                 ACCUMULATE=problem.accumulate, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                 VEC=problem.row_vector, **_numerics(problem))
    arch = target_arch(problem.device)
    up, down = (C.wgrad_cost(problem, routed=False, m=inter, n=H, bm=bm, bn=bn, bk=bk,
                             group_m=group_m, a_relu2=relu2, a_weighted=False, arch=arch)
                for relu2 in (False, True))
    tiles_per = triton.cdiv(inter, bm) * triton.cdiv(H, bn)
    spec = KernelSpec.make(K.moe_dense_wgrad_pair_kernel, args, const, (2 * tiles_per,),
                           num_warps=warps, num_stages=tiles.wgrad_stages,
                           maxnreg=tiles.wgrad_maxnreg, cost=up + down)
    return Stage(spec, dict(a0_ptr=d_u, b0_ptr="x", grad0_ptr="d_shared_w_up",
                            stride_b0=_row_stride(problem, "x"), a1_ptr=u, b1_ptr="d_out",
                            grad1_ptr="d_shared_w_down", stride_b1=_row_stride(problem, "d_out"),
                            T=problem.tokens))


def wgrad_split_stage(problem, tiles: MoETiles) -> Stage | None:
    """The routed weight gradients' split-K work table (``moe_wgrad_split_kernel``), from the
    saved counts and offsets; None without slots."""
    slots, chunk = _wgrad_split(problem, tiles)
    if not slots:
        return None
    E = problem.experts
    const = dict(E=E, EP=triton.next_power_of_2(E), CHUNK=chunk, SLOTS=slots,
                 WS=triton.next_power_of_2(slots))
    spec = KernelSpec.make(K.moe_wgrad_split_kernel,
                           (("counts_ptr", "*i32"), ("offsets_ptr", "*i32"),
                            ("table_ptr", "*i32")), const, (1,),
                           cost=C.wgrad_split_cost(problem, slots))
    return Stage(spec, dict(counts_ptr=saved_piece("counts"), offsets_ptr=saved_piece("offsets"),
                            table_ptr=workspace_piece("wgrad_table")))


def dispatch_stages(problem, home) -> tuple[Stage, ...]:
    """count, scan, offsets, scatter: topk_ids -> counts, offsets, sorted (in ``home``)."""
    E, chunk, e_pad = problem.experts, _expert_chunk(problem), _experts_padded(problem)
    block = dict(E=E, E_PAD=e_pad, EC=chunk, BLOCK_A=BLOCK_A)
    blocks = (_dispatch_blocks(problem),)
    part, A = workspace_piece("part"), problem.assignments
    status = "*i32" if problem.has_status else None
    count = KernelSpec.make(K.moe_count_kernel, (("ids_ptr", "*i32"), ("part_ptr", "*i32"),
                                                 ("status_ptr", status)),
                            dict(block, HAS_STATUS=problem.has_status), blocks,
                            cost=C.count_cost(problem, blocks[0], e_pad))
    scan = KernelSpec.make(K.moe_scan_kernel, (("part_ptr", "*i32"), ("counts_ptr", "*i32")),
                           dict(E=E, E_PAD=e_pad, EC=chunk, BB=SCAN_BLOCKS), (e_pad // chunk,),
                           cost=C.scan_cost(problem, blocks[0], e_pad))
    offsets = KernelSpec.make(K.moe_offsets_kernel,
                              (("counts_ptr", "*i32"), ("offsets_ptr", "*i32")),
                              dict(E=E, EP=triton.next_power_of_2(E), TILE=row_tile(problem)), (1,),
                              cost=C.offsets_cost(problem))
    scatter = KernelSpec.make(K.moe_scatter_kernel,
                              (("ids_ptr", "*i32"), ("part_ptr", "*i32"), ("offsets_ptr", "*i32"),
                               ("sorted_ptr", "*i32")), block, blocks,
                              cost=C.scatter_cost(problem, blocks[0], e_pad))
    return (Stage(count, dict(ids_ptr="topk_ids", part_ptr=part, A=A)),
            Stage(scan, dict(part_ptr=part, counts_ptr=home("counts"), NB=blocks[0])),
            Stage(offsets, dict(counts_ptr=home("counts"), offsets_ptr=home("offsets"))),
            Stage(scatter, dict(ids_ptr="topk_ids", part_ptr=part, offsets_ptr=home("offsets"),
                                sorted_ptr=home("sorted"), A=A)))


def combine_stage(problem, rows, out: str) -> Stage:
    """out[t] = the sum over j (in order) of the rows ``rows`` [t·k, H] (x's dtype), in fp32,
    rounded once: the combine of a plan without a shared expert."""
    bh = min(256, max(16, triton.next_power_of_2(problem.hidden)))
    args = (("buf_ptr", pointer_type(problem.dtype)), ("ids_ptr", "*i32"),
            ("out_ptr", pointer_type(problem.dtype)))
    const = dict(K_TOP=problem.top_k, E=problem.experts, H=problem.hidden, BT=COMBINE_ROWS,
                 BH=bh, EXACT=_numerics(problem)["EXACT"], VEC=problem.row_vector)
    grid = (triton.cdiv(problem.tokens, COMBINE_ROWS), triton.cdiv(problem.hidden, bh))
    spec = KernelSpec.make(K.moe_combine_kernel, args, const, grid,
                           cost=C.combine_cost(problem, COMBINE_ROWS, bh,
                                               target_arch(problem.device)))
    return Stage(spec, dict(buf_ptr=rows, ids_ptr="topk_ids", out_ptr=out, T=problem.tokens,
                            stride_out=_row_stride(problem, out)))


def weight_grad_reduce_stage(problem, tiles: MoETiles) -> Stage:
    """d_topk_weights[a] = the sum over the column tiles (in order) of the <g, a> partials."""
    parts = _column_tiles(problem, tiles)
    spec = KernelSpec.make(K.moe_weight_grad_reduce_kernel,
                           (("part_ptr", "*fp32"), ("ids_ptr", "*i32"), ("dw_ptr", "*fp32"),
                            ("status_ptr", "*i32" if problem.has_status else None)),
                           dict(E=problem.experts, PARTS=parts,
                                BLOCK=REDUCE_BLOCK, HAS_STATUS=problem.has_status),
                           (triton.cdiv(problem.assignments, REDUCE_BLOCK),),
                           cost=C.weight_grad_reduce_cost(problem, parts))
    return Stage(spec, dict(part_ptr=workspace_piece("dw_part"), ids_ptr="topk_ids",
                            dw_ptr="d_topk_weights", A=problem.assignments))


# -- the backend surface ---------------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton MoE kernels", problem.dtype)


def _forward_stages(problem, tiles: MoETiles, home) -> list[Stage]:
    """The routed experts' up GEMM (u by assignment) and down GEMM (relu(u)² in registers, the
    weighted rows by assignment), then the shared expert's up and combining down GEMMs, or the
    combine."""
    H, I = problem.hidden, problem.intermediate
    u = workspace_piece if problem.is_inference else saved_piece
    rows = workspace_piece("rows")
    st = _weight_strides(problem, False)
    act = workspace_piece("act") if down_reads_act(problem, tiles) else None
    stages = [
        gemm_stage(problem, tiles, routed=True, kdim=H, ndim=I, strides=st["up"],
                   epilogue=EPI_UP, a_source=BY_TOKEN, a="x", b="w_up", out=u("u"), act=act,
                   home=home),
        gemm_stage(problem, tiles, routed=True, kdim=I, ndim=H, strides=st["down"],
                   epilogue=EPI_SCATTER, a_source=BY_ASSIGNMENT, a_relu2=act is None,
                   a=act or u("u"), b="w_down", out=rows, weighted=True, home=home)]
    if not problem.has_shared:
        return stages + [combine_stage(problem, rows, "out")]
    st = _weight_strides(problem, True)
    return stages + [
        gemm_stage(problem, tiles, routed=False, kdim=H, ndim=problem.shared_intermediate,
                   strides=st["up"], epilogue=EPI_UP, a_source=BY_TOKEN, a="x",
                   b="shared_w_up", out=u("shared_u")),
        gemm_stage(problem, tiles, routed=False, kdim=problem.shared_intermediate, ndim=H,
                   strides=st["down"], epilogue=EPI_COMBINE, a_source=BY_ROW, a_relu2=True,
                   a=u("shared_u"), b="shared_w_down", out="out", rows=rows)]


def forward_program(problem, config: MoETiles | None = None) -> Program:
    tiles = config or tiles_for(problem)
    home = workspace_piece if problem.is_inference else saved_piece
    return Program(workspace=forward_workspace(problem, tiles),
                   saved=EMPTY if problem.is_inference else saved_layout(problem),
                   stages=(*dispatch_stages(problem, home), *_forward_stages(problem, tiles, home)))


def _expert_backward_stages(problem, tiles: MoETiles, shared: bool) -> list[Stage]:
    """dgrad down, dgrad up (and, routed, the routing-weight gradient), wgrad down, wgrad up of
    the routed experts, or of the shared expert, whose dgrad up sums d_x."""
    H = problem.hidden
    inter = problem.shared_intermediate if shared else problem.intermediate
    routed = not shared
    pre = "shared_" if shared else ""
    ws, u, d_u = workspace_piece, saved_piece(pre + "u"), workspace_piece(pre + "d_u")
    st = _weight_strides(problem, shared)
    up_epilogue = dict(epilogue=EPI_COMBINE, out="d_x", rows=ws("rows")) if shared else \
        dict(epilogue=EPI_SCATTER, out=ws("rows"))
    stages = [
        gemm_stage(problem, tiles, routed=routed, kdim=H, ndim=inter, strides=st["down_t"],
                   epilogue=EPI_DGRAD_ACT, a_source=BY_TOKEN, a="d_out", b=pre + "w_down",
                   out=d_u, weighted=routed, u=u, part=ws("dw_part") if routed else None),
        gemm_stage(problem, tiles, routed=routed, kdim=inter, ndim=H, strides=st["up_t"],
                   a_source=BY_ROW, a=d_u, b=pre + "w_up", **up_epilogue)]
    if shared and tiles.dense_wgrad_pair:
        return stages + [dense_wgrad_pair_stage(problem, tiles, u, d_u)]
    if routed:
        stages.append(weight_grad_reduce_stage(problem, tiles))
        split = wgrad_split_stage(problem, tiles)
        stages += [split] if split else []
    return stages + [
        *wgrad_stages(problem, tiles, routed=routed, inter=inter, a_source=BY_ASSIGNMENT,
                      a_relu2=True, a_weighted=routed, transposed=True, a=u, b="d_out",
                      grad=f"d_{pre}w_down"),
        *wgrad_stages(problem, tiles, routed=routed, inter=inter, a_source=BY_ROW,
                      a_relu2=False, a_weighted=False, transposed=False, a=d_u, b="x",
                      grad=f"d_{pre}w_up")]


def backward_program(problem, config: MoETiles | None = None) -> Program:
    tiles = config or tiles_for(problem)
    stages = _expert_backward_stages(problem, tiles, shared=False)
    if problem.has_shared:
        stages += _expert_backward_stages(problem, tiles, shared=True)
    else:
        stages.append(combine_stage(problem, workspace_piece("rows"), "d_x"))
    return Program(workspace=backward_workspace(problem, tiles), saved=saved_layout(problem),
                   stages=tuple(stages))


forward_candidates = candidates
backward_candidates = candidates
