"""Engram saved-state gate: Triton kernels and their launchers (fusedops.engram_gate.contract).

Rows are covered in chunks that divide D where they can (``row_layout``): a held row's chunks
are a tuple of registers unrolled at compile time; rows too wide to hold are streamed.

Forward: one program per token; the shared value's chunks stay in registers while the S streams
are processed, each stream's x/key/weight chunks loaded together, the three fp32 sums reduced in
one cross-warp exchange and the output written from the held x.

Backward: programs (s, token block) for held rows, (s, token block, D chunk) for streamed ones.
Programs s < S recompute the gate derivative of each token of their block, write grad_x and the
stream's grad_key, and accumulate sum_n(coef * x * k) in fp32 registers, stored as one partial
row per block in the caller's workspace. Program s == S writes grad_v = sum_s gate_s * g_s (fp32,
rounded once). A second kernel sums the partials over blocks in fixed order into grad_weight
(``+=`` when accumulating): no float atomics, bitwise reproducible for a given plan.
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
from fusedops.engram_gate.contract import (BACKWARD_FLOPS_PER_ELEMENT, DOT_CLAMP,
                                           FORWARD_FLOPS_PER_ELEMENT, token_blocks)

from ..runtime import KernelSpec, pointer_type

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
def _chunk(p, i_c: tl.constexpr, o_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    # chunk i_c of a row in its own dtype (held rows stay packed); only a chunk that reaches
    # past D is masked
    if (i_c + 1) * BLOCK_D <= D:
        b = tl.load(p + i_c * BLOCK_D + o_d)
    else:
        b = tl.load(p + i_c * BLOCK_D + o_d, mask=i_c * BLOCK_D + o_d < D, other=0.0)
    return b


@triton.jit
def _store_chunk(p, i_c: tl.constexpr, o_d, b, D: tl.constexpr, BLOCK_D: tl.constexpr):
    if (i_c + 1) * BLOCK_D <= D:
        tl.store(p + i_c * BLOCK_D + o_d, b.to(p.dtype.element_ty))
    else:
        tl.store(p + i_c * BLOCK_D + o_d, b.to(p.dtype.element_ty), mask=i_c * BLOCK_D + o_d < D)


@triton.jit
def _sums3(b_a, b_b, b_c):
    # the three fp32 row sums in one reduction: one shared-memory exchange, not three
    b_ab, b_cc = tl.split(tl.sum(tl.join(tl.join(b_a, b_b), tl.join(b_c, b_c)), axis=0))
    a, b = tl.split(b_ab)
    c, _ = tl.split(b_cc)
    return a, b, c


@triton.jit
def engram_gate_fwd_kernel(x, kv, weight, mask, out, saved, eps,
                           stride_xn, stride_xs, stride_kvn, stride_outn, stride_outs,
                           S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, HELD: tl.constexpr, HAS_MASK: tl.constexpr,
                           SQRT_D: tl.constexpr, DOT_MIN: tl.constexpr, VEC: tl.constexpr):
    # strides come in units of VEC elements (16 bytes): every row starts 16-byte aligned.
    # HELD: the row's NUM_CHUNKS chunks stay in registers (a tuple unrolled at compile time);
    # otherwise the row is streamed twice, x and v re-read for the output.
    i_n = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    p_x = x + i_n * (stride_xn * VEC)
    p_kv = kv + i_n * (stride_kvn * VEC)
    p_out = out + i_n * (stride_outn * VEC)
    if HAS_MASK:
        keep = tl.load(mask + i_n) != 0
    if HELD:
        vs = ()
        for i_c in tl.static_range(NUM_CHUNKS):
            vs = vs + (_chunk(p_kv + S * D, i_c, o_d, D, BLOCK_D),)
        for i_s in tl.static_range(S):
            xs = ()
            b_xx = tl.zeros([BLOCK_D], dtype=tl.float32)
            b_kk = tl.zeros([BLOCK_D], dtype=tl.float32)
            b_xwk = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i_c in tl.static_range(NUM_CHUNKS):
                b_xh = _chunk(p_x + i_s * (stride_xs * VEC), i_c, o_d, D, BLOCK_D)
                b_k = _chunk(p_kv + i_s * D, i_c, o_d, D, BLOCK_D).to(tl.float32)
                b_w = _chunk(weight + i_s * D, i_c, o_d, D, BLOCK_D)
                xs = xs + (b_xh,)
                b_x = b_xh.to(tl.float32)
                b_xx += b_x * b_x
                b_kk += b_k * b_k
                b_xwk += b_x * b_w * b_k
            sxx, skk, sxwk = _sums3(b_xx, b_kk, b_xwk)
            gate, dot, rx, rk = _gate_from_sums(sxx, skk, sxwk, eps, D, SQRT_D, DOT_MIN)
            if HAS_MASK:
                gate = tl.where(keep, gate, 0.0)
            for i_c in tl.static_range(NUM_CHUNKS):
                b_x = xs[i_c].to(tl.float32)
                b_o = b_x + gate * vs[i_c].to(tl.float32)
                if HAS_MASK:
                    b_o = tl.where(keep, b_o, b_x)
                _store_chunk(p_out + i_s * (stride_outs * VEC), i_c, o_d, b_o, D, BLOCK_D)
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
            sxx, skk, sxwk = _sums3(b_xx, b_kk, b_xwk)
            gate, dot, rx, rk = _gate_from_sums(sxx, skk, sxwk, eps, D, SQRT_D, DOT_MIN)
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
            token, coef, c_x, c_k = _token_coefs(saved + (i_n * S + i_s) * 4, dgate, D, SQRT_D,
                                                 DOT_MIN)
            b_x = tl.load(x + i_n * (stride_xn * VEC) + i_s * (stride_xs * VEC) + o_c, mask=m_c, other=0.0).to(tl.float32)
            b_k = tl.load(kv + i_n * (stride_kvn * VEC) + i_s * D + o_c, mask=m_c,
                          other=0.0).to(tl.float32)
            b_gx = b_g + tl.where(token, coef * b_w * b_k - c_x * b_x, 0.0)
            b_gk = tl.where(token, coef * b_w * b_x - c_k * b_k, 0.0)
            tl.store(grad_x + i_n * (stride_gxn * VEC) + i_s * (stride_gxs * VEC) + o_c, b_gx.to(grad_x.dtype.element_ty),
                     mask=m_c)
            tl.store(grad_kv + i_n * (stride_gkvn * VEC) + i_s * D + o_c,
                     b_gk.to(grad_kv.dtype.element_ty), mask=m_c)
            b_acc += tl.where(token, coef * b_x * b_k, 0.0)
        tl.store(partials + (i_b.to(tl.int64) * S + i_s) * D + o_c, b_acc, mask=m_c)


@triton.jit
def _token_coefs(p_saved, dgate, D: tl.constexpr, SQRT_D: tl.constexpr, DOT_MIN: tl.constexpr):
    # (token, coef, c_x, c_k) of one (token, stream) from its saved statistics and dgate; a
    # masked token (gate 0) is isolated: callers select its x, k and statistics away
    gate = tl.load(p_saved)
    dot = tl.load(p_saved + 1)
    rx = tl.load(p_saved + 2)
    rk = tl.load(p_saved + 3)
    mag = tl.abs(dot)
    slope = 0.5 / tl.sqrt_rn(tl.maximum(mag, DOT_MIN))
    ddot = tl.where((mag >= DOT_MIN) & (gate != 0.0), dgate * gate * (1.0 - gate) * slope, 0.0)
    return (gate != 0.0, ddot * rx * rk / SQRT_D, ddot * dot * rx * rx / D,
            ddot * dot * rk * rk / D)


@triton.jit
def engram_gate_bwd_held_kernel(x, kv, weight, saved, grad_out, grad_x, grad_kv, partials,
                                N, TOKENS_PER_BLOCK, stride_xn, stride_xs, stride_kvn, stride_gn,
                                stride_gs, stride_gxn, stride_gxs, stride_gkvn,
                                S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                                NUM_CHUNKS: tl.constexpr, SQRT_D: tl.constexpr,
                                DOT_MIN: tl.constexpr, VEC: tl.constexpr):
    # the backward of rows a program holds whole in registers as NUM_CHUNKS chunks (tuples
    # unrolled at compile time): programs (s, token block), every load of a token issued
    # before its dgate reduction; strides in units of VEC elements, as in the forward
    i_s = tl.program_id(0)
    i_b = tl.program_id(1)
    o_d = tl.arange(0, BLOCK_D)
    n_start = i_b * TOKENS_PER_BLOCK
    n_count = tl.minimum(n_start + TOKENS_PER_BLOCK, N) - n_start
    n_start = n_start.to(tl.int64)
    if i_s == S:
        # grad_v = sum_s gate_s * g_s, in fp32, rounded once
        for j in range(0, n_count):
            i_n = n_start + j
            p_g = grad_out + i_n * (stride_gn * VEC)
            gates = ()
            for j_s in tl.static_range(S):
                gates = gates + (tl.load(saved + (i_n * S + j_s) * 4),)
            for i_c in tl.static_range(NUM_CHUNKS):
                b_gv = tl.zeros([BLOCK_D], dtype=tl.float32)
                for j_s in tl.static_range(S):
                    b_g = _chunk(p_g + j_s * (stride_gs * VEC), i_c, o_d, D, BLOCK_D)
                    b_gv += tl.where(gates[j_s] != 0.0, gates[j_s] * b_g.to(tl.float32), 0.0)
                _store_chunk(grad_kv + i_n * (stride_gkvn * VEC) + S * D, i_c, o_d, b_gv, D,
                             BLOCK_D)
    else:
        accs = ()
        for i_c in tl.static_range(NUM_CHUNKS):
            accs = accs + (tl.zeros([BLOCK_D], dtype=tl.float32),)
        for j in range(0, n_count):
            i_n = n_start + j
            p_g = grad_out + i_n * (stride_gn * VEC) + i_s * (stride_gs * VEC)
            p_v = kv + i_n * (stride_kvn * VEC) + S * D
            p_x = x + i_n * (stride_xn * VEC) + i_s * (stride_xs * VEC)
            p_k = kv + i_n * (stride_kvn * VEC) + i_s * D
            gs = ()
            xs = ()
            ks = ()
            b_gv = tl.zeros([BLOCK_D], dtype=tl.float32)
            for i_c in tl.static_range(NUM_CHUNKS):
                b_g = _chunk(p_g, i_c, o_d, D, BLOCK_D)
                xs = xs + (_chunk(p_x, i_c, o_d, D, BLOCK_D),)
                ks = ks + (_chunk(p_k, i_c, o_d, D, BLOCK_D),)
                gs = gs + (b_g,)
                b_gv += b_g.to(tl.float32) * _chunk(p_v, i_c, o_d, D, BLOCK_D).to(tl.float32)
            token, coef, c_x, c_k = _token_coefs(saved + (i_n * S + i_s) * 4, tl.sum(b_gv), D,
                                                 SQRT_D, DOT_MIN)
            sums = ()
            for i_c in tl.static_range(NUM_CHUNKS):
                b_x = xs[i_c].to(tl.float32)
                b_k = ks[i_c].to(tl.float32)
                b_w = _chunk(weight + i_s * D, i_c, o_d, D, BLOCK_D)
                b_gx = gs[i_c].to(tl.float32) + tl.where(token, coef * b_w * b_k - c_x * b_x, 0.0)
                b_gk = tl.where(token, coef * b_w * b_x - c_k * b_k, 0.0)
                _store_chunk(grad_x + i_n * (stride_gxn * VEC) + i_s * (stride_gxs * VEC), i_c,
                             o_d, b_gx, D, BLOCK_D)
                _store_chunk(grad_kv + i_n * (stride_gkvn * VEC) + i_s * D, i_c, o_d, b_gk, D,
                             BLOCK_D)
                sums = sums + (accs[i_c] + tl.where(token, coef * b_x * b_k, 0.0),)
            accs = sums
        for i_c in tl.static_range(NUM_CHUNKS):
            _store_chunk(partials + (i_b.to(tl.int64) * S + i_s) * D, i_c, o_d, accs[i_c], D,
                         BLOCK_D)


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
    (about 16 elements per thread below it); held_elements: the most elements of one row a
    forward thread holds in registers (one 16-byte vector per chunk), above which the forward
    streams the row twice."""

    max_block_d: int = 8192
    target_programs: int = 640
    max_warps: int = 16
    held_elements: int = 48


