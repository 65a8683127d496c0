"""Mamba2 chunked scan: Triton forward kernels (the segment formulation of
backends/torch/mamba2.py). Workspace tensors, all fp32, indexed by segment σ:

    dts   [S, H, Q]   transformed dt (0 outside the segment)
    acum  [S, H, Q]   inclusive cumsum of dt·A inside the segment
    cb    [S, G, Q, Q] C_i·B_j (tiles with j-block <= i-block only)
    states [S, H, P, N] the segment's own state contribution, turned in place into the state
                       entering the segment by the state-passing kernel

Tokens are addressed in the flattened [b·l] index with 64-bit offsets. With packed sequences
the first kernel sanitises cu_seqlens into the workspace (c'[i] = clamp(c[i], c'[i-1], total),
c'[0] = clamp(c[0], 0, total); Status.CU_SEQLENS when c[0] != 0 or c' != c) and every later
kernel reads that copy, so whatever cu_seqlens holds no segment leaves the packed tokens and no
sequence has more segments than the workspace holds.
"""

import triton
import triton.language as tl

from fusedops.core.status import Status

from .tiles import last_at_most, mm, report_if

CU_SEQLENS_BIT: tl.constexpr = tl.constexpr(int(Status.CU_SEQLENS))


@triton.jit
def segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q: tl.constexpr, VARLEN: tl.constexpr,
                   SEARCH_STEPS: tl.constexpr):
    """[start, end) tokens of segment i_seg (start == end for unused trailing segments)."""
    if VARLEN:
        lo = last_at_most(off_ptr, i_seg, NSEQ, SEARCH_STEPS)     # the segment's sequence
        used = i_seg < tl.load(off_ptr + NSEQ)
        start = tl.load(cu_ptr + lo) + (i_seg - tl.load(off_ptr + lo)) * Q
        end = tl.minimum(tl.load(cu_ptr + lo + 1), start + Q)
        start = tl.where(used, start, 0)
        end = tl.where(used, end, 0)
    else:
        nc = tl.cdiv(L, Q)
        row = i_seg // nc
        c = i_seg - row * nc
        start = row * L + c * Q
        end = row * L + tl.minimum(L, c * Q + Q)
    return start, end


@triton.jit
def sequence_segments(i_s, off_ptr, L, Q: tl.constexpr, VARLEN: tl.constexpr):
    """[first, last) segments of sequence i_s."""
    if VARLEN:
        first = tl.load(off_ptr + i_s)
        last = tl.load(off_ptr + i_s + 1)
    else:
        nc = tl.cdiv(L, Q)
        first = i_s * nc
        last = first + nc
    return first, last


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def ssd_segment_table_kernel(cu_ptr, cu_out_ptr, off_ptr, status_ptr, NSEQ, TOTAL,
                             Q: tl.constexpr, BLOCK: tl.constexpr, HAS_STATUS: tl.constexpr):
    """One program. cu_out = the sanitised cu_seqlens (the running maximum of max(c, 0), capped
    at TOTAL), reporting CU_SEQLENS when c[0] != 0 or any entry changed; then off[s] = sum over
    s' < s of ceil(len_s' / Q) of the sanitised lengths: the first segment of every sequence."""
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    carry = zero
    bad = tl.load(cu_ptr) != 0
    for s0 in range(0, NSEQ + 1, BLOCK):
        o = s0 + tl.arange(0, BLOCK)
        m = o <= NSEQ
        c = tl.load(cu_ptr + o, mask=m, other=0)
        clean = tl.minimum(tl.maximum(tl.associative_scan(c, 0, _maximum), carry), TOTAL)
        tl.store(cu_out_ptr + o, clean, mask=m)
        bad = bad | (tl.max((m & (clean != c)).to(tl.int32), axis=0) != 0)
        carry = tl.maximum(carry, tl.max(tl.where(m, c, 0), axis=0))
    report_if(status_ptr, bad, CU_SEQLENS_BIT, HAS_STATUS)
    tl.debug_barrier()                  # the sanitised copy, written by every thread, is read next
    carry = zero
    tl.store(off_ptr, carry)
    for s0 in range(0, NSEQ, BLOCK):
        o = s0 + tl.arange(0, BLOCK)
        m = o < NSEQ
        lengths = tl.load(cu_out_ptr + o + 1, mask=m, other=0) - tl.load(cu_out_ptr + o, mask=m, other=0)
        counts = (lengths + Q - 1) // Q
        tl.store(off_ptr + o + 1, carry + tl.cumsum(counts, axis=0), mask=m)
        carry += tl.sum(counts, axis=0)


