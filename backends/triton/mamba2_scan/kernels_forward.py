"""Mamba2 chunked scan: Triton forward kernels (the segment formulation of
backends/torch/mamba2_scan/program.py). Workspace tensors, all fp32, indexed by segment σ:

    dts   [S, H, Q]   transformed dt (0 outside the segment)
    acum  [S, H, Q]   inclusive cumsum of dt·A inside the segment
    cb    [S, G, Q, Q] C_i·B_j (tiles with j-block <= i-block only)

and the state entering every segment, states [S, H, P, N] in the plan's state dtype (x's dtype
by default, or fp32), written by the one kernel that walks each sequence's segments.

A segment lies in one batch row (``segment_bounds``: its row and [start, end) positions there);
the activations are addressed through their strides, row·stride_b + position·stride_l +
head·stride_h + column, 64-bit where the product can grow, the strides taken in units of the
group's constexpr (VX for x, z, y, dy, dx, dz; VB for B, C, dB, dC; VDT for dt, ddt: a 16-byte
vector when the rows are whole vectors, so the compiler keeps vector loads; else 1). With
packed sequences the first kernel sanitises cu_seqlens into the workspace (c'[i] = clamp(c[i],
c'[i-1], total), c'[0] = clamp(c[0], 0, total); Status.CU_SEQLENS when c[0] != 0 or c' != c) and
every later kernel reads that copy, so whatever cu_seqlens holds no segment leaves the packed
tokens and no sequence has more segments than the workspace holds.

With sequence ids (HAS_SEQ) a first kernel numbers the runs of equal ids along every row into
the workspace (``runs``, the torch backend's ``sequence_runs``) and the kernels mask by them:
pairs (i, j) of one run, the entering state for the tokens of the run before the segment
(r_prev), a token's part of the end state for the last token's run (r_last), and the state
passing carries only when r_last = r_prev.
"""

import triton
import triton.language as tl

from fusedops.core.status import Status

from ..ssm_math import softplus
from ..primitives import last_at_most, mm, report_if

CU_SEQLENS_BIT: tl.constexpr = tl.constexpr(int(Status.CU_SEQLENS))
SEQ_IDX_BIT: tl.constexpr = tl.constexpr(int(Status.SEQ_IDX))


@triton.jit
def segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q: tl.constexpr, VARLEN: tl.constexpr,
                   SEARCH_STEPS: tl.constexpr):
    """(row, start, end): segment i_seg's batch row (int64) and its [start, end) positions in
    that row (start == end for unused trailing segments; packed sequences are row 0)."""
    if VARLEN:
        lo = last_at_most(off_ptr, i_seg, NSEQ, SEARCH_STEPS)     # the segment's sequence
        used = i_seg < tl.load(off_ptr + NSEQ)
        start = tl.load(cu_ptr + lo) + (i_seg - tl.load(off_ptr + lo)) * Q
        end = tl.minimum(tl.load(cu_ptr + lo + 1), start + Q)
        start = tl.where(used, start, 0)
        end = tl.where(used, end, 0)
        row = i_seg * 0
    else:
        nc = tl.cdiv(L, Q)
        row = i_seg // nc
        c = i_seg - row * nc
        start = c * Q
        end = tl.minimum(L, c * Q + Q)
    return row.to(tl.int64), start, end


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
def sequence_span(i_s, cu_ptr, off_ptr, L, Q: tl.constexpr, VARLEN: tl.constexpr):
    """(first, last, row, seq_start, seq_end) of sequence i_s for a walk along its segments:
    its [first, last) segments (first as int64), its batch row (int64; packed sequences: row 0)
    and its [seq_start, seq_end) positions in that row."""
    first, last = sequence_segments(i_s, off_ptr, L, Q, VARLEN)
    if VARLEN:
        row = (i_s * 0).to(tl.int64)
        seq_start, seq_end = tl.load(cu_ptr + i_s), tl.load(cu_ptr + i_s + 1)
    else:
        row = i_s.to(tl.int64)
        seq_start, seq_end = i_s * 0, L
    return first.to(tl.int64), last, row, seq_start, seq_end


@triton.jit
def walk_tile(i_p, i_n, i_sh, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
              BN: tl.constexpr):
    """The [BP, BN] state tile a walk along sequence·head i_sh holds (head-dim tile i_p, state
    tile i_n): (o_p, o_n, m_p, m_n) its rows, columns and their masks, m_pn its mask, o_pn its
    offsets in one [P, N] state, p_seq those in the per-sequence states (initial, final)."""
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = i_n * BN + tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    o_pn = o_p[:, None] * N + o_n[None, :]
    return (o_p, o_n, m_p, m_n, m_p[:, None] & m_n[None, :], o_pn,
            i_sh.to(tl.int64) * (P * N) + o_pn)