TILES = {
    "sm_80": (GateTiles(8192, 540, 16), "108 SMs (A100): about five backward programs per SM"),
    "sm_90": (GateTiles(8192, 640, 16), "132 SMs (H100/H200): about five backward programs per SM; "
              "a forward thread holds up to 48 elements of a row, a backward one 24 (D = 5120 "
              "bf16: 4 warps x 5 chunks forward, 3-4 CTAs/SM; 8 warps x 5 chunks backward, 3)"),
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


@dataclass(frozen=True)
class RowLayout:
    """How a program covers a row of D elements: ``chunks`` chunks of ``block`` elements (a
    power of two) on ``warps`` warps; ``held``: the chunks stay in registers (one program per
    row), else the row is streamed chunk by chunk (the backward splits it over programs)."""

    block: int
    chunks: int
    warps: int
    held: bool


def row_layout(problem, tiles: GateTiles, kernel: str = "fwd") -> RowLayout:
    """The held layout that pads the row least, with a 16- or 8-byte vector per thread per
    chunk, at most ``held_elements`` (forward) or half of it (backward, which keeps the weight
    and the grad_weight partial too) per thread; on a tie the wider vector, then fewer warps
    (more CTAs per SM). Rows no held layout covers are streamed in block_d chunks."""
    vec, d = vector_elements(problem), problem.hidden
    limit = tiles.held_elements if kernel == "fwd" else tiles.held_elements // 2
    best, best_key = None, None
    for warps in (1, 2, 4, 8, 16, 32):
        for per_thread in {vec, max(1, vec // 2)}:
            block = per_thread * 32 * warps
            chunks = triton.cdiv(d, block)
            if warps > tiles.max_warps or chunks * per_thread > limit:
                continue
            key = (chunks * block - d, -per_thread, warps)
            if best_key is None or key < best_key:
                best, best_key = RowLayout(block, chunks, warps, True), key
    if best is not None:
        return best
    bd = block_d(d, tiles, kernel)
    return RowLayout(bd, triton.cdiv(d, bd), row_warps(bd, tiles), False)


def forward_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    tiles = tiles or tiles_for(problem)
    t = pointer_type(problem.dtype)
    args = (("x", t), ("kv", t), ("weight", "*fp32"), ("mask", "*i1" if problem.has_mask else None),
            ("out", t), ("saved", "*fp32"), ("eps", "fp32"),
            *((name, "i32") for name in FORWARD_STRIDES))
    layout = row_layout(problem, tiles)
    constexprs = dict(_row_constexprs(problem, layout.block), HELD=layout.held,
                      HAS_MASK=problem.has_mask)
    return KernelSpec.make(engram_gate_fwd_kernel, args, constexprs, (problem.tokens,),
                           num_warps=layout.warps, cost=forward_cost(problem, layout))


def forward_cost(problem, layout: RowLayout) -> Cost:
    """Per token: x, the S keys and v once, the mask; out and saved written. A streamed row
    (``layout`` not held) reads x again for out and v per stream inside the same program:
    those re-reads come from L2 (the reuse-distance rule of docs/performance.md, a gap of no
    program). The weight (S·D fp32, read by every program) is counted once: it stays in L2."""
    n, s, d, e = problem.tokens, problem.streams, problem.hidden, element_size(problem.dtype)
    read = n * (2 * s + 1) * d * e + s * d * 4 + (n if problem.has_mask else 0)
    return Cost(FORWARD_FLOPS_PER_ELEMENT * n * s * d, read, n * s * d * e + n * s * 16)


def max_backward_blocks(problem, tiles: GateTiles) -> int:
    """The most token blocks (grad_weight partial rows) any token count gets: about
    target_programs programs of (stream or grad_v, block, D chunk)."""
    layout = row_layout(problem, tiles, "bwd")
    chunks = 1 if layout.held else layout.chunks
    return max(1, tiles.target_programs // ((problem.streams + 1) * chunks))


def backward_blocks(problem, tiles: GateTiles | None = None) -> tuple[int, int]:
    """(tokens per block, number of blocks) of the backward kernel for ``problem.tokens``."""
    tiles = tiles or tiles_for(problem)
    return token_blocks(problem.tokens, max_backward_blocks(problem, tiles))


def backward_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    tiles = tiles or tiles_for(problem)
    t = pointer_type(problem.dtype)
    args = (("x", t), ("kv", t), ("weight", "*fp32"), ("saved", "*fp32"), ("grad_out", t),
            ("grad_x", t), ("grad_kv", t), ("partials", "*fp32"), ("N", "i32"),
            ("TOKENS_PER_BLOCK", "i32"), *((name, "i32") for name in BACKWARD_STRIDES))
    layout = row_layout(problem, tiles, "bwd")
    blocks = backward_blocks(problem, tiles)[1]
    if layout.held:
        kernel, grid = engram_gate_bwd_held_kernel, (problem.streams + 1, blocks)
    else:
        kernel, grid = engram_gate_bwd_kernel, (problem.streams + 1, blocks, layout.chunks)
    return KernelSpec.make(kernel, args, _row_constexprs(problem, layout.block), grid,
                           num_warps=layout.warps, cost=backward_cost(problem, layout, tiles))


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


def reduce_spec(problem, tiles: GateTiles | None = None) -> KernelSpec:
    """grad_weight (+)= the sum of the partial rows; specialised on the most rows any N gives."""
    tiles = tiles or tiles_for(problem)
    block_p = triton.next_power_of_2(max_backward_blocks(problem, tiles))
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
