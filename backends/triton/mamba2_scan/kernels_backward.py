"""Mamba2 chunked scan: Triton backward kernels.

For a segment with entering state H0, end state H1 and dH1 = dL/dH1 (the next segment's dH0, or
dfinal_states), writing W_ij = (C_i·B_j) exp(Acum_i - Acum_j) for j <= i and dy for the gradient
of y before the z gate:

    dx_j   = dt_j [sum_{i>=j} W_ij dy_i + exp(Acum_last - Acum_j) dH1 B_j] + D dy_j
    dB_j   = sum_h [sum_{i>=j} exp(..) dt_j (dy_i·x_j) C_i + exp(Acum_last - Acum_j) dt_j dH1^T x_j]
    dC_i   = sum_h [sum_{j<=i} exp(..) dt_j (dy_i·x_j) B_j + exp(Acum_i) H0^T dy_i]
    dH0    = sum_i exp(Acum_i) dy_i ⊗ C_i + exp(Acum_last) dH1
    da_k   = sum_{i>=k>j} T_ij + sum_{i>=k} U_i + V + sum_{j<k} W'_j       (a_k = dt_k A)

with T_ij = W_ij dt_j (dy_i·x_j), U_i = exp(Acum_i) dy_i·(H0 C_i), V = exp(Acum_last) <dH1, H0>,
W'_j = exp(Acum_last - Acum_j) dt_j x_j·(dH1 B_j): the pairs crossing k, never differences of
sums over the sequence (the dB/dC kernel forms each block pair's share from prefix sums of
its own tile's row and column sums, so what cancels is bounded by that tile's terms).
Every reduction over tokens, heads or tiles goes through fixed-order partials in the workspace.
Activations are addressed through their strides as in the forward kernels (kernels_forward.py); with
sequence ids the forward's masks apply (C·B and dcb zero across runs, dH1 reaches only the last
token's run, H0 only the run before the segment, dH1 passes H0 only when the segment carries).
"""

import triton
import triton.language as tl

from .kernels_forward import (accumulate_state, cb_tile, rows_product, segment_bounds, segment_runs,
                              sequence_span, state_tile, token_runs, token_weights, walk_tile)
from ..ssm_math import softplus
from ..primitives import mm


