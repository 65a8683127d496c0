"""Engram saved-state gate: Triton kernels and their launchers (specs/engram_gate.md).

Forward: one program per token; the token's shared value stays in registers while the S streams
are processed, each stream's x/key/weight row loaded once (D <= MAX_BLOCK_D) and reused for the
three fp32 reductions and the output.

Backward: one kernel over programs (s, token block, D chunk). Programs s < S recompute the gate
derivative of each token of their block, write grad_x and the stream's grad_key, and accumulate
sum_n(coef * x * k) for their D chunk in fp32 registers, stored as one partial row per block in
the caller's workspace. Program s == S writes grad_v = sum_s gate_s * g_s (fp32, rounded once).
The S + 1 programs of a block run side by side, so v and g are re-read from L2, not DRAM. A
second kernel sums the partials over blocks in fixed order into grad_weight (``+=`` when
accumulating): no float atomics, bitwise reproducible for a given plan.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedops.backends.torch.engram import DOT_CLAMP

from .compiler import KernelSpec, make_launcher, pointer_type

MAX_BLOCK_D = 8192          # widest D row held in registers; wider rows are processed in chunks
MIN_TOKENS_PER_BLOCK = 4    # backward: fewer tokens per program would make the partials dominate
TARGET_PROGRAMS = 640       # backward: about five programs per SM on a 132-SM H100/H200
REDUCE_TILE = 8192          # fp32 elements one grad_weight-reduce program loads at once


@triton.jit
def _gate_from_sums(sxx, skk, sxwk, eps, D: tl.constexpr, SQRT_D: tl.constexpr,
                    DOT_MIN: tl.constexpr):
    rx = 1.0 / tl.sqrt_rn(sxx / D + eps)
    rk = 1.0 / tl.sqrt_rn(skk / D + eps)
    dot = sxwk * rx * rk / SQRT_D
    mag = tl.sqrt_rn(tl.maximum(tl.abs(dot), DOT_MIN))
    r = tl.where(dot > 0, mag, tl.where(dot < 0, -mag, 0.0))
    gate = 1.0 / (1.0 + tl.exp(-r))
    return gate, dot, rx, rk


@triton.jit
def _store_saved(p_saved, gate, dot, rx, rk):
    o_4 = tl.arange(0, 4)
    b_saved = tl.where(o_4 == 0, gate, tl.where(o_4 == 1, dot, tl.where(o_4 == 2, rx, rk)))
    tl.store(p_saved + o_4, b_saved)


@triton.jit
def engram_gate_fwd_kernel(x_ptr, kv_ptr, w_ptr, mask_ptr, out_ptr, saved_ptr, eps,
                           S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, HAS_MASK: tl.constexpr,
                           SQRT_D: tl.constexpr, DOT_MIN: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    p_x = x_ptr + i_n * (S * D)
    p_kv = kv_ptr + i_n * ((S + 1) * D)
    p_out = out_ptr + i_n * (S * D)
    if HAS_MASK:
        keep = tl.load(mask_ptr + i_n) != 0
    if NUM_CHUNKS == 1:
        m_d = o_d < D
        b_v = tl.load(p_kv + S * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        for i_s in tl.static_range(S):
            b_x = tl.load(p_x + i_s * D + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_k = tl.load(p_kv + i_s * D + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_w = tl.load(w_ptr + i_s * D + o_d, mask=m_d, other=0.0)
            gate, dot, rx, rk = _gate_from_sums(tl.sum(b_x * b_x), tl.sum(b_k * b_k),
                                                tl.sum(b_x * b_w * b_k), eps, D, SQRT_D, DOT_MIN)
            b_o = b_x + gate * b_v
            if HAS_MASK:
                gate = tl.where(keep, gate, 0.0)
                b_o = tl.where(keep, b_o, b_x)
            tl.store(p_out + i_s * D + o_d, b_o.to(out_ptr.dtype.element_ty), mask=m_d)
            _store_saved(saved_ptr + (i_n * S + i_s) * 4, gate, dot, rx, rk)
    else:
        for i_s in tl.static_range(S):
            b_xx = tl.zeros([BLOCK_D], dtype=tl.float32)
            b_kk = tl.zeros([BLOCK_D], dtype=tl.float32)
            b_xwk = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i_c in range(NUM_CHUNKS):
                o_c = i_c * BLOCK_D + o_d
                m_c = o_c < D
                b_x = tl.load(p_x + i_s * D + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_k = tl.load(p_kv + i_s * D + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_w = tl.load(w_ptr + i_s * D + o_c, mask=m_c, other=0.0)
                b_xx += b_x * b_x
                b_kk += b_k * b_k
                b_xwk += b_x * b_w * b_k
            gate, dot, rx, rk = _gate_from_sums(tl.sum(b_xx), tl.sum(b_kk), tl.sum(b_xwk), eps,
                                                D, SQRT_D, DOT_MIN)
            if HAS_MASK:
                gate = tl.where(keep, gate, 0.0)
            for i_c in range(NUM_CHUNKS):
                o_c = i_c * BLOCK_D + o_d
                m_c = o_c < D
                b_x = tl.load(p_x + i_s * D + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_v = tl.load(p_kv + S * D + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_o = b_x + gate * b_v
                if HAS_MASK:
                    b_o = tl.where(keep, b_o, b_x)
                tl.store(p_out + i_s * D + o_c, b_o.to(out_ptr.dtype.element_ty), mask=m_c)
            _store_saved(saved_ptr + (i_n * S + i_s) * 4, gate, dot, rx, rk)


@triton.jit
def engram_gate_bwd_kernel(x_ptr, kv_ptr, w_ptr, saved_ptr, g_ptr, gx_ptr, gkv_ptr, partial_ptr,
                           N, TOKENS_PER_BLOCK,
                           S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, SQRT_D: tl.constexpr,
                           DOT_MIN: tl.constexpr):
    i_s = tl.program_id(0)
    i_b = tl.program_id(1)
    i_c = tl.program_id(2)
    o_d = tl.arange(0, BLOCK_D)
    o_c = i_c * BLOCK_D + o_d
    m_c = o_c < D
    n_start = i_b * TOKENS_PER_BLOCK
    n_count = tl.minimum(n_start + TOKENS_PER_BLOCK, N) - n_start
    n_start = n_start.to(tl.int64)
    if i_s == S:
        # grad_v = sum_s gate_s * g_s, in fp32, rounded once
        for j in range(0, n_count):
            i_n = n_start + j
            b_gv = tl.zeros([BLOCK_D], dtype=tl.float32)
            for j_s in tl.static_range(S):
                gate = tl.load(saved_ptr + (i_n * S + j_s) * 4)
                b_g = tl.load(g_ptr + i_n * (S * D) + j_s * D + o_c, mask=m_c, other=0.0)
                b_gv += gate * b_g.to(tl.float32)
            tl.store(gkv_ptr + i_n * ((S + 1) * D) + S * D + o_c,
                     b_gv.to(gkv_ptr.dtype.element_ty), mask=m_c)
    else:
        b_w = tl.load(w_ptr + i_s * D + o_c, mask=m_c, other=0.0)
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(0, n_count):
            i_n = n_start + j
            p_g = g_ptr + i_n * (S * D) + i_s * D
            p_v = kv_ptr + i_n * ((S + 1) * D) + S * D
            if NUM_CHUNKS == 1:
                b_g = tl.load(p_g + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_v = tl.load(p_v + o_c, mask=m_c, other=0.0).to(tl.float32)
                dgate = tl.sum(b_g * b_v)
            else:
                b_gv = tl.zeros([BLOCK_D], dtype=tl.float32)
                for j_c in range(NUM_CHUNKS):
                    o_j = j_c * BLOCK_D + o_d
                    m_j = o_j < D
                    b_gj = tl.load(p_g + o_j, mask=m_j, other=0.0).to(tl.float32)
                    b_vj = tl.load(p_v + o_j, mask=m_j, other=0.0).to(tl.float32)
                    b_gv += b_gj * b_vj
                dgate = tl.sum(b_gv)
                b_g = tl.load(p_g + o_c, mask=m_c, other=0.0).to(tl.float32)
            p_saved = saved_ptr + (i_n * S + i_s) * 4
            gate = tl.load(p_saved)
            dot = tl.load(p_saved + 1)
            rx = tl.load(p_saved + 2)
            rk = tl.load(p_saved + 3)
            mag = tl.abs(dot)
            slope = 0.5 / tl.sqrt_rn(tl.maximum(mag, DOT_MIN))
            ddot = tl.where((mag >= DOT_MIN) & (gate != 0.0), dgate * gate * (1.0 - gate) * slope,
                            0.0)
            coef = ddot * rx * rk / SQRT_D
            c_x = ddot * dot * rx * rx / D
            c_k = ddot * dot * rk * rk / D
            b_x = tl.load(x_ptr + i_n * (S * D) + i_s * D + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_k = tl.load(kv_ptr + i_n * ((S + 1) * D) + i_s * D + o_c, mask=m_c,
                          other=0.0).to(tl.float32)
            b_gx = b_g + coef * b_w * b_k - c_x * b_x
            b_gk = coef * b_w * b_x - c_k * b_k
            tl.store(gx_ptr + i_n * (S * D) + i_s * D + o_c, b_gx.to(gx_ptr.dtype.element_ty),
                     mask=m_c)
            tl.store(gkv_ptr + i_n * ((S + 1) * D) + i_s * D + o_c,
                     b_gk.to(gkv_ptr.dtype.element_ty), mask=m_c)
            b_acc += coef * b_x * b_k
        tl.store(partial_ptr + (i_b.to(tl.int64) * S + i_s) * D + o_c, b_acc, mask=m_c)


@triton.jit
def engram_gate_weight_reduce_kernel(partial_ptr, gw_ptr, NUM_PARTIALS,
                                     SD: tl.constexpr, BLOCK_P: tl.constexpr,
                                     BLOCK_C: tl.constexpr, ACCUMULATE: tl.constexpr):
    # every partial row of a column tile is loaded at once (BLOCK_P >= NUM_PARTIALS), so the
    # reduction is bound by bandwidth, not by one load latency per partial; the tree order of
    # tl.sum is fixed by the compiled kernel, so results are bitwise reproducible
    o_p = tl.arange(0, BLOCK_P)
    o_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < SD
    p_partial = partial_ptr + o_p[:, None].to(tl.int64) * SD + o_c[None, :]
    b_partial = tl.load(p_partial, mask=(o_p[:, None] < NUM_PARTIALS) & m_c[None, :], other=0.0)
    b_acc = tl.sum(b_partial, axis=0)
    if ACCUMULATE:
        b_acc += tl.load(gw_ptr + o_c, mask=m_c, other=0.0)
    tl.store(gw_ptr + o_c, b_acc, mask=m_c)


# -- specialisations ---------------------------------------------------------------------------
def block_d(hidden: int, kernel: str = "fwd") -> int:
    """D elements a program holds per row. Rows wider than MAX_BLOCK_D are walked in chunks,
    narrower ones in the backward (which keeps two more vectors live there)."""
    whole = triton.next_power_of_2(hidden)
    if whole <= MAX_BLOCK_D:
        return whole
    return MAX_BLOCK_D if kernel == "fwd" else MAX_BLOCK_D // 2


def row_warps(block: int) -> int:
    """Warps for a program holding ``block`` elements per tensor: about 16 per thread."""
    return max(1, min(16, block // 512))


def _common_constexprs(problem, kernel: str) -> tuple[tuple[str, object], ...]:
    bd = block_d(problem.hidden, kernel)
    return (("S", problem.streams), ("D", problem.hidden), ("BLOCK_D", bd),
            ("NUM_CHUNKS", triton.cdiv(problem.hidden, bd)), ("SQRT_D", math.sqrt(problem.hidden)),
            ("DOT_MIN", DOT_CLAMP))


def forward_spec(problem) -> KernelSpec:
    t = pointer_type(problem.dtype)
    constexprs = dict(_common_constexprs(problem, "fwd"), HAS_MASK=problem.has_mask)
    signature = (("x_ptr", t), ("kv_ptr", t), ("w_ptr", "*fp32"), ("mask_ptr", "*i1"),
                 ("out_ptr", t), ("saved_ptr", "*fp32"), ("eps", "fp32"))
    order = ("S", "D", "BLOCK_D", "NUM_CHUNKS", "HAS_MASK", "SQRT_D", "DOT_MIN")
    return KernelSpec(engram_gate_fwd_kernel, signature + tuple((n, "constexpr") for n in order),
                      tuple((n, constexprs[n]) for n in order),
                      aligned=("x_ptr", "kv_ptr", "w_ptr", "out_ptr", "saved_ptr"),
                      num_warps=row_warps(block_d(problem.hidden)))


def backward_spec(problem) -> KernelSpec:
    t = pointer_type(problem.dtype)
    signature = (("x_ptr", t), ("kv_ptr", t), ("w_ptr", "*fp32"), ("saved_ptr", "*fp32"),
                 ("g_ptr", t), ("gx_ptr", t), ("gkv_ptr", t), ("partial_ptr", "*fp32"),
                 ("N", "i32"), ("TOKENS_PER_BLOCK", "i32"))
    constexprs = _common_constexprs(problem, "bwd")
    return KernelSpec(engram_gate_bwd_kernel,
                      signature + tuple((n, "constexpr") for n, _ in constexprs), constexprs,
                      aligned=tuple(n for n, ty in signature if ty.startswith("*")),
                      num_warps=row_warps(block_d(problem.hidden, "bwd")))


def max_backward_blocks(streams: int, hidden: int) -> int:
    """The most token blocks (grad_weight partial rows) any token count gets."""
    chunks = triton.cdiv(hidden, block_d(hidden, "bwd"))
    return max(1, TARGET_PROGRAMS // ((streams + 1) * chunks))


def backward_blocks(problem) -> tuple[int, int]:
    """(tokens per block, number of blocks) of the backward kernel for ``problem.tokens``."""
    max_blocks = max_backward_blocks(problem.streams, problem.hidden)
    per_block = max(MIN_TOKENS_PER_BLOCK, triton.cdiv(problem.tokens, max_blocks))
    return per_block, triton.cdiv(problem.tokens, per_block)


def reduce_spec(problem) -> KernelSpec:
    """grad_weight (+)= the sum of the partial rows; specialised on the most rows any N gives."""
    block_p = triton.next_power_of_2(max_backward_blocks(problem.streams, problem.hidden))
    block_c = max(16, REDUCE_TILE // block_p)
    return KernelSpec(engram_gate_weight_reduce_kernel,
                      (("partial_ptr", "*fp32"), ("gw_ptr", "*fp32"), ("NUM_PARTIALS", "i32"),
                       ("SD", "constexpr"), ("BLOCK_P", "constexpr"), ("BLOCK_C", "constexpr"),
                       ("ACCUMULATE", "constexpr")),
                      (("SD", problem.streams * problem.hidden), ("BLOCK_P", block_p),
                       ("BLOCK_C", block_c), ("ACCUMULATE", problem.accumulate)),
                      aligned=("partial_ptr", "gw_ptr"), num_warps=8)


def reduce_launcher(problem):
    """launch(partials, grad_weight, num_partials, stream=...): the deterministic grad_weight
    reduction, shared with the CuTe backend."""
    spec = reduce_spec(problem)
    block_c = dict(spec.constexprs)["BLOCK_C"]
    return make_launcher(spec, (triton.cdiv(problem.streams * problem.hidden, block_c), 1, 1),
                         problem.device)


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    if problem.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the Triton gate kernels take bf16/fp16/fp32, not {problem.dtype} (use backend='torch')"
    return None


def backward_workspace_size(problem) -> int:
    """4 * S * D * num_blocks bytes: one fp32 grad_weight partial row per token block."""
    _, blocks = backward_blocks(problem)
    return 4 * problem.streams * problem.hidden * blocks


def forward_launcher(problem):
    launch_fwd = make_launcher(forward_spec(problem), (problem.tokens, 1, 1), problem.device)
    eps = problem.eps

    def launch(x, kv, weight, mask, out, saved, *, stream):
        launch_fwd(x, kv, weight, mask if mask is not None else x, out, saved, eps, stream=stream)
    return launch


def backward_launcher(problem):
    per_block, blocks = backward_blocks(problem)
    chunks = triton.cdiv(problem.hidden, block_d(problem.hidden, "bwd"))
    launch_main = make_launcher(backward_spec(problem), (problem.streams + 1, blocks, chunks),
                                problem.device)
    launch_reduce = reduce_launcher(problem)
    tokens = problem.tokens

    def launch(x, kv, weight, saved, grad_out, grad_x, grad_kv, grad_weight, workspace, *, stream):
        # the fp32 partials occupy the first backward_workspace_size bytes of the workspace
        launch_main(x, kv, weight, saved, grad_out, grad_x, grad_kv, workspace, tokens, per_block,
                    stream=stream)
        launch_reduce(workspace, grad_weight, blocks, stream=stream)
    return launch


def aot_specs():
    """(label, KernelSpec) at the production shape (S=4, D=5120, bf16), a chunked D and fp32."""
    from fusedops.engram import GateProblem
    cpu = torch.device("cpu")
    shapes = (("S4 D5120 bf16", torch.bfloat16, 4, 5120), ("S4 D12288 bf16", torch.bfloat16, 4, 12288),
              ("S1 D256 fp32", torch.float32, 1, 256))
    for label, dtype, streams, hidden in shapes:
        for has_mask in (True, False):
            problem = GateProblem(dtype, 8192, streams, hidden, 1e-20, has_mask, False, cpu)
            yield f"gate fwd {label}{' mask' if has_mask else ''}", forward_spec(problem)
        problem = GateProblem(dtype, 8192, streams, hidden, 1e-20, False, True, cpu)
        yield f"gate bwd {label}", backward_spec(problem)
        yield f"gate grad_weight reduce {label} accumulate", reduce_spec(problem)
