"""Routed ReLU2 experts: specialisations, buffer layouts and launch sequences of the Triton
kernels in moe_kernels.py."""

from __future__ import annotations

import math

import torch
import triton

from fusedops._backend import triton_interpreter_active
from fusedops._workspace import Layout

from . import moe_kernels as K
from .compiler import KernelSpec, make_launcher, pointer_type

BLOCK_A = 256        # assignments per dispatch program
EXPERT_CHUNK = 32    # experts per one-hot tile in the dispatch
SCAN_BLOCKS = 64     # dispatch blocks per step of the prefix scan
GROUP_M = 8          # row tiles per L2 group of the grouped GEMM


def row_tile(problem) -> int:
    """Rows per GEMM tile, which is also the padding of every expert's rows: 128 when experts
    average >= 96 assignments, down to 16 for decode-sized batches."""
    mean = problem.assignments / problem.experts
    for tile, least in ((128, 96), (64, 48), (32, 24)):
        if mean >= least:
            return tile
    return 16


def max_rows(problem) -> int:
    """Upper bound of the dispatched rows: t·k + E·(tile - 1), whatever the routing."""
    tile = row_tile(problem)
    return triton.cdiv(problem.assignments + problem.experts * (tile - 1), tile) * tile


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


def saved_layout(problem) -> Layout:
    """The dispatch (counts [E], offsets [E + 1], sorted [max_rows] int32) and u in x's dtype:
    [t·k, I] by assignment, and [t, I_shared] for the shared expert."""
    return Layout(_dispatch_pieces(problem) + [
        ("u", problem.dtype, problem.assignments * problem.intermediate),
        ("shared_u", problem.dtype, problem.tokens * problem.shared_intermediate)])


def forward_workspace(problem) -> Layout:
    """Dispatch block counts [NB, E_pad] int32, (the dispatch itself for is_inference), the
    activations [max_rows, I] (x's dtype), the weighted expert outputs [t·k, H] fp32, and the
    shared expert's [t, I_shared] activations and [t, H] fp32 output."""
    pieces = [("part", torch.int32, _dispatch_blocks(problem) * _experts_padded(problem))]
    if problem.is_inference:
        pieces += _dispatch_pieces(problem)
    t, H = problem.tokens, problem.hidden
    return Layout(pieces + [
        ("act", problem.dtype, max_rows(problem) * problem.intermediate),
        ("y", torch.float32, problem.assignments * H),
        ("shared_act", problem.dtype, t * problem.shared_intermediate),
        ("shared_y", torch.float32, t * H if problem.has_shared else 0)])


def _column_tiles(problem) -> int:
    return triton.cdiv(problem.intermediate, _gemm_blocks(problem, problem.hidden,
                                                            problem.intermediate, 16)[1])


def backward_workspace(problem) -> Layout:
    """d_u [max_rows, I] (x's dtype), the per-assignment d_x rows [t·k, H] fp32, the routing
    weight gradient's partial sums [I / BN, t·k] fp32, and the shared expert's d_u [t, I_shared]
    and d_x [t, H] fp32."""
    t, H = problem.tokens, problem.hidden
    return Layout([
        ("d_u", problem.dtype, max_rows(problem) * problem.intermediate),
        ("dx", torch.float32, problem.assignments * H),
        ("dw_part", torch.float32, _column_tiles(problem) * problem.assignments),
        ("shared_d_u", problem.dtype, t * problem.shared_intermediate),
        ("shared_dx", torch.float32, t * H if problem.has_shared else 0)])


# -- specialisations -----------------------------------------------------------------------------
def _numerics(problem) -> dict:
    bf16_interpreted = triton_interpreter_active() and problem.dtype == torch.bfloat16
    return dict(UPCAST=bf16_interpreted, IEEE=problem.dtype == torch.float32, EXACT=bf16_interpreted)


def _spec(kernel, args, constexprs, warps, stages=1) -> KernelSpec:
    aligned = tuple(n for n, t in args if t.startswith("*") and n != "ids_ptr")
    return KernelSpec(kernel, tuple(args) + tuple((k, "constexpr") for k in constexprs),
                      tuple(constexprs.items()), aligned=aligned, num_warps=warps, num_stages=stages)