@triton.jit
def accumulate_gated_state(b_acc, p_dy, p_z, p_y, p_dyg, p_dz, p_c, acum_ptr, runs_ptr, p_seg, row,
                           start, end, L, r_keep, o_p, o_n, m_p, m_n, stride_dy_l, stride_z_l,
                           stride_y_l, stride_dz_l, stride_C_l, m_w, BK: tl.constexpr,
                           UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SEQ: tl.constexpr,
                           VX: tl.constexpr, VB: tl.constexpr):
    """The z gate's backward fused into the state walk: b_acc [BP, BN] + sum_i exp(Acum_i)
    (dy_i·silu(z_i)) ⊗ C_i over the segment's tokens [start, end), dy·silu(z) formed in fp32
    from dy, z and y before the gate (rows o_p at p_dy, p_z, p_y) and rounded to the input dtype
    as the later kernels read it, and stored (p_dyg, contiguous like p_y) with dz =
    dy·y_pre·silu'(z) (p_dz) for the rows m_w (none, or o_p's)."""
    for k0 in range(0, end - start, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = start + o_k < end
        tok = (start + o_k).to(tl.int64)
        m = m_p[:, None] & m_k[None, :]
        m_store = m_w[:, None] & m_k[None, :]
        b_dy = tl.load(p_dy + tok[None, :] * (stride_dy_l * VX) + o_p[:, None], mask=m,
                       other=0.0).to(tl.float32)
        b_z = tl.load(p_z + tok[None, :] * (stride_z_l * VX) + o_p[:, None], mask=m,
                      other=0.0).to(tl.float32)
        b_y = tl.load(p_y + tok[None, :] * (stride_y_l * VX) + o_p[:, None], mask=m,
                      other=0.0).to(tl.float32)
        sig = tl.sigmoid(b_z)
        b_g = (b_dy * b_z * sig).to(p_dyg.dtype.element_ty)
        tl.store(p_dyg + tok[None, :] * (stride_y_l * VX) + o_p[:, None], b_g, mask=m_store)
        tl.store(p_dz + tok[None, :] * (stride_dz_l * VX) + o_p[:, None],
                 (b_dy * b_y * sig * (1.0 + b_z * (1.0 - sig))).to(p_dz.dtype.element_ty),
                 mask=m_store)
        b_w = token_weights(acum_ptr, acum_ptr, runs_ptr, p_seg, row, start, o_k, m_k, L, 0.0,
                            r_keep, True, HAS_SEQ)
        b_c = tl.load(p_c + tok[:, None] * (stride_C_l * VB) + o_n[None, :],
                      mask=m_k[:, None] & m_n[None, :], other=0.0)
        # both operands are formed in registers here, so the weights go with C (through shared
        # memory: the product is waited for); weighting dy·silu(z) instead takes the walk past
        # its 128-register budget
        b_wc = (b_c.to(tl.float32) * b_w[:, None]).to(b_g.dtype)
        b_acc = mm(b_g, b_wc, b_acc, UPCAST, IEEE)                  # [BP, BK] @ [BK, BN]
    return b_acc


@triton.jit
def ssd_chunk_states_bwd_kernel(dy_ptr, z_ptr, ypre_ptr, dypre_ptr, dz_ptr, C_ptr, acum_ptr,
                                dfinal_ptr, dh0_ptr, cu_ptr, off_ptr, runs_ptr, dstates_ptr,
                                stride_dy_b, stride_dy_l, stride_dy_h,
                                stride_z_b, stride_z_l, stride_z_h, stride_y_b, stride_y_l,
                                stride_y_h, stride_dz_b, stride_dz_l, stride_dz_h, stride_C_b,
                                stride_C_l, stride_C_g, L, H: tl.constexpr, G: tl.constexpr,
                                P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr,
                                BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                                HAS_DFINAL: tl.constexpr, HAS_DH0: tl.constexpr,
                                GATE: tl.constexpr, VARLEN: tl.constexpr, UPCAST: tl.constexpr,
                                IEEE: tl.constexpr, HAS_SEQ: tl.constexpr, VX: tl.constexpr,
                                VB: tl.constexpr):
    """The state gradients backwards along every sequence, in one pass: a program walks its
    sequence's segments from the last with a [BP, BN] tile of dH in fp32 registers
    (dfinal_states or zero), storing it in the input dtype as the segment's end-state gradient
    dH1 (dstates; dx and dB cast it to that dtype before their products anyway), then
    dH0 = exp(Acum_last) dH1 + sum_i exp(Acum_i) dy_i ⊗ C_i
    (sequence ids: dH1 passes only when the segment carries, and only the tokens of the run
    before the segment count); the first segment's dH0 is dinitial_states. GATE (z given): dy
    here is dy·silu(z), formed from dy, z and y before the gate as the walk reads them
    (``accumulate_gated_state``); the first state tile's programs store it (dypre, contiguous,
    for the later kernels) and dz, so every covered token's are written once. One program per
    (state tile, head-dim tile, sequence·head), the tiles fastest: the tiles of a (sequence,
    head) share its dy (z, y) rows in L2, the R heads of a group its C rows."""
    NPB: tl.constexpr = (P + BP - 1) // BP
    NNB: tl.constexpr = (N + BN - 1) // BN
    pid = tl.program_id(0)
    i_n, i_p, i_sh = pid % NNB, pid // NNB % NPB, pid // (NNB * NPB)
    i_s, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    first, last, row, seq_start, seq_end = sequence_span(i_s, cu_ptr, off_ptr, L, Q, VARLEN)
    o_p, o_n, m_p, m_n, m_pn, o_pn, p_seq = walk_tile(i_p, i_n, i_sh, P, N, BP, BN)
    b_dh = state_tile(dfinal_ptr, p_seq, m_pn, BP, BN, HAS_DFINAL)
    p_dy = dy_ptr + row * (stride_dy_b * VX) + i_h * (stride_dy_h * VX)
    p_c = C_ptr + row * (stride_C_b * VB) + i_g * (stride_C_g * VB)
    if GATE:
        p_z = z_ptr + row * (stride_z_b * VX) + i_h * (stride_z_h * VX)
        p_dz = dz_ptr + row * (stride_dz_b * VX) + i_h * (stride_dz_h * VX)
        p_y = ypre_ptr + row * (stride_y_b * VX) + i_h * (stride_y_h * VX)
        p_dyg = dypre_ptr + row * (stride_y_b * VX) + i_h * (stride_y_h * VX)
        # the first state tile writes the gate's outputs (compared per row: the interpreter
        # gives a scalar comparison's mask an int32 dtype)
        m_w = m_p & (o_p * 0 + i_n == 0)
    count = last - first
    for k in range(0, count):
        kk = count - 1 - k
        seg = first + kk
        start = seq_start + kk * Q
        end = tl.minimum(seq_end, start + Q)
        p = (seg * H + i_h) * (P * N) + o_pn
        tl.store(dstates_ptr + p, b_dh.to(dstates_ptr.dtype.element_ty), mask=m_pn)
        p_seg = (seg * H + i_h) * Q
        decay = tl.exp(tl.minimum(tl.load(acum_ptr + p_seg + Q - 1), 0.0))
        r_prev = 0
        if HAS_SEQ:
            r_prev, r_last = segment_runs(runs_ptr, row, start, end, L)
            decay = tl.where(r_prev == r_last, decay, 0.0)
        if GATE:
            b_dh = accumulate_gated_state(b_dh * decay, p_dy, p_z, p_y, p_dyg, p_dz, p_c,
                                          acum_ptr, runs_ptr, p_seg, row, start, end, L, r_prev,
                                          o_p, o_n, m_p, m_n, stride_dy_l, stride_z_l,
                                          stride_y_l, stride_dz_l, stride_C_l, m_w, BK, UPCAST,
                                          IEEE, HAS_SEQ, VX, VB)
        else:
            b_dh = accumulate_state(b_dh * decay, p_dy, p_c, acum_ptr, acum_ptr, runs_ptr, p_seg,
                                    row, start, end, L, 0.0, r_prev, o_p, o_n, m_p, m_n,
                                    stride_dy_l, stride_C_l, BK, True, UPCAST, IEEE, HAS_SEQ,
                                    VX, VB)
    if HAS_DH0:
        tl.store(dh0_ptr + p_seq, b_dh, mask=m_pn)


@triton.jit
def ssd_chunk_scan_bwd_dx_kernel(x_ptr, dy_ptr, B_ptr, cb_ptr, dts_ptr, acum_ptr, dstates_ptr,
                                 D_ptr, cu_ptr, off_ptr, runs_ptr, dx_ptr, ddt_part_ptr,
                                 dD_part_ptr,
                                 stride_x_b, stride_x_l, stride_x_h, stride_dy_b, stride_dy_l,
                                 stride_dy_h, stride_B_b, stride_B_l, stride_B_g, stride_dx_b,
                                 stride_dx_l, stride_dx_h, L, NSEQ,
                                 H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                                 N: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr,
                                 BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
                                 D_PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr,
                                 SEARCH_STEPS: tl.constexpr, UPCAST: tl.constexpr,
                                 IEEE: tl.constexpr, HAS_SEQ: tl.constexpr, VX: tl.constexpr,
                                 VB: tl.constexpr):
    """dx of the rows j of one block, the dt-linear part of ddt (per head-dim tile) and the
    dD partial sums of the block (``dx_rows``). One program per (head-dim tile, row block,
    segment·head), the tiles fastest: a segment's row blocks run together and share its dH tile
    and dy rows in L2."""
    NQB: tl.constexpr = Q // BQ
    NPB: tl.constexpr = (P + BP - 1) // BP
    pid = tl.program_id(0)
    i_p, i_m, i_sh = pid % NPB, pid // NPB % NQB, pid // (NPB * NQB)
    i_seg, i_h = i_sh // H, i_sh % H
    row, start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    dx_rows(x_ptr, dy_ptr, B_ptr, cb_ptr, dts_ptr, acum_ptr, dstates_ptr, D_ptr, runs_ptr, dx_ptr,
            ddt_part_ptr, dD_part_ptr, stride_x_b, stride_x_l, stride_x_h, stride_dy_b,
            stride_dy_l, stride_dy_h, stride_B_b, stride_B_l, stride_B_g, stride_dx_b,
            stride_dx_l, stride_dx_h, row, start, end, L, i_seg, i_h, i_m, i_p, H, G, P, N, Q,
            BQ, BP, BN, HAS_D, D_PER_CHANNEL, UPCAST, IEEE, HAS_SEQ, VX, VB)


@triton.jit
def dx_rows(x_ptr, dy_ptr, B_ptr, cb_ptr, dts_ptr, acum_ptr, dstates_ptr, D_ptr, runs_ptr, dx_ptr,
            ddt_part_ptr, dD_part_ptr, stride_x_b, stride_x_l, stride_x_h, stride_dy_b,
            stride_dy_l, stride_dy_h, stride_B_b, stride_B_l, stride_B_g, stride_dx_b,
            stride_dx_l, stride_dx_h, row, start, end, L, i_seg, i_h, i_m, i_p,
            H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr,
            BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr,
            D_PER_CHANNEL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
            HAS_SEQ: tl.constexpr, VX: tl.constexpr, VB: tl.constexpr):
    """dx of head i_h's rows j of row block i_m over head-dim tile i_p of one segment (its batch
    row ``row``, tokens [start, end)), the dt-linear part of ddt (the tile's partial) and the dD
    partial sums of the block, from C·B (``cb_ptr``), dy, x, B and dH1."""
    NQB: tl.constexpr = Q // BQ
    NPB: tl.constexpr = (P + BP - 1) // BP
    i_sh = i_seg * H + i_h
    i_g = i_h // (H // G)
    seg_len = end - start
    o_j = i_m * BQ + tl.arange(0, BQ)
    o_p = i_p * BP + tl.arange(0, BP)
    m_j, m_p = start + o_j < end, o_p < P
    tok_j = (start + o_j).to(tl.int64)
    p_seg = i_sh.to(tl.int64) * Q
    b_acum_j = tl.load(acum_ptr + p_seg + o_j)
    acum_last = tl.load(acum_ptr + p_seg + Q - 1)

    # the end state's gradient: exp(Acum_last - Acum_j) B_j @ dH1^T
    b_acc = tl.zeros([BQ, BP], dtype=tl.float32)
    p_dstate = dstates_ptr + i_sh.to(tl.int64) * (P * N)
    m_dh = m_p & (o_p * 0 < seg_len)          # the walk writes no dH1 for a segment without tokens
    p_b = (B_ptr + row * (stride_B_b * VB) + i_g * (stride_B_g * VB)
           + tok_j[:, None] * (stride_B_l * VB))
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        b_b = tl.load(p_b + o_n[None, :], mask=m_j[:, None] & m_n[None, :], other=0.0)
        b_dht = tl.load(p_dstate + o_p[None, :] * N + o_n[:, None],
                        mask=m_n[:, None] & m_dh[None, :], other=0.0)
        b_acc = mm(b_b, b_dht.to(b_b.dtype), b_acc, UPCAST, IEEE)  # [BQ, BN] @ [BN, BP]
    b_end = tl.exp(tl.minimum(acum_last - b_acum_j, 0.0))
    if HAS_SEQ:              # dH1 reaches only the last token's run
        r_prev, r_last = segment_runs(runs_ptr, row, start, end, L)
        b_end = tl.where(token_runs(runs_ptr, row, start, o_j, m_j, L) == r_last, b_end, 0.0)
    b_acc *= b_end[:, None]
    p_dy = dy_ptr + row * (stride_dy_b * VX) + i_h * (stride_dy_h * VX)
    p_x = x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX)

    # within the segment: sum over i >= j of W_ij dy_i
    p_cb = cb_ptr + (i_seg * G + i_g).to(tl.int64) * (Q * Q)
    for k0 in range(i_m * BQ, seg_len, BQ):
        o_i = k0 + tl.arange(0, BQ)
        m_i = start + o_i < end
        tok_i = (start + o_i).to(tl.int64)
        b_cbt = tl.load(p_cb + o_i[None, :] * Q + o_j[:, None],          # [j, i] = CB[i, j]
                        mask=o_i[None, :] >= o_j[:, None], other=0.0)
        b_acum_i = tl.load(acum_ptr + p_seg + o_i)
        b_w = b_cbt * tl.exp(tl.minimum(b_acum_i[None, :] - b_acum_j[:, None], 0.0))
        b_w = tl.where((o_i[None, :] >= o_j[:, None]) & m_i[None, :], b_w, 0.0)
        b_dy = tl.load(p_dy + tok_i[:, None] * (stride_dy_l * VX) + o_p[None, :],
                       mask=m_i[:, None] & m_p[None, :], other=0.0)
        b_acc = mm(b_w.to(b_dy.dtype), b_dy, b_acc, UPCAST, IEEE)   # [BQ, BQ] @ [BQ, BP]

    m_tok = m_j[:, None] & m_p[None, :]
    b_x = tl.load(p_x + tok_j[:, None] * (stride_x_l * VX) + o_p[None, :], mask=m_tok,
                  other=0.0).to(tl.float32)
    b_dt = tl.load(dts_ptr + p_seg + o_j)
    b_dx = b_acc * b_dt[:, None]
    if HAS_D:
        b_dyj = tl.load(p_dy + tok_j[:, None] * (stride_dy_l * VX) + o_p[None, :], mask=m_tok,
                        other=0.0).to(tl.float32)
        if D_PER_CHANNEL:
            b_dx += tl.load(D_ptr + i_h * P + o_p, mask=m_p, other=0.0)[None, :] * b_dyj
        else:
            b_dx += tl.load(D_ptr + i_h) * b_dyj
    p_dx = (dx_ptr + row * (stride_dx_b * VX) + i_h * (stride_dx_h * VX)
            + tok_j[:, None] * (stride_dx_l * VX) + o_p[None, :])
    tl.store(p_dx, b_dx.to(dx_ptr.dtype.element_ty), mask=m_tok)
    tl.store(ddt_part_ptr + (i_sh.to(tl.int64) * NPB + i_p) * Q + o_j, tl.sum(b_acc * b_x, axis=1))
    if HAS_D:
        tl.store(dD_part_ptr + (i_sh.to(tl.int64) * NQB + i_m) * P + o_p,
                 tl.sum(b_dyj * b_x, axis=0), mask=m_p)