@triton.jit
def _zero_rows(ptr, o_t, m_t, W: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    """ptr[t, :W] = 0 for the BT tokens o_t where m_t (rows of W elements)."""
    if W > 0:
        for w0 in range(0, W, BW):
            o_w = w0 + tl.arange(0, BW)
            p = o_t.to(tl.int64)[:, None] * W + o_w[None, :]
            tl.store(ptr + p, tl.zeros([BT, BW], dtype=ptr.dtype.element_ty),
                     mask=m_t[:, None] & (o_w < W)[None, :])


@triton.jit
def ssd_zero_uncovered_kernel(cu_ptr, out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr, L, NSEQ,
                              W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                              W3: tl.constexpr, W4: tl.constexpr, BT: tl.constexpr,
                              BW: tl.constexpr):
    """Packed sequences: zeroes the rows of up to five per-token outputs (row widths W0..W4; 0:
    absent) at the tokens no sequence covers, [0, c'[0]) and [c'[nseq], L) of the sanitised
    offsets. A block of covered tokens (every one, for valid offsets) returns at once."""
    t0 = tl.program_id(0) * BT
    lo = tl.load(cu_ptr)
    hi = tl.load(cu_ptr + NSEQ)
    if (t0 >= lo) & (t0 + BT <= hi):
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = (o_t < L) & ((o_t < lo) | (o_t >= hi))
    _zero_rows(out0_ptr, o_t, m_t, W0, BT, BW)
    _zero_rows(out1_ptr, o_t, m_t, W1, BT, BW)
    _zero_rows(out2_ptr, o_t, m_t, W2, BT, BW)
    _zero_rows(out3_ptr, o_t, m_t, W3, BT, BW)
    _zero_rows(out4_ptr, o_t, m_t, W4, BT, BW)


@triton.jit
def ssd_dt_cumsum_kernel(dt_ptr, A_ptr, bias_ptr, cu_ptr, off_ptr, dts_ptr, acum_ptr, L, NSEQ,
                         dt_min, dt_max,
                         H: tl.constexpr, Q: tl.constexpr, BLOCK_H: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, VARLEN: tl.constexpr,
                         SEARCH_STEPS: tl.constexpr, SOFTPLUS_THRESHOLD: tl.constexpr):
    i_seg, i_h = tl.program_id(0), tl.program_id(1)
    start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    o_q = tl.arange(0, Q)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    tok = start + o_q
    m = (tok < end)[:, None] & m_h[None, :]
    b_dt = tl.load(dt_ptr + tok.to(tl.int64)[:, None] * H + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_dt += tl.load(bias_ptr + o_h, mask=m_h, other=0.0)[None, :]
    if SOFTPLUS:
        b_dt = tl.where(b_dt > SOFTPLUS_THRESHOLD, b_dt,
                        tl.maximum(b_dt, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(b_dt))))
    b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
    b_dt = tl.where(m, b_dt, 0.0)
    b_A = tl.load(A_ptr + o_h, mask=m_h, other=0.0)
    b_acum = tl.cumsum(b_dt * b_A[None, :], axis=0)
    p = i_seg.to(tl.int64) * (H * Q) + o_h[None, :] * Q + o_q[:, None]
    tl.store(dts_ptr + p, b_dt, mask=m_h[None, :])
    tl.store(acum_ptr + p, b_acum, mask=m_h[None, :])


@triton.jit
def ssd_cb_kernel(C_ptr, B_ptr, cu_ptr, off_ptr, cb_ptr, L, NSEQ,
                  G: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr,
                  BN: tl.constexpr, VARLEN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr):
    i_sg, i_t = tl.program_id(0), tl.program_id(1)
    i_seg, i_g = i_sg // G, i_sg % G
    NT: tl.constexpr = Q // BQ
    i_m, i_n = i_t // NT, i_t % NT
    if i_n > i_m:            # only tiles on or below the diagonal are ever read
        return
    start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    o_i = i_m * BQ + tl.arange(0, BQ)
    o_j = i_n * BQ + tl.arange(0, BQ)
    tok_i = (start + o_i).to(tl.int64)
    tok_j = (start + o_j).to(tl.int64)
    m_i, m_j = start + o_i < end, start + o_j < end
    b_acc = tl.zeros([BQ, BQ], dtype=tl.float32)
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        b_c = tl.load(C_ptr + tok_i[:, None] * (G * N) + i_g * N + o_n[None, :],
                      mask=m_i[:, None] & m_n[None, :], other=0.0)
        b_bt = tl.load(B_ptr + tok_j[None, :] * (G * N) + i_g * N + o_n[:, None],
                       mask=m_n[:, None] & m_j[None, :], other=0.0)
        b_acc = mm(b_c, b_bt, b_acc, UPCAST, IEEE)                  # [BQ, BN] @ [BN, BQ]
    p = i_sg.to(tl.int64) * (Q * Q) + o_i[:, None] * Q + o_j[None, :]
    tl.store(cb_ptr + p, b_acc)


@triton.jit
def ssd_segment_state_kernel(x_ptr, B_ptr, dts_ptr, acum_ptr, cu_ptr, off_ptr, states_ptr, L, NSEQ,
                             H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                             Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, FROM_START: tl.constexpr, VARLEN: tl.constexpr,
                             SEARCH_STEPS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """states[σ, h] = sum_j w_j x_j ⊗ B_j over the segment's tokens, with
    w_j = exp(Acum_last - Acum_j) dt_j: the segment's own contribution to its end state; or,
    FROM_START (backward, x = dy and B = C), w_j = exp(Acum_j): what dy sends back into H0."""
    i_sh, i_p, i_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_seg, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = i_n * BN + tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    p_seg = i_sh.to(tl.int64) * Q
    acum_last = tl.load(acum_ptr + p_seg + Q - 1)
    b_acc = tl.zeros([BP, BN], dtype=tl.float32)
    for k0 in range(0, end - start, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = start + o_k < end
        tok = (start + o_k).to(tl.int64)
        b_xt = tl.load(x_ptr + tok[None, :] * (H * P) + i_h * P + o_p[:, None],
                       mask=m_p[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(B_ptr + tok[:, None] * (G * N) + i_g * N + o_n[None, :],
                      mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acum = tl.load(acum_ptr + p_seg + o_k)
        if FROM_START:
            b_w = tl.exp(tl.minimum(b_acum, 0.0))
        else:
            b_w = tl.exp(tl.minimum(acum_last - b_acum, 0.0)) * tl.load(dts_ptr + p_seg + o_k)
        b_b = (b_b * b_w[:, None]).to(b_xt.dtype)
        b_acc = mm(b_xt, b_b, b_acc, UPCAST, IEEE)                  # [BP, BK] @ [BK, BN]
    p = i_sh.to(tl.int64) * (P * N) + o_p[:, None] * N + o_n[None, :]
    tl.store(states_ptr + p, b_acc, mask=m_p[:, None] & m_n[None, :])


@triton.jit
def ssd_state_passing_kernel(states_ptr, acum_ptr, h0_ptr, final_ptr, off_ptr, L,
                             H: tl.constexpr, PN: tl.constexpr, Q: tl.constexpr,
                             BLOCK: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr):
    """Along each sequence: states[σ] <- state entering σ; the last state is the final one."""
    i_s, i_h, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first, last = sequence_segments(i_s, off_ptr, L, Q, VARLEN)
    o = i_t * BLOCK + tl.arange(0, BLOCK)
    m = o < PN
    p_seq = (i_s.to(tl.int64) * H + i_h) * PN + o
    if HAS_H0:
        b_state = tl.load(h0_ptr + p_seq, mask=m, other=0.0)
    else:
        b_state = tl.zeros([BLOCK], dtype=tl.float32)
    first = first.to(tl.int64)
    for k in range(0, last - first):
        seg = first + k
        p = (seg * H + i_h) * PN + o
        b_own = tl.load(states_ptr + p, mask=m, other=0.0)
        tl.store(states_ptr + p, b_state, mask=m)
        decay = tl.exp(tl.minimum(tl.load(acum_ptr + (seg * H + i_h) * Q + Q - 1), 0.0))
        b_state = decay * b_state + b_own
    tl.store(final_ptr + p_seq, b_state, mask=m)


@triton.jit
def ssd_chunk_scan_fwd_kernel(x_ptr, z_ptr, C_ptr, cb_ptr, dts_ptr, acum_ptr, states_ptr, D_ptr,
                              cu_ptr, off_ptr, y_ptr, ypre_ptr, L, NSEQ,
                              H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                              Q: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr,
                              BN: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                              HAS_Z: tl.constexpr, VARLEN: tl.constexpr,
                              SEARCH_STEPS: tl.constexpr, UPCAST: tl.constexpr,
                              IEEE: tl.constexpr):
    """y_i = exp(Acum_i) C_i·H0 + sum_{j<=i} (C_i·B_j) exp(Acum_i - Acum_j) dt_j x_j + D x_i."""
    i_sh, i_p, i_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_seg, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    if i_m * BQ >= end - start:
        return
    o_i = i_m * BQ + tl.arange(0, BQ)
    o_p = i_p * BP + tl.arange(0, BP)
    m_i, m_p = start + o_i < end, o_p < P
    tok_i = (start + o_i).to(tl.int64)
    p_seg = i_sh.to(tl.int64) * Q
    b_acum_i = tl.load(acum_ptr + p_seg + o_i)

    # the state entering the segment: exp(Acum_i) C_i @ H0^T
    b_acc = tl.zeros([BQ, BP], dtype=tl.float32)
    p_state = states_ptr + i_sh.to(tl.int64) * (P * N)
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        b_c = tl.load(C_ptr + tok_i[:, None] * (G * N) + i_g * N + o_n[None, :],
                      mask=m_i[:, None] & m_n[None, :], other=0.0)
        b_h0t = tl.load(p_state + o_p[None, :] * N + o_n[:, None], mask=m_n[:, None] & m_p[None, :],
                        other=0.0)
        b_acc = mm(b_c, b_h0t.to(b_c.dtype), b_acc, UPCAST, IEEE)  # [BQ, BN] @ [BN, BP]
    b_acc *= tl.exp(tl.minimum(b_acum_i, 0.0))[:, None]

    # within the segment, j <= i
    p_cb = cb_ptr + (i_seg * G + i_g).to(tl.int64) * (Q * Q)
    for k0 in range(0, tl.minimum((i_m + 1) * BQ, end - start), BQ):
        o_k = k0 + tl.arange(0, BQ)
        m_k = start + o_k < end
        tok_k = (start + o_k).to(tl.int64)
        b_cb = tl.load(p_cb + o_i[:, None] * Q + o_k[None, :])
        b_acum_k = tl.load(acum_ptr + p_seg + o_k)
        b_dt_k = tl.load(dts_ptr + p_seg + o_k)
        b_w = b_cb * tl.exp(tl.minimum(b_acum_i[:, None] - b_acum_k[None, :], 0.0)) * b_dt_k[None, :]
        b_w = tl.where((o_k[None, :] <= o_i[:, None]) & m_k[None, :], b_w, 0.0)
        b_x = tl.load(x_ptr + tok_k[:, None] * (H * P) + i_h * P + o_p[None, :],
                      mask=m_k[:, None] & m_p[None, :], other=0.0)
        b_acc = mm(b_w.to(b_x.dtype), b_x, b_acc, UPCAST, IEEE)  # [BQ, BQ] @ [BQ, BP]

    p_out = tok_i[:, None] * (H * P) + i_h * P + o_p[None, :]
    m_out = m_i[:, None] & m_p[None, :]
    if HAS_D:
        b_xi = tl.load(x_ptr + p_out, mask=m_out, other=0.0).to(tl.float32)
        if D_PER_CHANNEL:
            b_acc += tl.load(D_ptr + i_h * P + o_p, mask=m_p, other=0.0)[None, :] * b_xi
        else:
            b_acc += tl.load(D_ptr + i_h) * b_xi
    if HAS_Z:
        tl.store(ypre_ptr + p_out, b_acc.to(ypre_ptr.dtype.element_ty), mask=m_out)
        b_z = tl.load(z_ptr + p_out, mask=m_out, other=0.0).to(tl.float32)
        b_acc *= b_z * tl.sigmoid(b_z)
    tl.store(y_ptr + p_out, b_acc.to(y_ptr.dtype.element_ty), mask=m_out)
