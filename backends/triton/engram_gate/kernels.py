"""Engram saved-state gate: the Triton kernels.

Rows are covered in chunks that divide D where they can (``tiles.row_layout``): a held row's
chunks are a tuple of registers unrolled at compile time; rows too wide to hold are streamed.

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

import triton
import triton.language as tl




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