@triton.jit
def straddling_pieces(p_part, b_w, b_cb, diagonal, BQ: tl.constexpr):
    """One head's pieces of a block pair (I, J <= I) of the straddling sums of the log-decay
    gradient, from its weights b_w (T_ij = b_w ⊙ C·B, b_cb zero outside the pair's kept
    entries): with the column sums cs_j = sum_i T_ij, row sums rs_i = sum_j T_ij and total t,
    p_part[0:BQ] = sum_{j<k} cs_j (less sum_{i<k} rs_i on the diagonal, I = J: the pairs
    j < k <= i inside one block), p_part[BQ:2BQ] = sum_{i>=k} rs_i (k in block I > J),
    p_part[2BQ] = t (k in the blocks between J and I; the last two unused on the diagonal)."""
    b_t = b_w * b_cb
    b_cs = tl.sum(b_t, axis=0)
    b_rs = tl.sum(b_t, axis=1)
    b_total = tl.sum(b_cs, axis=0)
    b_rs_before = tl.cumsum(b_rs, axis=0) - b_rs                          # sum_{i<k} rs_i
    o_r = tl.arange(0, BQ)
    tl.store(p_part + o_r, tl.cumsum(b_cs, axis=0) - b_cs - diagonal * b_rs_before)
    tl.store(p_part + BQ + o_r, tl.cumsum(b_rs, axis=0, reverse=True))    # sum_{i>=k} rs_i
    tl.store(p_part + 2 * BQ, b_total)