@triton.jit
def state_tile(ptr, offsets, mask, BP: tl.constexpr, BN: tl.constexpr, PRESENT: tl.constexpr):
    """The fp32 [BP, BN] state tile at ``offsets`` of ``ptr``, or zeros when absent."""
    if PRESENT:
        return tl.load(ptr + offsets, mask=mask, other=0.0)
    else:
        return tl.zeros([BP, BN], dtype=tl.float32)


@triton.jit
def segment_runs(runs_ptr, row, start, end, L):
    """Sequence ids: (r_prev, r_last), the run of the token before the segment (0 at a row's
    start) and the run of its last token."""
    base = runs_ptr + row * L
    r_prev = tl.load(base + start - 1, mask=start > 0, other=0)
    r_last = tl.load(base + end - 1, mask=end > start, other=0)
    return r_prev, r_last


@triton.jit
def token_runs(runs_ptr, row, start, o, m, L):
    """Sequence ids: the runs of the tokens start + o (-1 where not m)."""
    return tl.load(runs_ptr + row * L + start + o, mask=m, other=-1)


@triton.jit
def ssd_seq_runs_kernel(seq_idx_ptr, runs_ptr, status_ptr, L, BLOCK: tl.constexpr,
                        HAS_STATUS: tl.constexpr):
    """One program per row: runs[r, t] = [seq_idx[r, 0] != 0] + the number of 0 < u <= t with
    seq_idx[r, u] != seq_idx[r, u - 1] (run 0: a leading run of id 0, which the initial state
    enters); SEQ_IDX reported for a negative id or one smaller than the id before it."""
    base = tl.program_id(0).to(tl.int64) * L
    carry = (tl.load(seq_idx_ptr + base) != 0).to(tl.int32)
    bad = carry * 0
    for t0 in range(0, L, BLOCK):
        o = t0 + tl.arange(0, BLOCK)
        m = o < L
        ids = tl.load(seq_idx_ptr + base + o, mask=m, other=0)
        prev = tl.load(seq_idx_ptr + base + o - 1, mask=m & (o > 0), other=0)
        change = (m & (o > 0) & (ids != prev)).to(tl.int32)
        tl.store(runs_ptr + base + o, carry + tl.cumsum(change, axis=0), mask=m)
        bad = bad | tl.max((m & ((ids < 0) | ((o > 0) & (ids < prev)))).to(tl.int32), axis=0)
        carry += tl.sum(change, axis=0)
    report_if(status_ptr, bad != 0, SEQ_IDX_BIT, HAS_STATUS)


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
def _zero_rows(ptr, stride_l, stride_h, o_t, m_t, NH: tl.constexpr, W: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):
    """ptr[t, j, :W] = 0 for j < NH and the BT tokens o_t where m_t (a token's NH rows of W
    elements, strides in units of V elements)."""
    if W > 0:
        for j in range(NH):
            for w0 in range(0, W, BW):
                o_w = w0 + tl.arange(0, BW)
                p = o_t.to(tl.int64)[:, None] * (stride_l * V) + j * (stride_h * V) + o_w[None, :]
                tl.store(ptr + p, tl.zeros([BT, BW], dtype=ptr.dtype.element_ty),
                         mask=m_t[:, None] & (o_w < W)[None, :])


@triton.jit
def ssd_zero_uncovered_kernel(cu_ptr, out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr,
                              stride_0l, stride_0h, stride_1l, stride_1h, stride_2l, stride_2h,
                              stride_3l, stride_3h, stride_4l, stride_4h, L, NSEQ,
                              NH0: tl.constexpr, W0: tl.constexpr, V0: tl.constexpr,
                              NH1: tl.constexpr, W1: tl.constexpr, V1: tl.constexpr,
                              NH2: tl.constexpr, W2: tl.constexpr, V2: tl.constexpr,
                              NH3: tl.constexpr, W3: tl.constexpr, V3: tl.constexpr,
                              NH4: tl.constexpr, W4: tl.constexpr, V4: tl.constexpr,
                              BT: tl.constexpr, BW: tl.constexpr):
    """Packed sequences (one batch row): zeroes up to five per-token outputs (each token NH_i
    rows of W_i elements, strides in units of V_i; W_i = 0: absent) at the tokens no sequence
    covers, [0, c'[0]) and [c'[nseq], L) of the sanitised offsets. A block of covered tokens
    (every one, for valid offsets) returns at once."""
    t0 = tl.program_id(0) * BT
    lo = tl.load(cu_ptr)
    hi = tl.load(cu_ptr + NSEQ)
    if (t0 >= lo) & (t0 + BT <= hi):
        return
    o_t = t0 + tl.arange(0, BT)
    m_t = (o_t < L) & ((o_t < lo) | (o_t >= hi))
    _zero_rows(out0_ptr, stride_0l, stride_0h, o_t, m_t, NH0, W0, V0, BT, BW)
    _zero_rows(out1_ptr, stride_1l, stride_1h, o_t, m_t, NH1, W1, V1, BT, BW)
    _zero_rows(out2_ptr, stride_2l, stride_2h, o_t, m_t, NH2, W2, V2, BT, BW)
    _zero_rows(out3_ptr, stride_3l, stride_3h, o_t, m_t, NH3, W3, V3, BT, BW)
    _zero_rows(out4_ptr, stride_4l, stride_4h, o_t, m_t, NH4, W4, V4, BT, BW)


