"""Engram saved-state gate: Triton kernels and their launchers (fusedops.engram.contract).

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size, kernel_dtype_reason
from fusedops.core.program import Program, Stage, Stride, workspace_piece
from fusedops.core.target import target_arch
from fusedops.core.workspace import Layout
from fusedops.engram.contract import (BACKWARD_FLOPS_PER_ELEMENT, DOT_CLAMP,
                                      FORWARD_FLOPS_PER_ELEMENT, token_blocks)

from .runtime import KernelSpec, pointer_type

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
def engram_gate_fwd_kernel(x, kv, weight, mask, out, saved, eps,
                           stride_xn, stride_xs, stride_kvn, stride_outn, stride_outs,
                           S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, HAS_MASK: tl.constexpr,
                           SQRT_D: tl.constexpr, DOT_MIN: tl.constexpr, VEC: tl.constexpr):
    # strides come in units of VEC elements (16 bytes): every row starts 16-byte aligned
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    p_x = x + i_n * (stride_xn * VEC)
    p_kv = kv + i_n * (stride_kvn * VEC)
    p_out = out + i_n * (stride_outn * VEC)
    if HAS_MASK:
        keep = tl.load(mask + i_n) != 0
    if NUM_CHUNKS == 1:
        m_d = o_d < D
        b_v = tl.load(p_kv + S * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        for i_s in tl.static_range(S):
            b_x = tl.load(p_x + i_s * (stride_xs * VEC) + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_k = tl.load(p_kv + i_s * D + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_w = tl.load(weight + i_s * D + o_d, mask=m_d, other=0.0)
            gate, dot, rx, rk = _gate_from_sums(tl.sum(b_x * b_x), tl.sum(b_k * b_k),
                                                tl.sum(b_x * b_w * b_k), eps, D, SQRT_D, DOT_MIN)
            b_o = b_x + gate * b_v
            if HAS_MASK:
                gate = tl.where(keep, gate, 0.0)
                b_o = tl.where(keep, b_o, b_x)
            tl.store(p_out + i_s * (stride_outs * VEC) + o_d, b_o.to(out.dtype.element_ty), mask=m_d)
            _store_saved(saved + (i_n * S + i_s) * 4, gate, dot, rx, rk)
    else:
        for i_s in tl.static_range(S):
            b_xx = tl.zeros([BLOCK_D], dtype=tl.float32)
            b_kk = tl.zeros([BLOCK_D], dtype=tl.float32)
            b_xwk = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i_c in range(NUM_CHUNKS):
                o_c = i_c * BLOCK_D + o_d
                m_c = o_c < D
                b_x = tl.load(p_x + i_s * (stride_xs * VEC) + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_k = tl.load(p_kv + i_s * D + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_w = tl.load(weight + i_s * D + o_c, mask=m_c, other=0.0)
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
                b_x = tl.load(p_x + i_s * (stride_xs * VEC) + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_v = tl.load(p_kv + S * D + o_c, mask=m_c, other=0.0).to(tl.float32)
                b_o = b_x + gate * b_v
                if HAS_MASK:
                    b_o = tl.where(keep, b_o, b_x)
                tl.store(p_out + i_s * (stride_outs * VEC) + o_c, b_o.to(out.dtype.element_ty), mask=m_c)
            _store_saved(saved + (i_n * S + i_s) * 4, gate, dot, rx, rk)


@triton.jit
def engram_gate_bwd_kernel(x, kv, weight, saved, grad_out, grad_x, grad_kv, partials,
                           N, TOKENS_PER_BLOCK, stride_xn, stride_xs, stride_kvn, stride_gn,
                           stride_gs, stride_gxn, stride_gxs, stride_gkvn,
                           S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, SQRT_D: tl.constexpr,
                           DOT_MIN: tl.constexpr, VEC: tl.constexpr):
    # strides come in units of VEC elements (16 bytes), as in the forward
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
                gate = tl.load(saved + (i_n * S + j_s) * 4)
                b_g = tl.load(grad_out + i_n * (stride_gn * VEC) + j_s * (stride_gs * VEC) + o_c, mask=m_c, other=0.0)
                b_gv += tl.where(gate != 0.0, gate * b_g.to(tl.float32), 0.0)
            tl.store(grad_kv + i_n * (stride_gkvn * VEC) + S * D + o_c,
                     b_gv.to(grad_kv.dtype.element_ty), mask=m_c)
    else:
        b_w = tl.load(weight + i_s * D + o_c, mask=m_c, other=0.0)
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(0, n_count):
            i_n = n_start + j
            p_g = grad_out + i_n * (stride_gn * VEC) + i_s * (stride_gs * VEC)
            p_v = kv + i_n * (stride_kvn * VEC) + S * D
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
            p_saved = saved + (i_n * S + i_s) * 4
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
            b_x = tl.load(x + i_n * (stride_xn * VEC) + i_s * (stride_xs * VEC) + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_k = tl.load(kv + i_n * (stride_kvn * VEC) + i_s * D + o_c, mask=m_c,
                          other=0.0).to(tl.float32)
            # a masked token (gate 0) is isolated: its x, k and statistics are selected away
            token = gate != 0.0
            b_gx = b_g + tl.where(token, coef * b_w * b_k - c_x * b_x, 0.0)
            b_gk = tl.where(token, coef * b_w * b_x - c_k * b_k, 0.0)
            tl.store(grad_x + i_n * (stride_gxn * VEC) + i_s * (stride_gxs * VEC) + o_c, b_gx.to(grad_x.dtype.element_ty),
                     mask=m_c)
            tl.store(grad_kv + i_n * (stride_gkvn * VEC) + i_s * D + o_c,
                     b_gk.to(grad_kv.dtype.element_ty), mask=m_c)
            b_acc += tl.where(token, coef * b_x * b_k, 0.0)
        tl.store(partials + (i_b.to(tl.int64) * S + i_s) * D + o_c, b_acc, mask=m_c)


@triton.jit
def engram_gate_weight_reduce_kernel(partials, grad_weight, NUM_PARTIALS,
                                     SD: tl.constexpr, BLOCK_P: tl.constexpr,
                                     BLOCK_C: tl.constexpr, ACCUMULATE: tl.constexpr):
    # every partial row of a column tile is loaded at once (BLOCK_P >= NUM_PARTIALS), so the
    # reduction is bound by bandwidth, not by one load latency per partial; the tree order of
    # tl.sum is fixed by the compiled kernel, so results are bitwise reproducible
    o_p = tl.arange(0, BLOCK_P)
    o_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < SD
    p_partial = partials + o_p[:, None].to(tl.int64) * SD + o_c[None, :]
    b_partial = tl.load(p_partial, mask=(o_p[:, None] < NUM_PARTIALS) & m_c[None, :], other=0.0)
    b_acc = tl.sum(b_partial, axis=0)
    if ACCUMULATE:
        b_acc += tl.load(grad_weight + o_c, mask=m_c, other=0.0)
    tl.store(grad_weight + o_c, b_acc, mask=m_c)


# -- tiles ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateTiles:
    """max_block_d: the widest row a program holds in registers (wider rows are walked in
    chunks); target_programs: how many backward programs to aim for (grad_weight partial rows
    are about target_programs / ((S + 1) * chunks)); max_warps: warps per program at most
    (about 16 elements per thread below it)."""

    max_block_d: int = 8192
    target_programs: int = 640
    max_warps: int = 16


TILES = {
    "sm_80": (GateTiles(8192, 540, 16), "108 SMs (A100): about five backward programs per SM"),
    "sm_90": (GateTiles(8192, 640, 16), "132 SMs (H100/H200): about five backward programs per SM; "
              "16 warps hold an 8192-wide row at 16 elements per thread"),
    "sm_100": (GateTiles(8192, 740, 16), "148 SMs (B200): about five backward programs per SM"),
}


def tiles_for(problem) -> GateTiles:
    """The tile table's entry for the plan's architecture."""
    return TILES[target_arch(problem.device)][0]


def candidates(problem) -> list[GateTiles]:
    """Autotune candidates: the table's entry first, then fewer warps and other backward
    program counts."""
    base = tiles_for(problem)
    out = [base, GateTiles(base.max_block_d, base.target_programs, 8),
           GateTiles(base.max_block_d, base.target_programs // 2, base.max_warps),
           GateTiles(base.max_block_d, base.target_programs * 2, base.max_warps)]
    return list(dict.fromkeys(out))


# -- specialisations ---------------------------------------------------------------------------
def block_d(hidden: int, tiles: GateTiles, kernel: str = "fwd") -> int:
    """D elements a program holds per row. Rows wider than max_block_d are walked in chunks,
    narrower ones in the backward (which keeps two more vectors live there)."""
    whole = triton.next_power_of_2(hidden)
    if whole <= tiles.max_block_d:
        return whole
    return tiles.max_block_d if kernel == "fwd" else tiles.max_block_d // 2


def row_warps(block: int, tiles: GateTiles) -> int:
    """Warps for a program holding ``block`` elements per tensor: about 16 per thread."""
    return max(1, min(tiles.max_warps, block // 512))


def _row_constexprs(problem, bd: int) -> dict:
    return dict(S=problem.streams, D=problem.hidden, BLOCK_D=bd,
                NUM_CHUNKS=triton.cdiv(problem.hidden, bd), SQRT_D=math.sqrt(problem.hidden),
                DOT_MIN=DOT_CLAMP, VEC=vector_elements(problem))


def vector_elements(problem) -> int:
    """Elements of a 16-byte vector: the unit the kernels take row strides in."""
    return 16 // element_size(problem.dtype)


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
            ("out", t), ("saved", "*fp32"), ("eps", "fp32"),
            *((name, "i32") for name in FORWARD_STRIDES))
    bd = block_d(problem.hidden, tiles)
    constexprs = dict(_row_constexprs(problem, bd), HAS_MASK=problem.has_mask)
    return KernelSpec.make(engram_gate_fwd_kernel, args, constexprs, (problem.tokens,),
                           num_warps=row_warps(bd, tiles),
                           cost=forward_cost(problem, constexprs["NUM_CHUNKS"]))


def forward_cost(problem, chunks: int) -> Cost:
    """Per token: x, the S keys and v once (the chunked path reads x twice and v once per
    stream), the mask; out and saved written. The weight (S·D fp32, read by every program) is
    counted once: it stays in L2."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    x_reads, v_reads = (1, 1) if chunks == 1 else (2, s)
    read = n * (x_reads * s + s + v_reads) * d * e + s * d * 4 + (n if problem.has_mask else 0)
    return Cost(FORWARD_FLOPS_PER_ELEMENT * n * s * d, read, n * s * d * e + n * s * 16)