@triton.jit
def dbc_rows(x_ptr, dy_ptr, B_ptr, C_ptr, dts_ptr, acum_ptr, states_ptr, dstates_ptr, runs_ptr,
             cb_ptr, intra_ptr, out_ptr, uw_part_ptr, v_ptr, stride_x_b, stride_x_l, stride_x_h,
             stride_dy_b, stride_dy_l, stride_dy_h, stride_B_b, stride_B_l, stride_B_g,
             stride_C_b, stride_C_l, stride_C_g, stride_out_b, stride_out_l, stride_out_g,
             row, start, end, L, i_seg, i_g, i_m, i_n, H: tl.constexpr, G: tl.constexpr,
             P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr,
             BP: tl.constexpr, BN: tl.constexpr, GRAD_B: tl.constexpr, STORE_CB: tl.constexpr,
             UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SEQ: tl.constexpr, VX: tl.constexpr,
             VB: tl.constexpr):
    """dB (GRAD_B: the rows r are columns j) or dC (rows r are i) of row block i_m and state
    tile i_n of one (segment, group), forming each d(C·B) tile it needs from the heads' dy and x
    rows; per head the W' (dB) or U (dC) partial over the state tile. dC's first state tile
    also forms C·B, for the straddling pieces of every pair (i_m, k <= i_m) and (STORE_CB)
    stored for dx, and dC's first row block per head v = exp(Acum_last) <dH1, H0> over the
    state tile (zero when the segment does not carry: sequence ids)."""
    NQB: tl.constexpr = Q // BQ
    NNB: tl.constexpr = (N + BN - 1) // BN
    R: tl.constexpr = H // G
    PAIRS: tl.constexpr = NQB * (NQB + 1) // 2
    seg_len = end - start
    i_sg = i_seg * G + i_g
    o_r = i_m * BQ + tl.arange(0, BQ)
    o_n = i_n * BN + tl.arange(0, BN)
    m_r, m_n = start + o_r < end, o_n < N
    tok_r = (start + o_r).to(tl.int64)
    m_rn = m_r[:, None] & m_n[None, :]
    p_B = B_ptr + row * (stride_B_b * VB) + i_g * (stride_B_g * VB)
    p_C = C_ptr + row * (stride_C_b * VB) + i_g * (stride_C_g * VB)
    if GRAD_B:               # sums over the later blocks i >= j that hold tokens, pairs with C_i
        other_ptr, own_ptr, other_l, own_l = p_C, p_B, stride_C_l, stride_B_l
        k_lo, k_hi = i_m, (seg_len + BQ - 1) // BQ
    else:                    # over the earlier blocks j <= i
        other_ptr, own_ptr, other_l, own_l = p_B, p_C, stride_B_l, stride_C_l
        k_lo, k_hi = 0, i_m + 1
    if HAS_SEQ:
        r_prev, r_last = segment_runs(runs_ptr, row, start, end, L)
        r_r = token_runs(runs_ptr, row, start, o_r, m_r, L)
        if GRAD_B:
            m_state = r_r == r_last
        else:
            m_state = r_r == r_prev

    b_acc = tl.zeros([BQ, BN], dtype=tl.float32)
    for i_k in range(k_lo, k_hi):
        o_k = i_k * BQ + tl.arange(0, BQ)
        m_k = start + o_k < end
        tok_k = (start + o_k).to(tl.int64)
        if GRAD_B:
            keep = (o_k[None, :] >= o_r[:, None]) & m_r[:, None] & m_k[None, :]
        else:
            keep = (o_k[None, :] <= o_r[:, None]) & m_r[:, None] & m_k[None, :]
        if HAS_SEQ:
            keep &= r_r[:, None] == token_runs(runs_ptr, row, start, o_k, m_k, L)[None, :]
        b_cb = tl.zeros([BQ, BQ], dtype=tl.float32)
        if not GRAD_B:
            if i_n == 0:
                b_cb = cb_tile(C_ptr, B_ptr, runs_ptr, row, start, i_g, o_r, o_k, m_r, m_k,
                               stride_C_b, stride_C_l, stride_C_g, stride_B_b, stride_B_l,
                               stride_B_g, L, N, BQ, BN, UPCAST, IEEE, HAS_SEQ, VB)
                if STORE_CB:
                    tl.store(cb_ptr + i_sg.to(tl.int64) * (Q * Q) + o_r[:, None] * Q
                             + o_k[None, :], b_cb, mask=o_k[None, :] <= o_r[:, None])
                b_cb = tl.where(keep, b_cb, 0.0)
        diagonal = tl.where(i_k == i_m, 1.0, 0.0)
        b_dcb = tl.zeros([BQ, BQ], dtype=tl.float32)
        for r in range(R):
            i_h = i_g * R + r
            p_seg = (i_seg * H + i_h).to(tl.int64) * Q
            p_x = x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX)
            p_dy = dy_ptr + row * (stride_dy_b * VX) + i_h * (stride_dy_h * VX)
            b_acum_r = tl.load(acum_ptr + p_seg + o_r)
            b_acum_k = tl.load(acum_ptr + p_seg + o_k)
            if GRAD_B:       # [r = j, k = i]: exp(Acum_i - Acum_j) dt_j (x_j·dy_i)
                b_w = rows_product(p_x, p_dy, stride_x_l, stride_dy_l, tok_r, tok_k, m_r, m_k,
                                   P, BQ, BP, UPCAST, IEEE, VX)
                b_w *= (tl.exp(tl.minimum(b_acum_k[None, :] - b_acum_r[:, None], 0.0))
                        * tl.load(dts_ptr + p_seg + o_r)[:, None])
            else:            # [r = i, k = j]: exp(Acum_i - Acum_j) dt_j (dy_i·x_j)
                b_w = rows_product(p_dy, p_x, stride_dy_l, stride_x_l, tok_r, tok_k, m_r, m_k,
                                   P, BQ, BP, UPCAST, IEEE, VX)
                b_w *= (tl.exp(tl.minimum(b_acum_r[:, None] - b_acum_k[None, :], 0.0))
                        * tl.load(dts_ptr + p_seg + o_k)[None, :])
                if i_n == 0:
                    straddling_pieces(intra_ptr + ((i_seg * H + i_h).to(tl.int64) * PAIRS
                                                   + i_m * (i_m + 1) // 2 + i_k) * (2 * BQ + 1),
                                      b_w, b_cb, diagonal, BQ)
            b_dcb += b_w
        b_dcb = tl.where(keep, b_dcb, 0.0)
        b_other = tl.load(other_ptr + tok_k[:, None] * (other_l * VB) + o_n[None, :],
                          mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_acc = mm(b_dcb.to(b_other.dtype), b_other, b_acc, UPCAST, IEEE)  # [BQ, BQ] @ [BQ, BN]

    b_own = tl.load(own_ptr + tok_r[:, None] * (own_l * VB) + o_n[None, :], mask=m_rn, other=0.0)
    for r in range(R):
        i_h = i_g * R + r
        i_sh = i_seg.to(tl.int64) * H + i_h
        p_seg = i_sh * Q
        b_acum = tl.load(acum_ptr + p_seg + o_r)
        if GRAD_B:
            acum_last = tl.load(acum_ptr + p_seg + Q - 1)
            b_scale = tl.exp(tl.minimum(acum_last - b_acum, 0.0)) * tl.load(dts_ptr + p_seg + o_r)
            p_rows = (x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX)
                      + tok_r[:, None] * (stride_x_l * VX))
        else:
            b_scale = tl.exp(tl.minimum(b_acum, 0.0))
            p_rows = (dy_ptr + row * (stride_dy_b * VX) + i_h * (stride_dy_h * VX)
                      + tok_r[:, None] * (stride_dy_l * VX))
        if HAS_SEQ:
            b_scale = tl.where(m_state, b_scale, 0.0)
        b_head = tl.zeros([BQ, BN], dtype=tl.float32)
        for p0 in range(0, P, BP):
            o_p = p0 + tl.arange(0, BP)
            m_p = o_p < P
            p_pn = i_sh * (P * N) + o_p[:, None] * N + o_n[None, :]
            m_pn = m_p[:, None] & m_n[None, :]
            b_rows = tl.load(p_rows + o_p[None, :], mask=m_r[:, None] & m_p[None, :], other=0.0)
            if GRAD_B:
                b_state = tl.load(dstates_ptr + p_pn, mask=m_pn, other=0.0)
            else:
                b_state = tl.load(states_ptr + p_pn, mask=m_pn, other=0.0)
            b_head = mm((b_rows * b_scale[:, None]).to(b_rows.dtype), b_state.to(b_rows.dtype),
                        b_head, UPCAST, IEEE)                               # [BQ, BP] @ [BP, BN]
        b_acc += b_head
        tl.store(uw_part_ptr + (i_sh * NNB + i_n) * Q + o_r,
                 tl.sum(b_head * b_own.to(tl.float32), axis=1))
    p_out = (out_ptr + row * (stride_out_b * VB) + i_g * (stride_out_g * VB)
             + tok_r[:, None] * (stride_out_l * VB) + o_n[None, :])
    tl.store(p_out, b_acc.to(out_ptr.dtype.element_ty), mask=m_rn)
    if not GRAD_B:
        if i_m == 0:         # its own loop: inside the one above it spills on sm_80
            carries = 1.0
            if HAS_SEQ:
                carries = tl.where(r_prev == r_last, 1.0, 0.0)
            for r in range(R):
                i_sh = i_seg.to(tl.int64) * H + i_g * R + r
                b_v = 0.0
                for p0 in range(0, P, BP):
                    o_p = p0 + tl.arange(0, BP)
                    p_pn = i_sh * (P * N) + o_p[:, None] * N + o_n[None, :]
                    m_pn = (o_p < P)[:, None] & m_n[None, :]
                    b_h0 = tl.load(states_ptr + p_pn, mask=m_pn, other=0.0).to(tl.float32)
                    b_dh1 = tl.load(dstates_ptr + p_pn, mask=m_pn, other=0.0).to(tl.float32)
                    b_v += tl.sum(tl.sum(b_dh1 * b_h0, axis=1), axis=0)
                acum_last = tl.load(acum_ptr + i_sh * Q + Q - 1)
                tl.store(v_ptr + i_sh * NNB + i_n,
                         carries * tl.exp(tl.minimum(acum_last, 0.0)) * b_v)


@triton.jit
def ssd_dbc_kernel(x_ptr, dy_ptr, B_ptr, C_ptr, dts_ptr, acum_ptr, states_ptr, dstates_ptr,
                   cu_ptr, off_ptr, runs_ptr, cb_ptr, intra_ptr, dB_ptr, dC_ptr, w_part_ptr,
                   u_part_ptr, v_ptr, D_ptr, dx_ptr, ddt_part_ptr, dD_part_ptr, stride_x_b,
                   stride_x_l, stride_x_h, stride_dy_b, stride_dy_l, stride_dy_h, stride_B_b,
                   stride_B_l, stride_B_g, stride_C_b, stride_C_l, stride_C_g, stride_dB_b,
                   stride_dB_l, stride_dB_g, stride_dC_b, stride_dC_l, stride_dC_g, stride_dx_b,
                   stride_dx_l, stride_dx_h, L, NSEQ, H: tl.constexpr, G: tl.constexpr,
                   P: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr,
                   BP: tl.constexpr, BN: tl.constexpr, DX_BN: tl.constexpr, WITH_DX: tl.constexpr,
                   HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr, VARLEN: tl.constexpr,
                   SEARCH_STEPS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                   HAS_SEQ: tl.constexpr, VX: tl.constexpr, VB: tl.constexpr):
    """dB and dC of one (segment, group), summed over its heads, with the d(C·B) tiles they need
    formed here, never stored:

    dcb[i, j] = sum_h exp(Acum_i - Acum_j) dt_j (dy_i·x_j)    (j <= i; zero across runs)
    dB_j = sum_{i>=j} dcb[i, j] C_i + sum_h exp(Acum_last - Acum_j) dt_j x_j @ dH1
    dC_i = sum_{j<=i} dcb[i, j] B_j + sum_h exp(Acum_i) dy_i @ H0

    (sequence ids: the state terms only for the last token's run, dB, or the run before the
    segment, dC), per head the W' (dB) and U (dC) partial sums over the state tile and
    v = exp(Acum_last) <dH1, H0> over it (dC's first row block; zero when the segment does not
    carry), per head the block pairs' pieces of the straddling sums of the log-decay gradient,
    intra(k) = sum_{i>=k} sum_{j<k} T_ij with T_ij = (C·B)_ij dcb-weight_ij
    (``straddling_pieces``), summed by ``ssd_dt_bwd_kernel`` in pair order, and either the
    backward's C·B tiles (as ``ssd_cb_kernel`` computes them, stored for the dx kernel) or, with
    WITH_DX, dx itself (``dx_rows``, from the C·B the prologue's ``ssd_cb_kernel`` stored; its
    state loop DX_BN wide). Each d(C·B) tile is formed twice, by the dB program of its column
    block and the dC program of its row block (2·BQ²·p FLOPs per head and pair each), so that
    no program waits on another. Per (segment·group), in launch order: a dB and a dC program per
    (row block, state tile), dB/dC fastest, then with WITH_DX a program per (head-dim tile, row
    block) looping the group's heads for dx: the programs of a (segment, group) run side by side
    and share its heads' dy and x rows, H0, dH1 and B rows in L2. dB/dC programs past the
    segment's end return (``ssd_dt_bwd_kernel`` reads no pieces of their pairs); dx programs
    write their zero partials as the dx kernel's do."""
    NQB: tl.constexpr = Q // BQ
    NNB: tl.constexpr = (N + BN - 1) // BN
    NPB: tl.constexpr = (P + BP - 1) // BP
    NBC: tl.constexpr = 2 * NQB * NNB
    PER: tl.constexpr = NBC + NQB * NPB * WITH_DX
    STORE_CB: tl.constexpr = not WITH_DX
    R: tl.constexpr = H // G
    pid = tl.program_id(0)
    local, i_sg = pid % PER, pid // PER
    i_seg, i_g = i_sg // G, i_sg % G
    row, start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    if WITH_DX:
        if local >= NBC:
            i_p, i_j = (local - NBC) % NPB, (local - NBC) // NPB
            for r in range(R):
                dx_rows(x_ptr, dy_ptr, B_ptr, cb_ptr, dts_ptr, acum_ptr, dstates_ptr, D_ptr,
                        runs_ptr, dx_ptr, ddt_part_ptr, dD_part_ptr, stride_x_b, stride_x_l,
                        stride_x_h, stride_dy_b, stride_dy_l, stride_dy_h, stride_B_b,
                        stride_B_l, stride_B_g, stride_dx_b, stride_dx_l, stride_dx_h, row,
                        start, end, L, i_seg, i_g * R + r, i_j, i_p, H, G, P, N, Q, BQ, BP,
                        DX_BN, HAS_D, D_PER_CHANNEL, UPCAST, IEEE, HAS_SEQ, VX, VB)
    i_m, i_n = local // 2 % NQB, local // (2 * NQB)
    if (local < NBC) & (i_m * BQ < end - start):
        if local % 2 == 0:
            dbc_rows(x_ptr, dy_ptr, B_ptr, C_ptr, dts_ptr, acum_ptr, states_ptr, dstates_ptr,
                     runs_ptr, cb_ptr, intra_ptr, dB_ptr, w_part_ptr, v_ptr, stride_x_b,
                     stride_x_l, stride_x_h, stride_dy_b, stride_dy_l, stride_dy_h,
                     stride_B_b, stride_B_l, stride_B_g, stride_C_b, stride_C_l, stride_C_g,
                     stride_dB_b, stride_dB_l, stride_dB_g, row, start, end, L, i_seg, i_g,
                     i_m, i_n, H, G, P, N, Q, BQ, BP, BN, True, STORE_CB, UPCAST, IEEE,
                     HAS_SEQ, VX, VB)
        else:
            dbc_rows(x_ptr, dy_ptr, B_ptr, C_ptr, dts_ptr, acum_ptr, states_ptr, dstates_ptr,
                     runs_ptr, cb_ptr, intra_ptr, dC_ptr, u_part_ptr, v_ptr, stride_x_b,
                     stride_x_l, stride_x_h, stride_dy_b, stride_dy_l, stride_dy_h,
                     stride_B_b, stride_B_l, stride_B_g, stride_C_b, stride_C_l, stride_C_g,
                     stride_dC_b, stride_dC_l, stride_dC_g, row, start, end, L, i_seg, i_g,
                     i_m, i_n, H, G, P, N, Q, BQ, BP, BN, False, STORE_CB, UPCAST, IEEE,
                     HAS_SEQ, VX, VB)


@triton.jit
def ssd_dt_bwd_kernel(dt_ptr, A_ptr, bias_ptr, dts_ptr, acum_ptr, intra_ptr, ddt_part_ptr,
                      u_part_ptr, w_part_ptr, v_ptr, cu_ptr, off_ptr, ddt_ptr, dA_part_ptr,
                      dbias_part_ptr,
                      stride_dt_b, stride_dt_l, stride_ddt_b, stride_ddt_l, L, NSEQ,
                      dt_min, dt_max,
                      H: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr, NPB: tl.constexpr,
                      NNB: tl.constexpr, NNB_POW2: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, VARLEN: tl.constexpr,
                      SEARCH_STEPS: tl.constexpr, SOFTPLUS_THRESHOLD: tl.constexpr,
                      VDT: tl.constexpr):
    """Gathers da_k (the gradient of a_k = dt_k A), then ddt (through the clamp and softplus),
    and the segment's partial sums of dA and ddt_bias, for one (segment, head)."""
    i_sh = tl.program_id(0)
    i_seg, i_h = i_sh // H, i_sh % H
    NQB: tl.constexpr = Q // BQ
    row, start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    o_k = tl.arange(0, Q)
    m_k = start + o_k < end
    p_sh = i_sh.to(tl.int64)
    PAIRS: tl.constexpr = NQB * (NQB + 1) // 2
    blk, pos = o_k // BQ, o_k % BQ
    b_intra = tl.zeros([Q], dtype=tl.float32)
    # the dB/dC kernel's pieces in pair order, of the pairs whose row block holds tokens (it
    # writes no others; compared per lane: the interpreter gives a scalar comparison's mask an
    # int32 dtype)
    for i_m in tl.static_range(NQB):
        held = o_k * 0 + i_m * BQ < end - start
        for i_n in tl.static_range(i_m + 1):
            p_part = intra_ptr + (p_sh * PAIRS + i_m * (i_m + 1) // 2 + i_n) * (2 * BQ + 1)
            b_intra += tl.load(p_part + pos, mask=(blk == i_n) & held, other=0.0)
            if i_m > i_n:
                b_intra += tl.load(p_part + BQ + pos, mask=(blk == i_m) & held, other=0.0)
                b_intra += tl.load(p_part + 2 * BQ + pos * 0,
                                   mask=(blk > i_n) & (blk < i_m) & held, other=0.0)
    b_direct = tl.zeros([Q], dtype=tl.float32)
    for i_p in range(NPB):
        b_direct += tl.load(ddt_part_ptr + (p_sh * NPB + i_p) * Q + o_k)
    b_u = tl.zeros([Q], dtype=tl.float32)
    b_w = tl.zeros([Q], dtype=tl.float32)
    for i_n in range(NNB):   # the dB/dC kernel writes no rows of the blocks past the end
        b_u += tl.load(u_part_ptr + (p_sh * NNB + i_n) * Q + o_k, mask=m_k, other=0.0)
        b_w += tl.load(w_part_ptr + (p_sh * NNB + i_n) * Q + o_k, mask=m_k, other=0.0)
    o_t = tl.arange(0, NNB_POW2)
    v = tl.sum(tl.load(v_ptr + p_sh * NNB + o_t, mask=(o_t < NNB) & (o_t * 0 < end - start),
                       other=0.0), axis=0)    # nor of an empty segment
    suffix_u = tl.cumsum(b_u, axis=0, reverse=True)                             # sum_{i>=k} U_i
    prefix_w = tl.cumsum(b_w, axis=0) - b_w                                      # sum_{j<k} W'_j
    b_da = tl.where(m_k, b_intra + suffix_u + v + prefix_w, 0.0)
    b_dts = tl.load(dts_ptr + p_sh * Q + o_k)
    A = tl.load(A_ptr + i_h)
    b_ddt = tl.where(m_k, b_direct + A * b_da, 0.0)
    tl.store(dA_part_ptr + p_sh, tl.sum(b_dts * b_da, axis=0))

    # through the dt transform: clamp (passes at the bounds) and softplus (u above the threshold)
    tok = (start + o_k).to(tl.int64)
    p_dt = dt_ptr + row * (stride_dt_b * VDT) + tok * (stride_dt_l * VDT) + i_h
    b_u_in = tl.load(p_dt, mask=m_k, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_u_in += tl.load(bias_ptr + i_h)
    if SOFTPLUS:
        b_val = softplus(b_u_in, SOFTPLUS_THRESHOLD)
        b_ddt *= tl.where(b_u_in > SOFTPLUS_THRESHOLD, 1.0, tl.sigmoid(b_u_in))
    else:
        b_val = b_u_in
    b_ddt = tl.where((b_val >= dt_min) & (b_val <= dt_max) & m_k, b_ddt, 0.0)
    p_ddt = ddt_ptr + row * (stride_ddt_b * VDT) + tok * (stride_ddt_l * VDT) + i_h
    tl.store(p_ddt, b_ddt.to(ddt_ptr.dtype.element_ty), mask=m_k)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + p_sh, tl.sum(b_ddt, axis=0))


@triton.jit
def ssd_param_reduce_kernel(dA_part_ptr, dbias_part_ptr, dD_part_ptr, dA_ptr, dbias_ptr, dD_ptr,
                            NUM_SEGMENTS, H: tl.constexpr, P: tl.constexpr, NQB: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr,
                            HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                            ACCUMULATE: tl.constexpr):
    """dA, ddt_bias, dD: fixed-order sums of the per-segment partials (+= when accumulating)."""
    i_h = tl.program_id(0)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    b_da = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_db = tl.zeros([BLOCK_H], dtype=tl.float32)
    for seg in range(0, NUM_SEGMENTS):
        b_da += tl.load(dA_part_ptr + seg * H + o_h, mask=m_h, other=0.0)
        if HAS_BIAS:
            b_db += tl.load(dbias_part_ptr + seg * H + o_h, mask=m_h, other=0.0)
    if ACCUMULATE:
        b_da += tl.load(dA_ptr + o_h, mask=m_h, other=0.0)
    tl.store(dA_ptr + o_h, b_da, mask=m_h)
    if HAS_BIAS:
        if ACCUMULATE:
            b_db += tl.load(dbias_ptr + o_h, mask=m_h, other=0.0)
        tl.store(dbias_ptr + o_h, b_db, mask=m_h)
    if HAS_D:
        o_p = tl.arange(0, BLOCK_P)
        m_hp = m_h[:, None] & (o_p < P)[None, :]
        b_dd = tl.zeros([BLOCK_H, BLOCK_P], dtype=tl.float32)
        for k in range(0, NUM_SEGMENTS * NQB):
            seg = k // NQB
            i_m = k - seg * NQB
            b_dd += tl.load(dD_part_ptr + ((seg * H + o_h[:, None]) * NQB + i_m) * P + o_p[None, :],
                            mask=m_hp, other=0.0)
        if D_PER_CHANNEL:
            p_dd = dD_ptr + o_h[:, None] * P + o_p[None, :]
            if ACCUMULATE:
                b_dd += tl.load(p_dd, mask=m_hp, other=0.0)
            tl.store(p_dd, b_dd, mask=m_hp)
        else:
            b_ddh = tl.sum(b_dd, axis=1)
            if ACCUMULATE:
                b_ddh += tl.load(dD_ptr + o_h, mask=m_h, other=0.0)
            tl.store(dD_ptr + o_h, b_ddh, mask=m_h)