def _gemm_blocks(problem, kdim: int, ndim: int, bm: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, warps) of the grouped GEMM."""
    bn = min(128, max(16, triton.next_power_of_2(ndim)))
    bk = min(32 if problem.dtype == torch.float32 else 64, max(16, triton.next_power_of_2(kdim)))
    return bm, bn, bk, 8 if bm * bn >= 64 * 128 else 4


def _dense_tile(problem) -> int:
    return min(128, max(16, triton.next_power_of_2(problem.tokens)))


def gemm_spec(problem, *, routed: bool, kdim: int, ndim: int, strides, epilogue: int,
              a_by_token: bool, weighted: bool = False, save_u: bool = False,
              out_dtype=None) -> KernelSpec:
    bm = row_tile(problem) if routed else _dense_tile(problem)
    bm, bn, bk, warps = _gemm_blocks(problem, kdim, ndim, bm)
    t = pointer_type(problem.dtype)
    args = (("a_ptr", t), ("b_ptr", t), ("sorted_ptr", "*i32"), ("offsets_ptr", "*i32"),
            ("counts_ptr", "*i32"), ("weight_ptr", "*fp32"), ("u_ptr", t),
            ("out_ptr", pointer_type(out_dtype or problem.dtype)), ("part_ptr", "*fp32"),
            ("T", "i32"), ("M_TILES", "i32"))
    be, bks, bns = strides
    const = dict(K_TOP=problem.top_k if routed else 1, E=problem.experts if routed else 1,
                 KDIM=kdim, NDIM=ndim, STRIDE_BE=be, STRIDE_BK=bks, STRIDE_BN=bns, ROUTED=routed,
                 A_BY_TOKEN=a_by_token, EPILOGUE=epilogue, WEIGHTED=weighted, SAVE_U=save_u,
                 BM=bm, BN=bn, BK=bk, GROUP_M=GROUP_M,
                 STEPS=max(1, math.ceil(math.log2(max(problem.experts, 2)))) + 1,
                 **_numerics(problem))
    return _spec(K.moe_gemm_kernel, args, const, warps, stages=3)


def wgrad_spec(problem, *, routed: bool, m: int, n: int, p_source: int, p_weighted: bool,
               q_source: int, q_relu2: bool) -> KernelSpec:
    t = pointer_type(problem.dtype)
    args = (("p_ptr", t), ("q_ptr", t), ("sorted_ptr", "*i32"), ("offsets_ptr", "*i32"),
            ("counts_ptr", "*i32"), ("weight_ptr", "*fp32"),
            ("grad_ptr", pointer_type(problem.weight_grad_dtype)), ("T", "i32"))
    bm = min(128, max(16, triton.next_power_of_2(m)))
    bn = min(128, max(16, triton.next_power_of_2(n)))
    const = dict(K_TOP=problem.top_k if routed else 1, E=problem.experts if routed else 1, M=m,
                 N=n, ROUTED=routed, P_SOURCE=p_source, P_WEIGHTED=p_weighted, Q_SOURCE=q_source,
                 Q_RELU2=q_relu2, ACCUMULATE=problem.accumulate, BM=bm, BN=bn,
                 BK=16 if problem.dtype == torch.float32 else 32, **_numerics(problem))
    return _spec(K.moe_wgrad_kernel, args, const, 8 if bm * bn >= 128 * 128 else 4, stages=3)


def dispatch_specs(problem) -> dict[str, KernelSpec]:
    E, chunk, e_pad = problem.experts, _expert_chunk(problem), _experts_padded(problem)
    block = dict(E=E, E_PAD=e_pad, EC=chunk, BLOCK_A=BLOCK_A)
    return dict(
        count=_spec(K.moe_count_kernel, (("ids_ptr", "*i32"), ("part_ptr", "*i32"), ("A", "i32")),
                    block, 4),
        scan=_spec(K.moe_scan_kernel, (("part_ptr", "*i32"), ("counts_ptr", "*i32"), ("NB", "i32")),
                   dict(E=E, E_PAD=e_pad, EC=chunk, BB=SCAN_BLOCKS), 4),
        offsets=_spec(K.moe_offsets_kernel, (("counts_ptr", "*i32"), ("offsets_ptr", "*i32")),
                      dict(E=E, EP=triton.next_power_of_2(E), TILE=row_tile(problem)), 4),
        scatter=_spec(K.moe_scatter_kernel,
                      (("ids_ptr", "*i32"), ("part_ptr", "*i32"), ("offsets_ptr", "*i32"),
                       ("sorted_ptr", "*i32"), ("A", "i32")), block, 4))


def combine_spec(problem) -> KernelSpec:
    bh = min(256, max(16, triton.next_power_of_2(problem.hidden)))
    return _spec(K.moe_combine_kernel,
                 (("buf_ptr", "*fp32"), ("shared_ptr", "*fp32"), ("ids_ptr", "*i32"),
                  ("out_ptr", pointer_type(problem.dtype)), ("T", "i32")),
                 dict(K_TOP=problem.top_k, E=problem.experts, H=problem.hidden,
                      HAS_SHARED=problem.has_shared, BT=16, BH=bh,
                      EXACT=_numerics(problem)["EXACT"]), 4)


def _weight_strides(problem, shared: bool):
    """(W_up as [k = H, n = I], W_down as [k = I, n = H], W_down as [k = H, n = I],
    W_up as [k = I, n = H]) strides (expert, k, n)."""
    H, I = problem.hidden, problem.shared_intermediate if shared else problem.intermediate
    return dict(up=(I * H, 1, H), down=(H * I, 1, I), down_t=(H * I, I, 1), up_t=(I * H, H, 1))


def forward_specs(problem) -> dict[str, KernelSpec]:
    H, I, Is = problem.hidden, problem.intermediate, problem.shared_intermediate
    save = not problem.is_inference
    specs = dispatch_specs(problem)
    st = _weight_strides(problem, False)
    specs["up"] = gemm_spec(problem, routed=True, kdim=H, ndim=I, strides=st["up"],
                            epilogue=0, a_by_token=True, save_u=save)
    specs["down"] = gemm_spec(problem, routed=True, kdim=I, ndim=H, strides=st["down"],
                              epilogue=1, a_by_token=False, weighted=True, out_dtype=torch.float32)
    if problem.has_shared:
        st = _weight_strides(problem, True)
        specs["shared_up"] = gemm_spec(problem, routed=False, kdim=H, ndim=Is, strides=st["up"],
                                       epilogue=0, a_by_token=True, save_u=save)
        specs["shared_down"] = gemm_spec(problem, routed=False, kdim=Is, ndim=H,
                                         strides=st["down"], epilogue=1, a_by_token=False,
                                         out_dtype=torch.float32)
    specs["combine"] = combine_spec(problem)
    return specs


def backward_specs(problem) -> dict[str, KernelSpec]:
    H, I, Is = problem.hidden, problem.intermediate, problem.shared_intermediate
    specs = {}
    for prefix, routed, inter in (("", True, I), ("shared_", False, Is)):
        if not routed and not problem.has_shared:
            continue
        st = _weight_strides(problem, not routed)
        specs[prefix + "dgrad_down"] = gemm_spec(problem, routed=routed, kdim=H, ndim=inter,
                                                 strides=st["down_t"], epilogue=2,
                                                 a_by_token=True, weighted=routed)
        specs[prefix + "dgrad_up"] = gemm_spec(problem, routed=routed, kdim=inter, ndim=H,
                                               strides=st["up_t"], epilogue=1, a_by_token=False,
                                               out_dtype=torch.float32)
        specs[prefix + "wgrad_down"] = wgrad_spec(problem, routed=routed, m=H, n=inter,
                                                  p_source=1, p_weighted=routed, q_source=2,
                                                  q_relu2=True)
        specs[prefix + "wgrad_up"] = wgrad_spec(problem, routed=routed, m=inter, n=H, p_source=0,
                                                p_weighted=False, q_source=1, q_relu2=False)
    specs["weight_grad_reduce"] = _spec(
        K.moe_weight_grad_reduce_kernel,
        (("part_ptr", "*fp32"), ("ids_ptr", "*i32"), ("dw_ptr", "*fp32"), ("A", "i32")),
        dict(E=problem.experts, PARTS=_column_tiles(problem), BLOCK=256), 4)
    specs["combine"] = combine_spec(problem)
    return specs


# -- the backend surface -------------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    if problem.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the Triton MoE kernels take bf16/fp16/fp32, not {problem.dtype} (use backend='torch')"
    return None


def saved_size(problem) -> int:
    return saved_layout(problem).size


def forward_workspace_size(problem) -> int:
    return forward_workspace(problem).size


def backward_workspace_size(problem) -> int:
    return backward_workspace(problem).size


def _gemm_grid(problem, spec: KernelSpec, routed: bool) -> tuple[tuple[int, int, int], int]:
    c = dict(spec.constexprs)
    rows = max_rows(problem) if routed else problem.tokens
    m_tiles = triton.cdiv(rows, c["BM"])
    return (m_tiles * triton.cdiv(c["NDIM"], c["BN"]), 1, 1), m_tiles


def _wgrad_grid(spec: KernelSpec) -> tuple[int, int, int]:
    c = dict(spec.constexprs)
    return (c["E"], triton.cdiv(c["M"], c["BM"]), triton.cdiv(c["N"], c["BN"]))


class _Launchers:
    """make_launcher over a dict of specs, GEMMs on their (grid, row tiles)."""

    def __init__(self, problem, specs):
        self.fn, self.m_tiles = {}, {}
        for name, spec in specs.items():
            kernel = spec.kernel
            if kernel is K.moe_gemm_kernel:
                grid, self.m_tiles[name] = _gemm_grid(problem, spec, dict(spec.constexprs)["ROUTED"])
            elif kernel is K.moe_wgrad_kernel:
                grid = _wgrad_grid(spec)
            elif kernel in (K.moe_count_kernel, K.moe_scatter_kernel):
                grid = (_dispatch_blocks(problem), 1, 1)
            elif kernel is K.moe_scan_kernel:
                grid = (_experts_padded(problem) // _expert_chunk(problem), 1, 1)
            elif kernel is K.moe_offsets_kernel:
                grid = (1, 1, 1)
            elif kernel is K.moe_combine_kernel:
                c = dict(spec.constexprs)
                grid = (triton.cdiv(problem.tokens, c["BT"]), triton.cdiv(problem.hidden, c["BH"]), 1)
            else:
                grid = (triton.cdiv(problem.assignments, dict(spec.constexprs)["BLOCK"]), 1, 1)
            self.fn[name] = make_launcher(spec, grid, problem.device)

    def gemm(self, name, *args, stream):
        self.fn[name](*args, self.m_tiles[name], stream=stream)


def _run_dispatch(run, problem, ids, part, d, *, stream):
    A = problem.assignments
    run.fn["count"](ids, part, A, stream=stream)
    run.fn["scan"](part, d["counts"], _dispatch_blocks(problem), stream=stream)
    run.fn["offsets"](d["counts"], d["offsets"], stream=stream)
    run.fn["scatter"](ids, part, d["offsets"], d["sorted"], A, stream=stream)


def forward_launcher(problem):
    run = _Launchers(problem, forward_specs(problem))
    ws_layout, saved = forward_workspace(problem), saved_layout(problem)
    T = problem.tokens

    def launch(t, *, stream):
        ws = t["workspace"]
        w = {k: ws_layout.carve(ws, k) for k in ws_layout.offsets}
        home = w if problem.is_inference else {k: saved.carve(t["saved"], k) for k in saved.offsets}
        d = {k: home[k] for k in ("counts", "offsets", "sorted")}
        ids, weights, x = t["topk_ids"], t["topk_weights"], t["x"]
        u = home.get("u", x)
        _run_dispatch(run, problem, ids, w["part"], d, stream=stream)
        dispatch = (d["sorted"], d["offsets"], d["counts"], weights)
        run.gemm("up", x, t["w_up"], *dispatch, u, w["act"], weights, T, stream=stream)
        run.gemm("down", w["act"], t["w_down"], *dispatch, x, w["y"], weights, T, stream=stream)
        shared_y = w["y"]
        if problem.has_shared:
            shared_y = w["shared_y"]
            run.gemm("shared_up", x, t["shared_w_up"], *dispatch, home.get("shared_u", x),
                     w["shared_act"], weights, T, stream=stream)
            run.gemm("shared_down", w["shared_act"], t["shared_w_down"], *dispatch, x, shared_y,
                     weights, T, stream=stream)
        run.fn["combine"](w["y"], shared_y, ids, t["out"], T, stream=stream)
    return launch


def backward_launcher(problem):
    run = _Launchers(problem, backward_specs(problem))
    ws_layout, saved = backward_workspace(problem), saved_layout(problem)
    T = problem.tokens

    def launch(t, *, stream):
        w = {k: ws_layout.carve(t["workspace"], k) for k in ws_layout.offsets}
        s = {k: saved.carve(t["saved"], k) for k in saved.offsets}
        ids, weights, x, d_out = t["topk_ids"], t["topk_weights"], t["x"], t["d_out"]
        dispatch = (s["sorted"], s["offsets"], s["counts"], weights)
        run.gemm("dgrad_down", d_out, t["w_down"], *dispatch, s["u"], w["d_u"], w["dw_part"], T,
                 stream=stream)
        run.gemm("dgrad_up", w["d_u"], t["w_up"], *dispatch, x, w["dx"], w["dw_part"], T,
                 stream=stream)
        run.fn["weight_grad_reduce"](w["dw_part"], ids, t["d_topk_weights"], problem.assignments,
                                     stream=stream)
        run.fn["wgrad_down"](d_out, s["u"], *dispatch, t["d_w_down"], T, stream=stream)
        run.fn["wgrad_up"](w["d_u"], x, *dispatch, t["d_w_up"], T, stream=stream)
        shared_dx = w["dx"]
        if problem.has_shared:
            shared_dx = w["shared_dx"]
            run.gemm("shared_dgrad_down", d_out, t["shared_w_down"], *dispatch, s["shared_u"],
                     w["shared_d_u"], w["dw_part"], T, stream=stream)
            run.gemm("shared_dgrad_up", w["shared_d_u"], t["shared_w_up"], *dispatch, x, shared_dx,
                     w["dw_part"], T, stream=stream)
            run.fn["shared_wgrad_down"](d_out, s["shared_u"], *dispatch, t["d_shared_w_down"], T,
                                        stream=stream)
            run.fn["shared_wgrad_up"](w["shared_d_u"], x, *dispatch, t["d_shared_w_up"], T,
                                      stream=stream)
        run.fn["combine"](w["dx"], shared_dx, ids, t["d_x"], T, stream=stream)
    return launch


def aot_specs():
    """Every kernel at Nemotron 3 Nano shapes (H=2688, E=128, k=6, I=1856, shared 3712) for
    t=8192 (row tile 128) and t=64 (decode-sized, tile 16), and at Super's expert shapes (latent
    1024, E=512, k=22, I=2688, t=8192)."""
    from fusedops.moe import MoEProblem
    cpu = torch.device("cpu")
    nano = MoEProblem(torch.bfloat16, 8192, 2688, 128, 1856, 6, 3712, False, True, torch.float32, cpu)
    variants = (("nano t8192", nano, True),
                ("nano t64", MoEProblem(**{**nano.__dict__, "tokens": 64}), False),
                ("super t8192", MoEProblem(torch.bfloat16, 8192, 1024, 512, 2688, 22, 0, False,
                                           True, torch.float32, cpu), True))
    for label, problem, backward in variants:
        specs = dict(forward_specs(problem))
        if backward:
            specs.update({f"bwd {k}": v for k, v in backward_specs(problem).items()})
        for name, spec in specs.items():
            yield f"moe {label} {name}", spec