def max_backward_blocks(streams: int, hidden: int, tiles: GateTiles) -> int:
    """The most token blocks (grad_weight partial rows) any token count gets."""
    chunks = triton.cdiv(hidden, block_d(hidden, tiles, "bwd"))
    return max(1, tiles.target_programs // ((streams + 1) * chunks))


def backward_blocks(problem, tiles: GateTiles | None = None) -> tuple[int, int]:
    """(tokens per block, number of blocks) of the backward kernel for ``problem.tokens``."""
    tiles = tiles or tiles_for(problem)
    return token_blocks(problem.tokens, max_backward_blocks(problem.streams, problem.hidden, tiles))


def backward_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    tiles = tiles or tiles_for(problem)
    t = pointer_type(problem.dtype)
    args = (("x", t), ("kv", t), ("weight", "*fp32"), ("saved", "*fp32"), ("grad_out", t),
            ("grad_x", t), ("grad_kv", t), ("partials", "*fp32"), ("N", "i32"),
            ("TOKENS_PER_BLOCK", "i32"), *((name, "i32") for name in BACKWARD_STRIDES))
    bd = block_d(problem.hidden, tiles, "bwd")
    chunks = triton.cdiv(problem.hidden, bd)
    grid = (problem.streams + 1, backward_blocks(problem, tiles)[1], chunks)
    return KernelSpec.make(engram_gate_bwd_kernel, args, _row_constexprs(problem, bd), grid,
                           num_warps=row_warps(bd, tiles), cost=backward_cost(problem, chunks, tiles))


def backward_cost(problem, chunks: int, tiles: GateTiles) -> Cost:
    """Stream programs, per token and stream: g, v, x and k (a chunked row re-reads the whole g
    and v rows per chunk for dgate) and 16 B of saved; the grad_v program: the S g rows and
    gates again. Written: grad_x, grad_k, grad_v and one fp32 partial row per block. The weight
    is counted once (L2)."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    blocks = backward_blocks(problem, tiles)[1]
    stream_rows = 4 if chunks == 1 else 2 * chunks + 3
    read = n * s * (stream_rows * d * e + 16) + n * s * (d * e + 4) + s * d * 4
    written = n * (2 * s + 1) * d * e + blocks * s * d * 4
    return Cost(BACKWARD_FLOPS_PER_ELEMENT * n * s * d, read, written)


def reduce_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    """grad_weight (+)= the sum of the partial rows; specialised on the most rows any N gives."""
    tiles = tiles or tiles_for(problem)
    block_p = triton.next_power_of_2(max_backward_blocks(problem.streams, problem.hidden, tiles))
    block_c = max(16, REDUCE_TILE // block_p)
    sd = problem.streams * problem.hidden
    blocks = backward_blocks(problem, tiles)[1]
    cost = Cost(blocks * sd, (blocks + problem.accumulate) * sd * 4, sd * 4)
    return KernelSpec.make(engram_gate_weight_reduce_kernel,
                           (("partials", "*fp32"), ("grad_weight", "*fp32"), ("NUM_PARTIALS", "i32")),
                           dict(SD=sd, BLOCK_P=block_p, BLOCK_C=block_c,
                                ACCUMULATE=problem.accumulate),
                           (triton.cdiv(sd, block_c),), num_warps=8, cost=cost)


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