@triton.jit
def ssd_dt_cumsum_kernel(dt_ptr, A_ptr, bias_ptr, cu_ptr, off_ptr, dts_ptr, acum_ptr,
                         stride_dt_b, stride_dt_l, L, NSEQ, dt_min, dt_max,
                         H: tl.constexpr, Q: tl.constexpr, BLOCK_H: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, VARLEN: tl.constexpr,
                         SEARCH_STEPS: tl.constexpr, SOFTPLUS_THRESHOLD: tl.constexpr,
                         VDT: tl.constexpr):
    i_seg, i_h = tl.program_id(0), tl.program_id(1)
    row, start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    o_q = tl.arange(0, Q)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    tok = start + o_q
    m = (tok < end)[:, None] & m_h[None, :]
    p_dt = dt_ptr + row * (stride_dt_b * VDT) + tok.to(tl.int64)[:, None] * (stride_dt_l * VDT)
    b_dt = tl.load(p_dt + o_h[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_dt += tl.load(bias_ptr + o_h, mask=m_h, other=0.0)[None, :]
    if SOFTPLUS:
        b_dt = softplus(b_dt, SOFTPLUS_THRESHOLD)
    b_dt = tl.minimum(tl.maximum(b_dt, dt_min), dt_max)
    b_dt = tl.where(m, b_dt, 0.0)
    b_A = tl.load(A_ptr + o_h, mask=m_h, other=0.0)
    b_acum = tl.cumsum(b_dt * b_A[None, :], axis=0)
    p = i_seg.to(tl.int64) * (H * Q) + o_h[None, :] * Q + o_q[:, None]
    tl.store(dts_ptr + p, b_dt, mask=m_h[None, :])
    tl.store(acum_ptr + p, b_acum, mask=m_h[None, :])


@triton.jit
def block_pair(t, NT: tl.constexpr):
    """The t-th block pair (i, j <= i) of NT row blocks, row-major over the lower triangle
    (0 <= t < NT(NT + 1)/2): (0, 0), (1, 0), (1, 1), (2, 0), ..."""
    i = t * 0
    for k in tl.static_range(1, NT):
        i += (t >= k * (k + 1) // 2).to(i.dtype)
    return i, t - i * (i + 1) // 2


@triton.jit
def rows_product(p_a, p_b, stride_a_l, stride_b_l, tok_i, tok_j, m_i, m_j, K: tl.constexpr,
                 BQ: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 V: tl.constexpr):
    """The fp32 [BQ, BQ] tile a_i·b_j over the K columns of two per-token operands (C·B over n,
    dy·xᵀ over p), for rows tok_i of a and tok_j of b (m_i, m_j: the tokens that exist; p_a,
    p_b: the row and head or group offsets applied, row strides in units of V), in BK-wide
    steps."""
    b_acc = tl.zeros([BQ, BQ], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_a = tl.load(p_a + tok_i[:, None] * (stride_a_l * V) + o_k[None, :],
                      mask=m_i[:, None] & m_k[None, :], other=0.0)
        b_bt = tl.load(p_b + tok_j[None, :] * (stride_b_l * V) + o_k[:, None],
                       mask=m_k[:, None] & m_j[None, :], other=0.0)
        b_acc = mm(b_a, b_bt, b_acc, UPCAST, IEEE)                  # [BQ, BK] @ [BK, BQ]
    return b_acc


@triton.jit
def cb_tile(C_ptr, B_ptr, runs_ptr, row, start, i_g, o_i, o_j, m_i, m_j, stride_C_b, stride_C_l,
            stride_C_g, stride_B_b, stride_B_l, stride_B_g, L, N: tl.constexpr,
            BQ: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
            HAS_SEQ: tl.constexpr, VB: tl.constexpr):
    """The fp32 [BQ, BQ] tile C_i·B_j of group i_g for a segment's rows o_i and columns o_j
    (m_i, m_j: inside the segment), over n in BN-wide steps; sequence ids: zero across runs."""
    b_acc = rows_product(C_ptr + row * (stride_C_b * VB) + i_g * (stride_C_g * VB),
                         B_ptr + row * (stride_B_b * VB) + i_g * (stride_B_g * VB), stride_C_l,
                         stride_B_l, (start + o_i).to(tl.int64), (start + o_j).to(tl.int64),
                         m_i, m_j, N, BQ, BN, UPCAST, IEEE, VB)
    if HAS_SEQ:              # pairs of one run only
        r_i = token_runs(runs_ptr, row, start, o_i, m_i, L)
        r_j = token_runs(runs_ptr, row, start, o_j, m_j, L)
        b_acc = tl.where(r_i[:, None] == r_j[None, :], b_acc, 0.0)
    return b_acc


@triton.jit
def ssd_cb_kernel(C_ptr, B_ptr, cu_ptr, off_ptr, runs_ptr, cb_ptr, stride_C_b, stride_C_l,
                  stride_C_g, stride_B_b, stride_B_l, stride_B_g, L, NSEQ,
                  G: tl.constexpr, N: tl.constexpr, Q: tl.constexpr, BQ: tl.constexpr,
                  BN: tl.constexpr, VARLEN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SEQ: tl.constexpr,
                  VB: tl.constexpr):
    """C·B tile (i, j <= i) of one segment and group, its entries j <= i (only those are ever
    read: the diagonal tiles' upper halves are not stored). One program per (block pair,
    segment·group), the pair fastest: the pairs of a
    (segment, group) run side by side and share its C rows i and B rows j in L2."""
    NT: tl.constexpr = Q // BQ
    PAIRS: tl.constexpr = NT * (NT + 1) // 2
    pid = tl.program_id(0)
    i_m, i_n = block_pair(pid % PAIRS, NT)
    i_sg = pid // PAIRS
    i_seg, i_g = i_sg // G, i_sg % G
    row, start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    o_i = i_m * BQ + tl.arange(0, BQ)
    o_j = i_n * BQ + tl.arange(0, BQ)
    m_i, m_j = start + o_i < end, start + o_j < end
    b_acc = cb_tile(C_ptr, B_ptr, runs_ptr, row, start, i_g, o_i, o_j, m_i, m_j, stride_C_b,
                    stride_C_l, stride_C_g, stride_B_b, stride_B_l, stride_B_g, L, N, BQ, BN,
                    UPCAST, IEEE, HAS_SEQ, VB)
    p = i_sg.to(tl.int64) * (Q * Q) + o_i[:, None] * Q + o_j[None, :]
    tl.store(cb_ptr + p, b_acc, mask=o_j[None, :] <= o_i[:, None])


@triton.jit
def token_weights(dts_ptr, acum_ptr, runs_ptr, p_seg, row, start, o_k, m_k, L, acum_last, r_keep,
                  FROM_START: tl.constexpr, HAS_SEQ: tl.constexpr):
    """The [BK] fp32 weights of the block's tokens start + o_k in a state walk: w_j =
    exp(Acum_last - Acum_j) dt_j (its own contribution to its end state) or, FROM_START, w_j =
    exp(Acum_j) (what x = dy, B = C send back into its entering state). Sequence ids: only the
    tokens of run r_keep count."""
    b_acum = tl.load(acum_ptr + p_seg + o_k)
    if FROM_START:
        b_w = tl.exp(tl.minimum(b_acum, 0.0))
    else:
        b_w = tl.exp(tl.minimum(acum_last - b_acum, 0.0)) * tl.load(dts_ptr + p_seg + o_k)
    if HAS_SEQ:
        b_w = tl.where(token_runs(runs_ptr, row, start, o_k, m_k, L) == r_keep, b_w, 0.0)
    return b_w


@triton.jit
def accumulate_state(b_acc, p_x, p_b, dts_ptr, acum_ptr, runs_ptr, p_seg, row, start, end, L,
                     acum_last, r_keep, o_p, o_n, m_p, m_n, stride_x_l, stride_B_l,
                     BK: tl.constexpr, FROM_START: tl.constexpr, UPCAST: tl.constexpr,
                     IEEE: tl.constexpr, HAS_SEQ: tl.constexpr, VX: tl.constexpr,
                     VB: tl.constexpr):
    """b_acc [BP, BN] + sum_j w_j x_j ⊗ B_j over the segment's tokens [start, end) (x rows o_p
    at p_x, B columns o_n at p_b; w_j as ``token_weights``). The weights scale x, the register
    operand of each product (rounded to x's dtype there), so B goes to the tensor cores as
    loaded and the products stay asynchronous."""
    for k0 in range(0, end - start, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = start + o_k < end
        tok = (start + o_k).to(tl.int64)
        b_xt = tl.load(p_x + tok[None, :] * (stride_x_l * VX) + o_p[:, None],
                       mask=m_p[:, None] & m_k[None, :], other=0.0)
        b_w = token_weights(dts_ptr, acum_ptr, runs_ptr, p_seg, row, start, o_k, m_k, L,
                            acum_last, r_keep, FROM_START, HAS_SEQ)
        b_b = tl.load(p_b + tok[:, None] * (stride_B_l * VB) + o_n[None, :],
                      mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_a = (b_xt.to(tl.float32) * b_w[None, :]).to(b_xt.dtype)
        b_acc = mm(b_a, b_b, b_acc, UPCAST, IEEE)                   # [BP, BK] @ [BK, BN]
    return b_acc


@triton.jit
def store_entering(states_ptr, entering_ptr, p, b_state, m_pn, HAS_ENTERING: tl.constexpr):
    """Stores the state entering a segment: into states in its dtype, and fp32 into entering."""
    tl.store(states_ptr + p, b_state.to(states_ptr.dtype.element_ty), mask=m_pn)
    if HAS_ENTERING:
        tl.store(entering_ptr + p, b_state, mask=m_pn)


@triton.jit
def advance_state(b_state, p_x, p_b, dts_ptr, acum_ptr, runs_ptr, p_seg, row, start, end, L,
                  o_p, o_n, m_p, m_n, stride_x_l, stride_B_l, Q: tl.constexpr, BK: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SEQ: tl.constexpr,
                  VX: tl.constexpr, VB: tl.constexpr):
    """The state leaving segment [start, end) (its dts and acum at p_seg) from the one entering
    it: H <- exp(Acum_last) H + sum_j exp(Acum_last - Acum_j) dt_j x_j ⊗ B_j (sequence ids: the
    entering state carries only when the segment's last token is in the run before it, and
    only its last run's tokens count)."""
    acum_last = tl.load(acum_ptr + p_seg + Q - 1)
    decay = tl.exp(tl.minimum(acum_last, 0.0))
    r_keep = 0
    if HAS_SEQ:
        r_prev, r_keep = segment_runs(runs_ptr, row, start, end, L)
        decay = tl.where(r_prev == r_keep, decay, 0.0)
    return accumulate_state(b_state * decay, p_x, p_b, dts_ptr, acum_ptr, runs_ptr, p_seg, row,
                            start, end, L, acum_last, r_keep, o_p, o_n, m_p, m_n, stride_x_l,
                            stride_B_l, BK, False, UPCAST, IEEE, HAS_SEQ, VX, VB)


@triton.jit
def ssd_chunk_states_kernel(x_ptr, B_ptr, dts_ptr, acum_ptr, h0_ptr, cu_ptr, off_ptr, runs_ptr,
                            states_ptr, entering_ptr, final_ptr, stride_x_b, stride_x_l,
                            stride_x_h, stride_B_b, stride_B_l, stride_B_g, L,
                            H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                            Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, HAS_H0: tl.constexpr, HAS_ENTERING: tl.constexpr,
                            VARLEN: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                            HAS_SEQ: tl.constexpr, VX: tl.constexpr, VB: tl.constexpr):
    """The states along every sequence, in one pass: a program walks its sequence's segments
    with a [BP, BN] tile of the state in fp32 registers (initial_states or zero), storing it as
    the state entering each segment (states, in the plan's state dtype; entering: the plan's
    segment_states, fp32) before adding the segment's own contribution,
    H <- exp(Acum_last) H + sum_j exp(Acum_last - Acum_j) dt_j x_j ⊗ B_j (sequence ids: the
    entering state carries only when the segment's last token is in the run before it, and
    only its last run's tokens count); the last state is final_states. One program per (state
    tile, head-dim tile, sequence·head), the tiles fastest: the tiles of a (sequence, head)
    share its x rows in L2, the R heads of a group its B rows."""
    NPB: tl.constexpr = (P + BP - 1) // BP
    NNB: tl.constexpr = (N + BN - 1) // BN
    pid = tl.program_id(0)
    i_n, i_p, i_sh = pid % NNB, pid // NNB % NPB, pid // (NNB * NPB)
    i_s, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    first, last, row, seq_start, seq_end = sequence_span(i_s, cu_ptr, off_ptr, L, Q, VARLEN)
    o_p, o_n, m_p, m_n, m_pn, o_pn, p_seq = walk_tile(i_p, i_n, i_sh, P, N, BP, BN)
    b_state = state_tile(h0_ptr, p_seq, m_pn, BP, BN, HAS_H0)
    p_x = x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX)
    p_b = B_ptr + row * (stride_B_b * VB) + i_g * (stride_B_g * VB)
    for k in range(0, last - first):
        seg = first + k
        start = seq_start + k * Q
        end = tl.minimum(seq_end, start + Q)
        store_entering(states_ptr, entering_ptr, (seg * H + i_h) * (P * N) + o_pn, b_state, m_pn,
                       HAS_ENTERING)
        b_state = advance_state(b_state, p_x, p_b, dts_ptr, acum_ptr, runs_ptr,
                                (seg * H + i_h) * Q, row, start, end, L, o_p, o_n, m_p, m_n,
                                stride_x_l, stride_B_l, Q, BK, UPCAST, IEEE, HAS_SEQ, VX, VB)
    tl.store(final_ptr + p_seq, b_state, mask=m_pn)


@triton.jit
def segment_rows_out(b_acc, x_ptr, z_ptr, p_cb, dts_ptr, acum_ptr, D_ptr, y_ptr, ypre_ptr,
                     p_x, p_seg, row, start, end, i_h, i_m, o_i, o_p, m_i, m_p, b_acum_i,
                     stride_x_l, stride_z_b, stride_z_l, stride_z_h, stride_y_b, stride_y_l,
                     stride_y_h, L, H: tl.constexpr, P: tl.constexpr,
                     Q: tl.constexpr, BQ: tl.constexpr, HAS_D: tl.constexpr,
                     D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, UPCAST: tl.constexpr,
                     IEEE: tl.constexpr, VX: tl.constexpr):
    """Row block i_m (rows o_i, m_i: inside the segment) of a segment's output for head i_h and
    head-dim columns o_p, from b_acc [BQ, BP] (the entering state's term): adds the causal
    intra-segment product sum_{j<=i} (C_i·B_j) exp(Acum_i - Acum_j) dt_j x_j (C·B at p_cb, the
    segment's dts and acum at p_seg, x rows at p_x) and D x_i, stores y before the gate
    (contiguous [b, l, h, p], with z) and y = that·silu(z)."""
    tok_i = (start + o_i).to(tl.int64)
    for k0 in range(0, tl.minimum((i_m + 1) * BQ, end - start), BQ):
        o_k = k0 + tl.arange(0, BQ)
        m_k = start + o_k < end
        tok_k = (start + o_k).to(tl.int64)
        b_cb = tl.load(p_cb + o_i[:, None] * Q + o_k[None, :], mask=o_k[None, :] <= o_i[:, None],
                       other=0.0)
        b_acum_k = tl.load(acum_ptr + p_seg + o_k)
        b_dt_k = tl.load(dts_ptr + p_seg + o_k)
        b_w = b_cb * tl.exp(tl.minimum(b_acum_i[:, None] - b_acum_k[None, :], 0.0)) * b_dt_k[None, :]
        b_w = tl.where((o_k[None, :] <= o_i[:, None]) & m_k[None, :], b_w, 0.0)
        b_x = tl.load(p_x + tok_k[:, None] * (stride_x_l * VX) + o_p[None, :],
                      mask=m_k[:, None] & m_p[None, :], other=0.0)
        b_acc = mm(b_w.to(b_x.dtype), b_x, b_acc, UPCAST, IEEE)  # [BQ, BQ] @ [BQ, BP]

    m_out = m_i[:, None] & m_p[None, :]
    if HAS_D:
        b_xi = tl.load(p_x + tok_i[:, None] * (stride_x_l * VX) + o_p[None, :], mask=m_out,
                       other=0.0).to(tl.float32)
        if D_PER_CHANNEL:
            b_acc += tl.load(D_ptr + i_h * P + o_p, mask=m_p, other=0.0)[None, :] * b_xi
        else:
            b_acc += tl.load(D_ptr + i_h) * b_xi
    if HAS_Z:
        p_pre = ((row * L + tok_i[:, None]) * H + i_h) * P + o_p[None, :]
        tl.store(ypre_ptr + p_pre, b_acc.to(ypre_ptr.dtype.element_ty), mask=m_out)
        p_z = (z_ptr + row * (stride_z_b * VX) + i_h * (stride_z_h * VX)
               + tok_i[:, None] * (stride_z_l * VX) + o_p[None, :])
        b_z = tl.load(p_z, mask=m_out, other=0.0).to(tl.float32)
        b_acc *= b_z * tl.sigmoid(b_z)
    p_y = (y_ptr + row * (stride_y_b * VX) + i_h * (stride_y_h * VX)
           + tok_i[:, None] * (stride_y_l * VX) + o_p[None, :])
    tl.store(p_y, b_acc.to(y_ptr.dtype.element_ty), mask=m_out)


@triton.jit
def ssd_chunk_scan_fwd_kernel(x_ptr, z_ptr, C_ptr, cb_ptr, dts_ptr, acum_ptr, states_ptr, D_ptr,
                              cu_ptr, off_ptr, runs_ptr, y_ptr, ypre_ptr,
                              stride_x_b, stride_x_l, stride_x_h, stride_z_b, stride_z_l,
                              stride_z_h, stride_C_b, stride_C_l, stride_C_g, stride_y_b,
                              stride_y_l, stride_y_h, L, NSEQ,
                              H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                              Q: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr,
                              BN: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                              HAS_Z: tl.constexpr, VARLEN: tl.constexpr,
                              SEARCH_STEPS: tl.constexpr, UPCAST: tl.constexpr,
                              IEEE: tl.constexpr, HAS_SEQ: tl.constexpr, VX: tl.constexpr,
                              VB: tl.constexpr):
    """y_i = exp(Acum_i) C_i·H0 + sum_{j<=i} (C_i·B_j) exp(Acum_i - Acum_j) dt_j x_j + D x_i
    (sequence ids: the entering state's term only for the tokens of the run before the
    segment; C·B is already zero across runs). y before the gate is contiguous [b, l, h, p].
    One program per (head-dim tile, row block, segment·head), the tiles fastest: a segment's
    row blocks run together and share its state tile and x rows in L2."""
    NPB: tl.constexpr = (P + BP - 1) // BP
    pid = tl.program_id(0)
    i_p, i_m, i_sh = pid % NPB, pid // NPB % (Q // BQ), pid // (NPB * (Q // BQ))
    i_seg, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    row, start, end = segment_bounds(i_seg, cu_ptr, off_ptr, L, NSEQ, Q, VARLEN, SEARCH_STEPS)
    if i_m * BQ >= end - start:
        return
    o_i = i_m * BQ + tl.arange(0, BQ)
    o_p = i_p * BP + tl.arange(0, BP)
    m_i, m_p = start + o_i < end, o_p < P
    tok_i = (start + o_i).to(tl.int64)
    p_seg = i_sh.to(tl.int64) * Q
    b_acum_i = tl.load(acum_ptr + p_seg + o_i)
    p_x = x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX)

    # the state entering the segment: exp(Acum_i) C_i @ H0^T
    b_acc = tl.zeros([BQ, BP], dtype=tl.float32)
    p_state = states_ptr + i_sh.to(tl.int64) * (P * N)
    p_c = C_ptr + row * (stride_C_b * VB) + i_g * (stride_C_g * VB) + tok_i[:, None] * (stride_C_l * VB)
    for n0 in range(0, N, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < N
        b_c = tl.load(p_c + o_n[None, :], mask=m_i[:, None] & m_n[None, :], other=0.0)
        b_h0t = tl.load(p_state + o_p[None, :] * N + o_n[:, None], mask=m_n[:, None] & m_p[None, :],
                        other=0.0)
        b_acc = mm(b_c, b_h0t.to(b_c.dtype), b_acc, UPCAST, IEEE)  # [BQ, BN] @ [BN, BP]
    b_start = tl.exp(tl.minimum(b_acum_i, 0.0))
    if HAS_SEQ:
        r_prev, r_last = segment_runs(runs_ptr, row, start, end, L)
        b_start = tl.where(token_runs(runs_ptr, row, start, o_i, m_i, L) == r_prev, b_start, 0.0)
    b_acc *= b_start[:, None]

    p_cb = cb_ptr + (i_seg * G + i_g).to(tl.int64) * (Q * Q)
    segment_rows_out(b_acc, x_ptr, z_ptr, p_cb, dts_ptr, acum_ptr, D_ptr, y_ptr, ypre_ptr, p_x,
                     p_seg, row, start, end, i_h, i_m, o_i, o_p, m_i, m_p, b_acum_i, stride_x_l,
                     stride_z_b, stride_z_l, stride_z_h, stride_y_b, stride_y_l, stride_y_h, L,
                     H, P, Q, BQ, HAS_D, D_PER_CHANNEL, HAS_Z, UPCAST, IEEE, VX)


@triton.jit
def ssd_fused_fwd_kernel(x_ptr, z_ptr, B_ptr, C_ptr, cb_ptr, dts_ptr, acum_ptr, h0_ptr, D_ptr,
                         cu_ptr, off_ptr, runs_ptr, states_ptr, entering_ptr, final_ptr, y_ptr,
                         ypre_ptr, stride_x_b, stride_x_l, stride_x_h, stride_z_b, stride_z_l,
                         stride_z_h, stride_B_b, stride_B_l, stride_B_g, stride_C_b, stride_C_l,
                         stride_C_g, stride_y_b, stride_y_l, stride_y_h, L,
                         H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                         Q: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                         HAS_H0: tl.constexpr, HAS_ENTERING: tl.constexpr, HAS_D: tl.constexpr,
                         D_PER_CHANNEL: tl.constexpr, HAS_Z: tl.constexpr, VARLEN: tl.constexpr,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr, HAS_SEQ: tl.constexpr,
                         VX: tl.constexpr, VB: tl.constexpr):
    """The states and the output in one walk along every sequence: a program holds a [BP, BN]
    tile of the state in fp32 registers (BN >= n: the whole state of its head-dim rows) and,
    for each of its sequence's segments, stores it as the entering state (states, in the plan's
    state dtype; entering: segment_states, fp32), computes the segment's output rows from it
    (``segment_rows_out`` after the state term exp(Acum_i) C_i·H0, H0 rounded to x's dtype as
    the split output kernel reads it), then adds the segment's own contribution as
    ``ssd_chunk_states_kernel`` does; the last state is final_states. One program per
    (head-dim tile, sequence·head), the tile fastest: the R heads of a group run side by side
    and share its B and C rows and C·B tiles in L2; x is read from HBM once."""
    NPB: tl.constexpr = (P + BP - 1) // BP
    pid = tl.program_id(0)
    i_p, i_sh = pid % NPB, pid // NPB
    i_s, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    first, last, row, seq_start, seq_end = sequence_span(i_s, cu_ptr, off_ptr, L, Q, VARLEN)
    o_p, o_n, m_p, m_n, m_pn, o_pn, p_seq = walk_tile(i_p, 0, i_sh, P, N, BP, BN)
    b_state = state_tile(h0_ptr, p_seq, m_pn, BP, BN, HAS_H0)
    p_x = x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX)
    p_b = B_ptr + row * (stride_B_b * VB) + i_g * (stride_B_g * VB)
    p_c = C_ptr + row * (stride_C_b * VB) + i_g * (stride_C_g * VB)
    for k in range(0, last - first):
        seg = first + k
        start = seq_start + k * Q
        end = tl.minimum(seq_end, start + Q)
        store_entering(states_ptr, entering_ptr, (seg * H + i_h) * (P * N) + o_pn, b_state, m_pn,
                       HAS_ENTERING)
        p_seg = (seg * H + i_h) * Q
        p_cb = cb_ptr + (seg * G + i_g) * (Q * Q)
        r_prev = 0
        if HAS_SEQ:
            r_prev, _ = segment_runs(runs_ptr, row, start, end, L)
        b_h0t = tl.trans(b_state.to(x_ptr.dtype.element_ty))                   # [BN, BP]
        for i_m in range(0, tl.cdiv(end - start, BQ)):
            o_i = i_m * BQ + tl.arange(0, BQ)
            m_i = start + o_i < end
            tok_i = (start + o_i).to(tl.int64)
            b_acum_i = tl.load(acum_ptr + p_seg + o_i)
            b_c = tl.load(p_c + tok_i[:, None] * (stride_C_l * VB) + o_n[None, :],
                          mask=m_i[:, None] & m_n[None, :], other=0.0)
            b_acc = mm(b_c, b_h0t, tl.zeros([BQ, BP], dtype=tl.float32), UPCAST, IEEE)
            b_start = tl.exp(tl.minimum(b_acum_i, 0.0))
            if HAS_SEQ:
                b_start = tl.where(token_runs(runs_ptr, row, start, o_i, m_i, L) == r_prev,
                                   b_start, 0.0)
            segment_rows_out(b_acc * b_start[:, None], x_ptr, z_ptr, p_cb, dts_ptr, acum_ptr,
                             D_ptr, y_ptr, ypre_ptr, p_x, p_seg, row, start, end, i_h, i_m, o_i,
                             o_p, m_i, m_p, b_acum_i, stride_x_l, stride_z_b, stride_z_l,
                             stride_z_h, stride_y_b, stride_y_l, stride_y_h, L, H, P, Q, BQ,
                             HAS_D, D_PER_CHANNEL, HAS_Z, UPCAST, IEEE, VX)
        b_state = advance_state(b_state, p_x, p_b, dts_ptr, acum_ptr, runs_ptr, p_seg, row,
                                start, end, L, o_p, o_n, m_p, m_n, stride_x_l, stride_B_l, Q, BQ,
                                UPCAST, IEEE, HAS_SEQ, VX, VB)
    tl.store(final_ptr + p_seq, b_state, mask=m_pn)
