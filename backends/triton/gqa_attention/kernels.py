"""GQA attention: Triton kernels for the training forward and the deterministic backward.

Scores are kept in the log2 domain (scale·log2(e) folded into one factor) with an online softmax
in fp32; the probabilities enter the P·V and dS·K products in the input dtype, as in
FlashAttention. Every program computes one query head against its KV head (h // (h_q / h_kv)).
Sequences: dense [b, s, h, d] (PACKED = False: the cu_seqlens pointers are compiled out as
None and never touched) or packed [total, h, d] with cu_seqlens. Every [.., h, d] tensor is
addressed through its strides (batch, token, head; the batch stride 0 when packed), passed in
units of a 16-byte vector (VEC elements) and multiplied by the constexpr VEC, so the compiler
knows each row starts 16-byte aligned and keeps vector loads: views of a fused QKV projection
and outputs written into slices of wider buffers need no copy. A paged prefill (PAGED) reads
key j of sequence i from row j % PAGE of page block_table[i, j // PAGE] (the k, v batch stride
is the page stride). SOFTCAP: scores c·tanh(scale·q kᵀ / c), the backward's dS times 1 - tanh².
TMA (sm_90, sm_100; not paged): each program makes tensor descriptors of its sequence's q, k,
v (do) in the kernel (``rows_source``: the sequence's extent, so tokens past it read as zeros
and no tile needs a mask or per-thread addresses; the descriptors live in the launch's global
scratch, carved from the workspace), and the forward issues a block's scores before the
previous block's P·V, so its softmax runs while the tensor cores work (``_fwd_step``).

Packed offsets are index data (docs/plans.md, "Index data"): a sanitising kernel writes c' =
clamp(cummax(c), 0, total) of cu_seqlens_q/k to the workspace (and reports invalid offsets in the
status word); the attention kernels read only c'. Sequence i covers its first min(c'[i+1] -
c'[i], max_seqlen) tokens, which the grid's cdiv(max_seqlen, block) programs span; the same
programs clear the tokens no sequence covers (the rest of a longer sequence, those before c'[0]
and those after c'[nseq]): o = 0, lse = -inf, dq = 0, dk = dv = 0.
"""

import triton
import triton.language as tl

from ..primitives import mm, report_if

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def sanitise_offsets(cu_ptr, out_ptr, N, TOTAL, LONGEST, BLOCK: tl.constexpr):
    """Writes c'[i] = min(TOTAL, max(0, c[0..i])) of the N offsets at cu_ptr to out_ptr (= c'[0]
    = clamp(c[0], 0, TOTAL), c'[i] = clamp(c[i], c'[i-1], TOTAL)); returns 1 when they needed it
    (not starting at 0, decreasing, ending past TOTAL) or a sanitised sequence is longer than
    LONGEST, else 0."""
    carry = N * 0                                   # max(0, c[0..start-1])
    bad = N * 0
    for start in range(0, N, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < N
        c = tl.load(cu_ptr + o, mask=m, other=0)
        c_prev = tl.load(cu_ptr + o - 1, mask=m & (o > 0), other=0)
        s = tl.minimum(tl.maximum(tl.associative_scan(c, 0, _maximum), carry), TOTAL)
        s_prev = tl.minimum(tl.maximum(tl.associative_scan(c_prev, 0, _maximum), carry), TOTAL)
        wrong = ((o == 0) & (c != 0)) | ((o > 0) & ((c < c_prev) | (s - s_prev > LONGEST))) | \
            ((o == N - 1) & (c > TOTAL))
        bad = tl.maximum(bad, tl.max((wrong & m).to(tl.int32), 0))
        tl.store(out_ptr + o, s, mask=m)
        carry = tl.maximum(carry, tl.max(c, 0))
    return bad


@triton.jit
def attn_sanitise_kernel(cu_seqlens_q_ptr, cu_seqlens_k_ptr, cu_q_ptr, cu_k_ptr, status_ptr, N,
                         TOTAL_Q, TOTAL_K, SEQ_Q, SEQ_K, BLOCK: tl.constexpr, BIT: tl.constexpr,
                         HAS_STATUS: tl.constexpr):
    """One program: the sanitised offsets c' of cu_seqlens_q/k (N = nseq + 1 each) into
    cu_q/cu_k; BIT into the status word when either needed sanitising."""
    bad = sanitise_offsets(cu_seqlens_q_ptr, cu_q_ptr, N, TOTAL_Q, SEQ_Q, BLOCK)
    bad |= sanitise_offsets(cu_seqlens_k_ptr, cu_k_ptr, N, TOTAL_K, SEQ_K, BLOCK)
    report_if(status_ptr, bad != 0, BIT, HAS_STATUS)


@triton.jit
def sequence_span(i_b, cu_ptr, SEQ, PACKED: tl.constexpr):
    """(first token, length, end) of sequence i_b: packed, from the sanitised offsets cu_ptr
    (read only when PACKED), the length at most SEQ (max_seqlen) and end = c'[i_b + 1]; dense,
    (0, SEQ, SEQ): its rows are addressed from the batch stride."""
    if PACKED:
        start = tl.load(cu_ptr + i_b)
        end = tl.load(cu_ptr + i_b + 1)
        length = tl.minimum(end - start, SEQ)
    else:                                           # rows relative to the batch stride
        start = i_b * 0
        length = SEQ + i_b * 0
        end = length
    return start.to(tl.int64), length, end.to(tl.int64)


@triton.jit
def tanh(x):
    """tanh in fp32, finite for every finite or infinite x: a Taylor polynomial to x^11 where
    |x| < 1/4 (relative error < 1e-8), else sign(x)·(1 - e)/(1 + e) with e = exp(-2|x|)."""
    a = tl.abs(x)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (
        62.0 / 2835.0 + x2 * (-1382.0 / 155925.0))))))
    e = tl.exp2(a * (-2.0 * LOG2E))
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.25, small, tl.where(x < 0, -big, big))


@triton.jit
def log2_scores(b_raw, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain from raw q kᵀ: raw·scale·log2(e), or with a softcap c
    tanh(raw·scale / c)·c·log2(e) (cap_in = scale / c, cap_out = c·log2(e)). Returns (scores,
    1 - tanh², the softcap's derivative factor; the scores again without a softcap)."""
    if SOFTCAP:
        t = tanh(b_raw * cap_in)
        return t * cap_out, 1.0 - t * t
    else:
        b_s = b_raw * qk_scale
        return b_s, b_s


@triton.jit
def row_offsets(i_b, rows, i_h, stride_b, stride_s, stride_h, VEC: tl.constexpr):
    """int64 element offsets of tokens ``rows`` of head i_h of batch i_b (strides in VEC-element
    units; stride_b 0 when packed)."""
    return (i_b.to(tl.int64) * stride_b + rows.to(tl.int64) * stride_s + i_h * stride_h) * VEC


@triton.jit
def tile(base_ptr, rows, BD: tl.constexpr):
    """[N, BD] pointers to the first BD features of the tokens at ``rows`` (int32 element offsets
    [N], e.g. arange(N)·row stride) from the scalar pointer base_ptr."""
    return (base_ptr + rows)[:, None] + tl.arange(0, BD)[None, :]


@triton.jit
def tile_t(base_ptr, rows, BD: tl.constexpr):
    """``tile`` transposed: [BD, N]."""
    return (base_ptr + rows)[None, :] + tl.arange(0, BD)[:, None]


@triton.jit
def steps(N: tl.constexpr, stride_s, VEC: tl.constexpr):
    """int32 element offsets [N] of N consecutive tokens from the first (row stride in VEC
    units): computed once per program, small enough for int32 (N·stride < 2^31)."""
    return tl.arange(0, N) * stride_s * VEC


@triton.jit
def rows_source(ptr, i_b, start, length, stride_b, stride_s, stride_h, HEADS: tl.constexpr,
                D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr,
                TMA: tl.constexpr):
    """What ``rows`` reads tiles of BM tokens of one head from, for sequence i_b (its ``length``
    tokens from ``start``) of a [.., h, d] tensor (strides in VEC-element units). TMA: a tensor
    descriptor over (head, token, feature) of this sequence alone, in [1, BM, BD] blocks:
    tokens past ``length`` and features past D read as zeros, so no tile needs a mask and no
    thread holds an address (each descriptor takes 128 bytes of the launch's global scratch);
    else the pointer to the sequence's first token."""
    base = ptr + (i_b.to(tl.int64) * stride_b + start * stride_s) * VEC
    if TMA:
        return tl.make_tensor_descriptor(base, [HEADS, tl.maximum(length, 1), D],
                                         [stride_h * VEC, stride_s * VEC, 1], [1, BM, BD])
    else:
        return base


@triton.jit
def rows(src, m0, i_h, length, stride_s, stride_h, token_steps, m_d, BM: tl.constexpr,
         BD: tl.constexpr, VEC: tl.constexpr, TMA: tl.constexpr):
    """The [BM, BD] tile of tokens [m0, m0 + BM) of head i_h from ``rows_source``'s ``src``
    (zeros past the sequence's ``length`` tokens and the D features m_d marks; token_steps:
    ``steps(BM, stride_s, VEC)``, unused with TMA)."""
    if TMA:
        return src.load([i_h, m0, 0]).reshape(BM, BD)
    else:
        o = m0 + tl.arange(0, BM)
        first = src + (m0.to(tl.int64) * stride_s + i_h * stride_h) * VEC
        return tl.load(tile(first, token_steps, BD), mask=(o < length)[:, None] & m_d[None, :],
                       other=0.0)


@triton.jit
def bad_pages(table_ptr, needed, PAGES, TABLE_BLOCK: tl.constexpr):
    """How many of the ``needed`` block-table entries at table_ptr are outside [0, PAGES)."""
    count = needed * 0
    for p0 in range(0, needed, TABLE_BLOCK):
        o_p = p0 + tl.arange(0, TABLE_BLOCK)
        m = o_p < needed
        page = tl.load(table_ptr + o_p, mask=m, other=0)
        count += tl.sum((m & ((page < 0) | (page >= PAGES))).to(tl.int32), 0)
    return count


@triton.jit
def paged_rows(i_b, o_n, len_k, i_kh, table_ptr, stride_b, stride_s, stride_h,
               VEC: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr):
    """[BN] int64 element offsets of keys o_n of KV head i_kh of sequence i_b in a paged k or v:
    row o_n % PAGE of page block_table[i_b, o_n // PAGE] (keys past len_k read page 0: their
    loads are masked)."""
    page = tl.load(table_ptr + i_b.to(tl.int64) * MAX_PAGES + o_n // PAGE, mask=o_n < len_k,
                   other=0)
    return row_offsets(page, o_n % PAGE, i_kh, stride_b, stride_s, stride_h, VEC)


@triton.jit
def clear_rows(a_ptr, b_ptr, lse_ptr, lo, hi, i_h, first, step, TOTAL, stride_as, stride_ah,
               stride_bs, stride_bh, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
               VEC: tl.constexpr):
    """Rows [lo, hi) of head i_h of the packed [TOTAL, H, D] tensors a and b (None: absent; row
    and head strides in VEC units) set to 0 and lse[i_h, row] to -inf (None: absent), BM rows
    from ``first`` every ``step``."""
    o_d = tl.arange(0, BD)
    for r0 in range(lo + first, hi, step):
        o_r = r0 + tl.arange(0, BM)
        m = o_r < hi
        m2 = m[:, None] & (o_d < D)[None, :]
        p_a = o_r.to(tl.int64) * stride_as * VEC + i_h * stride_ah * VEC
        tl.store(a_ptr + p_a[:, None] + o_d[None, :],
                 tl.zeros([BM, BD], dtype=a_ptr.dtype.element_ty), mask=m2)
        if b_ptr is not None:
            p_b = o_r.to(tl.int64) * stride_bs * VEC + i_h * stride_bh * VEC
            tl.store(b_ptr + p_b[:, None] + o_d[None, :],
                     tl.zeros([BM, BD], dtype=b_ptr.dtype.element_ty), mask=m2)
        if lse_ptr is not None:
            tl.store(lse_ptr + i_h.to(tl.int64) * TOTAL + o_r,
                     tl.full([BM], float("-inf"), dtype=tl.float32), mask=m)


@triton.jit
def clear_uncovered(a_ptr, b_ptr, lse_ptr, i_b, i_h, i_blk, start, length, end, TOTAL, NSEQ,
                    stride_as, stride_ah, stride_bs, stride_bh, D: tl.constexpr,
                    BM: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr):
    """The programs (i_blk = 0..) of sequence i_b clear what no sequence covers next to it: the
    rest of the sequence past its first ``length`` tokens (the last sequence: up to TOTAL) and,
    for sequence 0, the tokens before it. Nothing to do for valid offsets that end at TOTAL."""
    first = i_blk * BM
    step = tl.num_programs(0) * BM
    hi = tl.where(i_b == NSEQ - 1, TOTAL, end)
    clear_rows(a_ptr, b_ptr, lse_ptr, start + length, hi, i_h, first, step, TOTAL, stride_as,
               stride_ah, stride_bs, stride_bh, D, BM, BD, VEC)
    clear_rows(a_ptr, b_ptr, lse_ptr, start * 0, tl.where(i_b == 0, start, 0), i_h, first, step,
               TOTAL, stride_as, stride_ah, stride_bs, stride_bh, D, BM, BD, VEC)


@triton.jit
def visible_pairs(i, j, len_q, len_k, CAUSAL: tl.constexpr, LEFT: tl.constexpr,
                  RIGHT: tl.constexpr):
    """Whether query i may see key j (bottom-right aligned), for broadcastable index tensors."""
    offset = len_k - len_q
    ok = (i < len_q) & (j < len_k)
    if CAUSAL:
        ok &= j <= i + offset
    if LEFT >= 0:
        ok &= j >= i + offset - LEFT
    if RIGHT >= 0:
        ok &= j <= i + offset + RIGHT
    return ok


@triton.jit
def visible(o_m, o_n, len_q, len_k, CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """[BM, BN] mask of the keys o_n each query o_m may see (bottom-right aligned)."""
    return visible_pairs(o_m[:, None], o_n[None, :], len_q, len_k, CAUSAL, LEFT, RIGHT)


@triton.jit
def key_range(m0, m1, len_q, len_k, BN: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr,
              RIGHT: tl.constexpr):
    """[lo, hi) keys any query of rows [m0, m1) may see, lo aligned to BN."""
    offset = len_k - len_q
    lo = m0 * 0
    hi = len_k
    last = tl.minimum(m1, len_q) - 1
    if CAUSAL:
        hi = tl.minimum(hi, last + offset + 1)
    if RIGHT >= 0:
        hi = tl.minimum(hi, last + offset + RIGHT + 1)
    if LEFT >= 0:
        lo = tl.maximum(lo, m0 + offset - LEFT)
    return (lo // BN) * BN, hi


@triton.jit
def unmasked_keys(m0, m1, lo, hi, len_q, len_k, BN: tl.constexpr, CAUSAL: tl.constexpr,
                  LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """[full_lo, full_hi) within key_range's [lo, hi), both multiples of BN: the key blocks every
    query of rows [m0, m1) sees whole (below the diagonal and the window's right edge, at or past
    its left edge, inside len_k). Empty when no block is."""
    offset = len_k - len_q
    last = tl.minimum(m1, len_q) - 1
    end = len_k
    if CAUSAL:
        end = tl.minimum(end, m0 + offset + 1)
    if RIGHT >= 0:
        end = tl.minimum(end, m0 + offset + RIGHT + 1)
    start = lo
    if LEFT >= 0:
        start = tl.maximum(start, last + offset - LEFT)
    start = tl.minimum((start + BN - 1) // BN * BN, hi)
    end = tl.maximum(end, start)
    return start, tl.maximum(start, end // BN * BN)


@triton.jit
def query_range(n0, n1, len_q, len_k, BM: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr,
                RIGHT: tl.constexpr):
    """[lo, hi) queries that may see any key of [n0, n1), lo aligned to BM."""
    offset = len_k - len_q
    lo = n0 * 0
    hi = len_q
    last = tl.minimum(n1, len_k) - 1
    if CAUSAL:
        lo = tl.maximum(lo, n0 - offset)
    if RIGHT >= 0:
        lo = tl.maximum(lo, n0 - offset - RIGHT)
    if LEFT >= 0:
        hi = tl.minimum(hi, last - offset + LEFT + 1)
    return (lo // BM) * BM, hi


@triton.jit
def unmasked_queries(n0, n1, lo, hi, len_q, len_k, BM: tl.constexpr, CAUSAL: tl.constexpr,
                     LEFT: tl.constexpr, RIGHT: tl.constexpr):
    """[full_lo, full_hi) within query_range's [lo, hi), both multiples of BM from lo: the query
    blocks that see every key of [n0, n1) (past the diagonal and the window's right edge,
    before its left edge, inside len_q). Empty when none do. Keys past len_k need no mask: each
    key's dk, dv row depends on its own row of Pᵀ alone, and those rows are never stored."""
    offset = len_k - len_q
    start = lo
    if CAUSAL:
        start = tl.maximum(start, n1 - 1 - offset)
    if RIGHT >= 0:
        start = tl.maximum(start, n1 - 1 - offset - RIGHT)
    start = tl.minimum((start - lo + BM - 1) // BM * BM + lo, hi)
    end = hi
    if LEFT >= 0:
        end = tl.minimum(end, n0 - offset + LEFT + 1)
    end = tl.maximum(end, start)
    return start, start + (end - start) // BM * BM


@triton.jit
def query_block(CAUSAL: tl.constexpr):
    """The query block of a forward or dq program (grid dimension 0): causal, the last first,
    so the programs that visit the most key blocks start first and the grid ends on the
    shortest (FlashAttention's order); else in launch order."""
    if CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        return tl.program_id(0)


@triton.jit
def lse_offsets(i_b, i_h, q_start, o_m, SEQ_Q, TOTAL_Q, HQ: tl.constexpr, PACKED: tl.constexpr):
    if PACKED:
        return i_h.to(tl.int64) * TOTAL_Q + q_start + o_m
    else:
        return (i_b.to(tl.int64) * HQ + i_h) * SEQ_Q + o_m


@triton.jit
def _fwd_scores(b_q, n0, o_m, o_d, m_d, k_ptr, block_table_ptr, i_b, i_kh, k_start, len_q, len_k,
                stride_kb, stride_ks, stride_kh, qk_scale, cap_in, cap_out, MASKED: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr,
                RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PAGED: tl.constexpr,
                PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, VEC: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr):
    """The log2-domain scores [BM, BN] of keys [n0, n0 + BN). MASKED: -inf where the visibility
    mask hides a key (the window edges, the diagonal, keys past len_k); else every key of the
    block is visible to every row. TMA: k_ptr is the sequence's tensor descriptor."""
    o_n = n0 + tl.arange(0, BN)
    if TMA:
        b_kt = tl.trans(rows(k_ptr, n0, i_kh, len_k, stride_ks, stride_kh, None, m_d, BN, BD,
                             VEC, TMA))                                    # [BD, BN]
    else:
        if PAGED:
            p_kt = k_ptr + paged_rows(i_b, o_n, len_k, i_kh, block_table_ptr, stride_kb,
                                      stride_ks, stride_kh, VEC, PAGE, MAX_PAGES)[None, :] + \
                o_d[:, None]
        else:
            p_kt = k_ptr + row_offsets(i_b, k_start + o_n, i_kh, stride_kb, stride_ks, stride_kh,
                                       VEC)[None, :] + o_d[:, None]
        b_kt = tl.load(p_kt, mask=m_d[:, None] & (o_n < len_k)[None, :], other=0.0)   # [BD, BN]
    b_s, _ = log2_scores(mm(b_q, b_kt, tl.zeros([BM, BN], dtype=tl.float32), UPCAST, IEEE),
                         qk_scale, cap_in, cap_out, SOFTCAP)
    if MASKED:
        b_s = tl.where(visible(o_m, o_n, len_q, len_k, CAUSAL, LEFT, RIGHT), b_s, float("-inf"))
    return b_s


@triton.jit
def _fwd_softmax(b_s, b_m, b_l, dtype: tl.constexpr):
    """The online softmax after scores b_s: the new running max and sum, the factor that
    rescales the accumulator to the new max, and the block's probabilities in ``dtype``."""
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    b_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_p = tl.exp2(b_s - b_safe[:, None])
    b_alpha = tl.exp2(b_m - b_safe)
    b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
    return b_m_new, b_l, b_alpha, b_p.to(dtype)


@triton.jit
def _fwd_values(b_acc, b_p, n0, o_d, m_d, v_ptr, block_table_ptr, i_b, i_kh, k_start, len_k,
                stride_vb, stride_vs, stride_vh, BN: tl.constexpr, PAGED: tl.constexpr,
                PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, VEC: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr):
    """b_acc + P v for the probabilities b_p [BM, BN] of keys [n0, n0 + BN)."""
    if TMA:
        b_v = rows(v_ptr, n0, i_kh, len_k, stride_vs, stride_vh, None, m_d, BN, BD, VEC, TMA)
    else:
        o_n = n0 + tl.arange(0, BN)
        if PAGED:
            p_v = v_ptr + paged_rows(i_b, o_n, len_k, i_kh, block_table_ptr, stride_vb,
                                     stride_vs, stride_vh, VEC, PAGE, MAX_PAGES)[:, None] + \
                o_d[None, :]
        else:
            p_v = v_ptr + row_offsets(i_b, k_start + o_n, i_kh, stride_vb, stride_vs, stride_vh,
                                      VEC)[:, None] + o_d[None, :]
        b_v = tl.load(p_v, mask=(o_n < len_k)[:, None] & m_d[None, :], other=0.0)
    return mm(b_p, b_v, b_acc, UPCAST, IEEE)                            # [BM, BN] @ [BN, BD]


@triton.jit
def _fwd_step(b_q, b_m, b_l, b_acc, b_p, n0, o_m, o_d, m_d, k_ptr, v_ptr, block_table_ptr, i_b,
              i_kh, k_start, len_q, len_k, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
              stride_vh, qk_scale, cap_in, cap_out, MASKED: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
              SOFTCAP: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
              MAX_PAGES: tl.constexpr, VEC: tl.constexpr, UPCAST: tl.constexpr,
              IEEE: tl.constexpr, BD: tl.constexpr, TMA: tl.constexpr, SHIFT: tl.constexpr):
    """Key block [n0, n0 + BN) of the online softmax. SHIFT (TMA: wgmma and tcgen05 run
    asynchronously): issues its scores, then the previous block's P·V (b_p), then its softmax,
    which runs while the tensor cores compute that P·V, and returns its own probabilities for
    the next step; else scores, softmax and its own P·V in order (b_p passed through, so the
    loops carry nothing more)."""
    b_s = _fwd_scores(b_q, n0, o_m, o_d, m_d, k_ptr, block_table_ptr, i_b, i_kh, k_start, len_q,
                      len_k, stride_kb, stride_ks, stride_kh, qk_scale, cap_in, cap_out, MASKED,
                      BM, BN, CAUSAL, LEFT, RIGHT, SOFTCAP, PAGED, PAGE, MAX_PAGES, VEC, UPCAST,
                      IEEE, BD, TMA)
    if SHIFT:
        b_acc = _fwd_values(b_acc, b_p, n0 - BN, o_d, m_d, v_ptr, block_table_ptr, i_b, i_kh,
                            k_start, len_k, stride_vb, stride_vs, stride_vh, BN, PAGED, PAGE,
                            MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA)
        b_m, b_l, b_alpha, b_p = _fwd_softmax(b_s, b_m, b_l, b_q.dtype)
        b_acc = b_acc * b_alpha[:, None]
    else:
        b_m, b_l, b_alpha, b_pj = _fwd_softmax(b_s, b_m, b_l, b_q.dtype)
        b_acc = _fwd_values(b_acc * b_alpha[:, None], b_pj, n0, o_d, m_d, v_ptr, block_table_ptr,
                            i_b, i_kh, k_start, len_k, stride_vb, stride_vs, stride_vh, BN, PAGED,
                            PAGE, MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA)
    return b_m, b_l, b_acc, b_p


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
                    block_table_ptr, status_ptr, stride_qb, stride_qs, stride_qh, stride_kb,
                    stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_ob, stride_os,
                    stride_oh, SEQ_Q, SEQ_K, TOTAL_Q, PAGES, scale, cap_in, cap_out,
                    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BD: tl.constexpr, CAUSAL: tl.constexpr, LEFT: tl.constexpr,
                    RIGHT: tl.constexpr, PACKED: tl.constexpr, SOFTCAP: tl.constexpr,
                    PAGED: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                    TABLE_BLOCK: tl.constexpr, TABLE_BIT: tl.constexpr, HAS_STATUS: tl.constexpr,
                    VEC: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                    TMA: tl.constexpr):
    """o and lse of one block of BM query rows of one head (per key block ``_fwd_step``). TMA
    (not paged): q, k and v read through tensor descriptors of the sequence (``rows_source``:
    three per program)."""
    i_m, i_bh = query_block(CAUSAL), tl.program_id(1)
    i_b, i_h = i_bh // HQ, i_bh % HQ
    i_kh = i_h // (HQ // HKV)
    q_start, len_q, q_end = sequence_span(i_b, cu_seqlens_q_ptr, SEQ_Q, PACKED)
    k_start, len_k, _ = sequence_span(i_b, cu_seqlens_k_ptr, SEQ_K, PACKED)
    if PACKED:
        clear_uncovered(o_ptr, None, lse_ptr, i_b, i_h, i_m, q_start, len_q, q_end, TOTAL_Q,
                        tl.num_programs(1) // HQ, stride_os, stride_oh, 0, 0, D, BM, BD, VEC)
    if i_m * BM >= len_q:
        return
    if PAGED:     # a sequence that needs a page outside the pool sees no key
        wrong = bad_pages(block_table_ptr + i_b.to(tl.int64) * MAX_PAGES,
                          tl.minimum((len_k + PAGE - 1) // PAGE, MAX_PAGES), PAGES, TABLE_BLOCK)
        report_if(status_ptr, (wrong > 0) & (i_m == 0) & (i_h == 0), TABLE_BIT, HAS_STATUS)
        len_k = tl.where(wrong > 0, 0, len_k)
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_q = (o_m < len_q)[:, None] & m_d[None, :]
    if TMA:
        b_q = rows(rows_source(q_ptr, i_b, q_start, len_q, stride_qb, stride_qs, stride_qh, HQ, D,
                               BM, BD, VEC, TMA), i_m * BM, i_h, len_q, stride_qs, stride_qh,
                   None, m_d, BM, BD, VEC, TMA)
        k_ptr = rows_source(k_ptr, i_b, k_start, len_k, stride_kb, stride_ks, stride_kh, HKV, D,
                            BN, BD, VEC, TMA)
        v_ptr = rows_source(v_ptr, i_b, k_start, len_k, stride_vb, stride_vs, stride_vh, HKV, D,
                            BN, BD, VEC, TMA)
    else:
        q_rows = row_offsets(i_b, q_start + i_m * BM, i_h, stride_qb, stride_qs, stride_qh, VEC)
        b_q = tl.load(tile(q_ptr + q_rows, steps(BM, stride_qs, VEC), BD), mask=m_q, other=0.0)
    qk_scale = scale * LOG2E
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    lo, hi = key_range(i_m * BM, (i_m + 1) * BM, len_q, len_k, BN, CAUSAL, LEFT, RIGHT)
    full_lo, full_hi = unmasked_keys(i_m * BM, (i_m + 1) * BM, lo, hi, len_q, len_k, BN, CAUSAL,
                                     LEFT, RIGHT)
    # with TMA (SHIFT, ``_fwd_step``) the first block runs alone (masked: its mask is right for
    # any block) and its P·V waits for the next step, the last block's follows the loops; then
    # the blocks every query of the tile sees whole run without mask arithmetic, the window's
    # left edge before them and the diagonal (and the last partial block) after them masked
    SHIFT: tl.constexpr = TMA
    b_p = tl.zeros([BM, BN], dtype=b_q.dtype)
    start, mid, last = lo, full_lo, full_hi
    if SHIFT:
        if lo < hi:
            b_s = _fwd_scores(b_q, lo, o_m, o_d, m_d, k_ptr, block_table_ptr, i_b, i_kh, k_start,
                              len_q, len_k, stride_kb, stride_ks, stride_kh, qk_scale, cap_in,
                              cap_out, True, BM, BN, CAUSAL, LEFT, RIGHT, SOFTCAP, PAGED, PAGE,
                              MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA)
            b_m, b_l, b_alpha, b_p = _fwd_softmax(b_s, b_m, b_l, b_q.dtype)   # b_acc: still 0
        start = lo + BN
        mid, last = tl.maximum(full_lo, start), tl.maximum(full_hi, start)
    if LEFT >= 0:     # without a window full_lo is lo
        for n0 in range(start, full_lo, BN):
            b_m, b_l, b_acc, b_p = _fwd_step(
                b_q, b_m, b_l, b_acc, b_p, n0, o_m, o_d, m_d, k_ptr, v_ptr, block_table_ptr, i_b,
                i_kh, k_start, len_q, len_k, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, qk_scale, cap_in, cap_out, True, BM, BN, CAUSAL, LEFT,
                RIGHT, SOFTCAP, PAGED, PAGE, MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA, SHIFT)
    for n0 in range(mid, full_hi, BN):
        b_m, b_l, b_acc, b_p = _fwd_step(
            b_q, b_m, b_l, b_acc, b_p, n0, o_m, o_d, m_d, k_ptr, v_ptr, block_table_ptr, i_b,
            i_kh, k_start, len_q, len_k, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, qk_scale, cap_in, cap_out, False, BM, BN, CAUSAL, LEFT, RIGHT, SOFTCAP,
            PAGED, PAGE, MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA, SHIFT)
    for n0 in range(last, hi, BN):
        b_m, b_l, b_acc, b_p = _fwd_step(
            b_q, b_m, b_l, b_acc, b_p, n0, o_m, o_d, m_d, k_ptr, v_ptr, block_table_ptr, i_b,
            i_kh, k_start, len_q, len_k, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, qk_scale, cap_in, cap_out, True, BM, BN, CAUSAL, LEFT, RIGHT, SOFTCAP,
            PAGED, PAGE, MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA, SHIFT)
    if SHIFT:
        if lo < hi:
            b_acc = _fwd_values(b_acc, b_p, lo + (hi - lo - 1) // BN * BN, o_d, m_d, v_ptr,
                                block_table_ptr, i_b, i_kh, k_start, len_k, stride_vb, stride_vs,
                                stride_vh, BN, PAGED, PAGE, MAX_PAGES, VEC, UPCAST, IEEE, BD, TMA)
    seen = b_l > 0
    b_o = b_acc / tl.where(seen, b_l, 1.0)[:, None]
    o_rows = row_offsets(i_b, q_start + i_m * BM, i_h, stride_ob, stride_os, stride_oh, VEC)
    tl.store(tile(o_ptr + o_rows, steps(BM, stride_os, VEC), BD), b_o.to(o_ptr.dtype.element_ty),
             mask=m_q)
    b_lse = tl.where(seen, (b_m + tl.log2(tl.where(seen, b_l, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + lse_offsets(i_b, i_h, q_start, o_m, SEQ_Q, TOTAL_Q, HQ, PACKED), b_lse,
             mask=o_m < len_q)


@triton.jit
def attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, cu_seqlens_q_ptr, stride_ob, stride_os,
                          stride_oh, stride_dob, stride_dos, stride_doh, SEQ_Q, TOTAL_Q,
                          HQ: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                          CHUNK: tl.constexpr, PACKED: tl.constexpr, VEC: tl.constexpr):
    """delta = rowsum(do ∘ o), laid out like lse; CHUNK features at a time."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HQ, i_bh % HQ
    q_start, len_q, _ = sequence_span(i_b, cu_seqlens_q_ptr, SEQ_Q, PACKED)
    if i_m * BM >= len_q:
        return
    o_m = i_m * BM + tl.arange(0, BM)
    p_o = o_ptr + row_offsets(i_b, q_start + i_m * BM, i_h, stride_ob, stride_os, stride_oh, VEC)
    p_do = do_ptr + row_offsets(i_b, q_start + i_m * BM, i_h, stride_dob, stride_dos, stride_doh,
                                VEC)
    o_steps = steps(BM, stride_os, VEC)
    do_steps = steps(BM, stride_dos, VEC)
    b_delta = tl.zeros([BM], dtype=tl.float32)
    for c in tl.static_range(0, BD, CHUNK):
        o_d = c + tl.arange(0, CHUNK)
        m = (o_m < len_q)[:, None] & (o_d < D)[None, :]
        b_o = tl.load((p_o + o_steps)[:, None] + o_d[None, :], mask=m, other=0.0)
        b_do = tl.load((p_do + do_steps)[:, None] + o_d[None, :], mask=m, other=0.0)
        b_delta += tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), axis=1)
    tl.store(delta_ptr + lse_offsets(i_b, i_h, q_start, o_m, SEQ_Q, TOTAL_Q, HQ, PACKED), b_delta,
             mask=o_m < len_q)


@triton.jit
def probabilities(b_q, b_kt, b_lse, o_m, o_n, len_q, len_k, qk_scale, cap_in, cap_out,
                  CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    """P [BM, BN] recomputed from q, kᵀ and the forward's lse (0 where masked or rowless), and
    the softcap's factor 1 - tanh² (``log2_scores``)."""
    b_s, b_gate = log2_scores(mm(b_q, b_kt, tl.zeros([BM, BN], dtype=tl.float32), UPCAST, IEEE),
                              qk_scale, cap_in, cap_out, SOFTCAP)
    has_keys = b_lse != float("-inf")
    ok = visible(o_m, o_n, len_q, len_k, CAUSAL, LEFT, RIGHT) & has_keys[:, None]
    return tl.where(ok, tl.exp2(b_s - tl.where(has_keys, b_lse * LOG2E, 0.0)[:, None]), 0.0), b_gate


@triton.jit
def _dkdv_block(b_dk, b_dv, b_k, b_v, m0, o_n, m_d, q_src, do_src, lse_ptr, delta_ptr, i_b, i_h,
                q_start, len_q, len_k, stride_qs, stride_qh, stride_dos, stride_doh, q_steps,
                do_steps, SEQ_Q, TOTAL_Q, qk_scale, cap_in, cap_out, masked, HQ: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, CAUSAL: tl.constexpr,
                LEFT: tl.constexpr, RIGHT: tl.constexpr, PACKED: tl.constexpr,
                SOFTCAP: tl.constexpr, VEC: tl.constexpr, UPCAST: tl.constexpr,
                IEEE: tl.constexpr, FEATURES_M: tl.constexpr, TMA: tl.constexpr):
    """dk, dv of the key block after query rows [m0, m0 + BM) of head i_h (q and do from
    ``rows_source``'s q_src and do_src). ``masked`` (a runtime flag, so that one loop body
    serves every block): the visibility mask applied; else every query of the block sees every
    key of the key block (``unmasked_queries``).

    Keys as M (FEATURES_M False; b_k, b_v [BN, BD], b_dk, b_dv [BN, BD]): every product has the
    key block's BN rows as M (Sᵀ = k qᵀ, dPᵀ = v doᵀ): Pᵀ = exp2(Sᵀ·scale·log2 e - lse) with
    lse broadcast along the keys, dv += Pᵀ do and dk += dSᵀ q with Pᵀ and dSᵀ = Pᵀ ∘ (dPᵀ -
    delta) as the register A operand.
    Features as M (FEATURES_M True; b_k, b_v as kᵀ, vᵀ [BD, BN], b_dk, b_dv as dkᵀ, dvᵀ
    [BD, BN]): S = q kᵀ and dP = do vᵀ with the query block as M, then dvᵀ += doᵀ P and dkᵀ +=
    qᵀ dS with the head dim as M (P and dS through shared memory as the B operand): the
    accumulators hold BD·BN values rather than the keys-as-M BN·BD over BN/64 warpgroups."""
    o_m = m0 + tl.arange(0, BM)
    b_q = rows(q_src, m0, i_h, len_q, stride_qs, stride_qh, q_steps, m_d, BM, BD, VEC, TMA)
    b_do = rows(do_src, m0, i_h, len_q, stride_dos, stride_doh, do_steps, m_d, BM, BD, VEC, TMA)
    p_row = lse_offsets(i_b, i_h, q_start, o_m, SEQ_Q, TOTAL_Q, HQ, PACKED)
    b_lse = tl.load(lse_ptr + p_row, mask=o_m < len_q, other=float("-inf"))
    b_delta = tl.load(delta_ptr + p_row, mask=o_m < len_q, other=0.0)
    # a row without keys (lse = -inf) gets exp2(s - inf) = 0
    b_off = tl.where(b_lse != float("-inf"), b_lse * LOG2E, float("inf"))
    if FEATURES_M:
        b_s, b_gate = log2_scores(mm(b_q, b_k, tl.zeros([BM, BN], dtype=tl.float32), UPCAST,
                                     IEEE), qk_scale, cap_in, cap_out, SOFTCAP)   # [BM, BN]
        b_dp = mm(b_do, b_v, tl.zeros([BM, BN], dtype=tl.float32), UPCAST, IEEE)
        b_p = tl.exp2(b_s - b_off[:, None])
        if masked:
            b_p = tl.where(visible(o_m, o_n, len_q, len_k, CAUSAL, LEFT, RIGHT), b_p, 0.0)
        b_dv = mm(tl.trans(b_do), b_p.to(b_do.dtype), b_dv, UPCAST, IEEE)  # [BD, BM] @ [BM, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])
        if SOFTCAP:
            b_ds = b_ds * b_gate
        b_dk = mm(tl.trans(b_q), b_ds.to(b_q.dtype), b_dk, UPCAST, IEEE)  # [BD, BM] @ [BM, BN]
    else:
        b_st, b_gate = log2_scores(mm(b_k, tl.trans(b_q), tl.zeros([BN, BM], dtype=tl.float32),
                                      UPCAST, IEEE), qk_scale, cap_in, cap_out, SOFTCAP)  # [BN, BM]
        # dPᵀ issued before the exponentials, which run while the tensor cores compute it
        b_dpt = mm(b_v, tl.trans(b_do), tl.zeros([BN, BM], dtype=tl.float32), UPCAST, IEEE)
        b_pt = tl.exp2(b_st - b_off[None, :])
        if masked:
            b_pt = tl.where(visible_pairs(o_m[None, :], o_n[:, None], len_q, len_k, CAUSAL, LEFT,
                                          RIGHT), b_pt, 0.0)
        b_dv = mm(b_pt.to(b_do.dtype), b_do, b_dv, UPCAST, IEEE)          # [BN, BM] @ [BM, BD]
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        if SOFTCAP:
            b_dst = b_dst * b_gate
        b_dk = mm(b_dst.to(b_q.dtype), b_q, b_dk, UPCAST, IEEE)           # [BN, BM] @ [BM, BD]
    return b_dk, b_dv


@triton.jit
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_seqlens_q_ptr,
                         cu_seqlens_k_ptr, dk_ptr, dv_ptr, stride_qb, stride_qs, stride_qh,
                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh,
                         stride_dvb, stride_dvs, stride_dvh, SEQ_Q, SEQ_K, TOTAL_Q, TOTAL_K, scale,
                         cap_in, cap_out,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BD: tl.constexpr, CAUSAL: tl.constexpr,
                         LEFT: tl.constexpr, RIGHT: tl.constexpr, PACKED: tl.constexpr,
                         SOFTCAP: tl.constexpr, VEC: tl.constexpr, UPCAST: tl.constexpr,
                         IEEE: tl.constexpr, FEATURES_M: tl.constexpr, TMA: tl.constexpr):
    """dk, dv of one key block of one KV head, summed over the group's query heads and query
    blocks in fp32, in a fixed order (the query blocks from the last down, the G heads within
    each): deterministic, no atomics. Every product reaches wgmma (tcgen05) with 64 rows per
    warpgroup whatever the other side: the key block as M (``_dkdv_block``), or with FEATURES_M
    the query block as the scores' M and the head dim as dk's and dv's (stored transposed).
    TMA: q and do read through tensor descriptors of the sequence (two per program)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_kh = i_bh // HKV, i_bh % HKV
    q_start, len_q, _ = sequence_span(i_b, cu_seqlens_q_ptr, SEQ_Q, PACKED)
    k_start, len_k, k_end = sequence_span(i_b, cu_seqlens_k_ptr, SEQ_K, PACKED)
    if PACKED:
        clear_uncovered(dk_ptr, dv_ptr, None, i_b, i_kh, i_n, k_start, len_k, k_end, TOTAL_K,
                        tl.num_programs(1) // HKV, stride_dks, stride_dkh, stride_dvs, stride_dvh,
                        D, BN, BD, VEC)
    if i_n * BN >= len_k:
        return
    G: tl.constexpr = HQ // HKV
    o_n = i_n * BN + tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    n_first = k_start + i_n * BN
    p_k = k_ptr + row_offsets(i_b, n_first, i_kh, stride_kb, stride_ks, stride_kh, VEC)
    p_v = v_ptr + row_offsets(i_b, n_first, i_kh, stride_vb, stride_vs, stride_vh, VEC)
    p_dk = dk_ptr + row_offsets(i_b, n_first, i_kh, stride_dkb, stride_dks, stride_dkh, VEC)
    p_dv = dv_ptr + row_offsets(i_b, n_first, i_kh, stride_dvb, stride_dvs, stride_dvh, VEC)
    if FEATURES_M:                                                               # [BD, BN]
        m_kv = m_d[:, None] & (o_n < len_k)[None, :]
        b_k = tl.load(tile_t(p_k, steps(BN, stride_ks, VEC), BD), mask=m_kv, other=0.0)
        b_v = tl.load(tile_t(p_v, steps(BN, stride_vs, VEC), BD), mask=m_kv, other=0.0)
        b_dk = tl.zeros([BD, BN], dtype=tl.float32)
        b_dv = tl.zeros([BD, BN], dtype=tl.float32)
    else:                                                                        # [BN, BD]
        m_kv = (o_n < len_k)[:, None] & m_d[None, :]
        b_k = tl.load(tile(p_k, steps(BN, stride_ks, VEC), BD), mask=m_kv, other=0.0)
        b_v = tl.load(tile(p_v, steps(BN, stride_vs, VEC), BD), mask=m_kv, other=0.0)
        b_dk = tl.zeros([BN, BD], dtype=tl.float32)
        b_dv = tl.zeros([BN, BD], dtype=tl.float32)
    q_steps = steps(BM, stride_qs, VEC)
    do_steps = steps(BM, stride_dos, VEC)
    q_src = rows_source(q_ptr, i_b, q_start, len_q, stride_qb, stride_qs, stride_qh, HQ, D, BM, BD,
                        VEC, TMA)
    do_src = rows_source(do_ptr, i_b, q_start, len_q, stride_dob, stride_dos, stride_doh, HQ, D,
                         BM, BD, VEC, TMA)
    qk_scale = scale * LOG2E
    lo, hi = query_range(i_n * BN, (i_n + 1) * BN, len_q, len_k, BM, CAUSAL, LEFT, RIGHT)
    full_lo, full_hi = unmasked_queries(i_n * BN, (i_n + 1) * BN, lo, hi, len_q, len_k, BM,
                                        CAUSAL, LEFT, RIGHT)
    # one loop over (query block, head) in a fixed order (deterministic sums), so the
    # accumulators stay where the MMA keeps them across the group's heads (tensor memory on
    # sm_100); the query blocks from the last down, so the key blocks of a KV head, which start
    # together, read the same q and do tiles at the same time whatever their diagonal
    blocks = tl.cdiv(tl.maximum(hi - lo, 0), BM)
    for t in range(0, G * blocks):
        j = t // G
        g = t - j * G
        m0 = lo + (blocks - 1 - j) * BM
        b_dk, b_dv = _dkdv_block(
            b_dk, b_dv, b_k, b_v, m0, o_n, m_d, q_src, do_src, lse_ptr, delta_ptr, i_b,
            i_kh * G + g, q_start, len_q, len_k, stride_qs, stride_qh, stride_dos, stride_doh,
            q_steps, do_steps, SEQ_Q, TOTAL_Q, qk_scale, cap_in, cap_out,
            (m0 < full_lo) | (m0 >= full_hi), HQ, BM, BN, BD, CAUSAL, LEFT, RIGHT, PACKED, SOFTCAP,
            VEC, UPCAST, IEEE, FEATURES_M, TMA)
    if FEATURES_M:
        tl.store(tile_t(p_dk, steps(BN, stride_dks, VEC), BD),
                 (b_dk * scale).to(dk_ptr.dtype.element_ty), mask=m_kv)
        tl.store(tile_t(p_dv, steps(BN, stride_dvs, VEC), BD),
                 b_dv.to(dv_ptr.dtype.element_ty), mask=m_kv)
    else:
        tl.store(tile(p_dk, steps(BN, stride_dks, VEC), BD),
                 (b_dk * scale).to(dk_ptr.dtype.element_ty), mask=m_kv)
        tl.store(tile(p_dv, steps(BN, stride_dvs, VEC), BD),
                 b_dv.to(dv_ptr.dtype.element_ty), mask=m_kv)


@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, cu_seqlens_q_ptr,
                       cu_seqlens_k_ptr, dq_ptr, stride_qb, stride_qs, stride_qh, stride_kb,
                       stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob,
                       stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh, SEQ_Q, SEQ_K,
                       TOTAL_Q, scale, cap_in, cap_out,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                       BN: tl.constexpr, BD: tl.constexpr, CAUSAL: tl.constexpr,
                       LEFT: tl.constexpr, RIGHT: tl.constexpr, PACKED: tl.constexpr,
                       SOFTCAP: tl.constexpr, VEC: tl.constexpr, UPCAST: tl.constexpr,
                       IEEE: tl.constexpr, TMA: tl.constexpr):
    """dq of one query block of one head: sum over key blocks of dS·k (no atomics). TMA: q, do,
    k and v read through tensor descriptors of the sequence (four per program)."""
    i_m, i_bh = query_block(CAUSAL), tl.program_id(1)
    i_b, i_h = i_bh // HQ, i_bh % HQ
    i_kh = i_h // (HQ // HKV)
    q_start, len_q, q_end = sequence_span(i_b, cu_seqlens_q_ptr, SEQ_Q, PACKED)
    k_start, len_k, _ = sequence_span(i_b, cu_seqlens_k_ptr, SEQ_K, PACKED)
    if PACKED:
        clear_uncovered(dq_ptr, None, None, i_b, i_h, i_m, q_start, len_q, q_end, TOTAL_Q,
                        tl.num_programs(1) // HQ, stride_dqs, stride_dqh, 0, 0, D, BM, BD, VEC)
    if i_m * BM >= len_q:
        return
    o_m = i_m * BM + tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_q = (o_m < len_q)[:, None] & m_d[None, :]
    m_first = q_start + i_m * BM
    q_src = rows_source(q_ptr, i_b, q_start, len_q, stride_qb, stride_qs, stride_qh, HQ, D, BM, BD,
                        VEC, TMA)
    do_src = rows_source(do_ptr, i_b, q_start, len_q, stride_dob, stride_dos, stride_doh, HQ, D,
                         BM, BD, VEC, TMA)
    b_q = rows(q_src, i_m * BM, i_h, len_q, stride_qs, stride_qh, steps(BM, stride_qs, VEC), m_d,
               BM, BD, VEC, TMA)
    b_do = rows(do_src, i_m * BM, i_h, len_q, stride_dos, stride_doh, steps(BM, stride_dos, VEC),
                m_d, BM, BD, VEC, TMA)
    p_row = lse_offsets(i_b, i_h, q_start, o_m, SEQ_Q, TOTAL_Q, HQ, PACKED)
    b_lse = tl.load(lse_ptr + p_row, mask=o_m < len_q, other=float("-inf"))
    b_delta = tl.load(delta_ptr + p_row, mask=o_m < len_q, other=0.0)
    qk_scale = scale * LOG2E
    b_dq = tl.zeros([BM, BD], dtype=tl.float32)
    lo, hi = key_range(i_m * BM, (i_m + 1) * BM, len_q, len_k, BN, CAUSAL, LEFT, RIGHT)
    if TMA:
        k_src = rows_source(k_ptr, i_b, k_start, len_k, stride_kb, stride_ks, stride_kh, HKV, D,
                            BN, BD, VEC, TMA)
        v_src = rows_source(v_ptr, i_b, k_start, len_k, stride_vb, stride_vs, stride_vh, HKV, D,
                            BN, BD, VEC, TMA)
    else:
        p_kt = tile_t(k_ptr + row_offsets(i_b, k_start + lo, i_kh, stride_kb, stride_ks,
                                          stride_kh, VEC), steps(BN, stride_ks, VEC), BD)  # [BD, BN]
        p_vt = tile_t(v_ptr + row_offsets(i_b, k_start + lo, i_kh, stride_vb, stride_vs,
                                          stride_vh, VEC), steps(BN, stride_vs, VEC), BD)
    for n0 in range(lo, hi, BN):
        o_n = n0 + tl.arange(0, BN)
        if TMA:
            b_kt = tl.trans(rows(k_src, n0, i_kh, len_k, stride_ks, stride_kh, None, m_d, BN, BD,
                                 VEC, TMA))
            b_vt = tl.trans(rows(v_src, n0, i_kh, len_k, stride_vs, stride_vh, None, m_d, BN, BD,
                                 VEC, TMA))
        else:
            m_kv = m_d[:, None] & (o_n < len_k)[None, :]
            b_kt = tl.load(p_kt, mask=m_kv, other=0.0)
            b_vt = tl.load(p_vt, mask=m_kv, other=0.0)
            p_kt += BN * stride_ks * VEC
            p_vt += BN * stride_vs * VEC
        b_p, b_gate = probabilities(b_q, b_kt, b_lse, o_m, o_n, len_q, len_k, qk_scale, cap_in,
                                    cap_out, CAUSAL, LEFT, RIGHT, SOFTCAP, UPCAST, IEEE, BM, BN)
        b_dp = mm(b_do, b_vt, tl.zeros([BM, BN], dtype=tl.float32), UPCAST, IEEE)
        b_ds = b_p * (b_dp - b_delta[:, None])
        if SOFTCAP:
            b_ds = b_ds * b_gate
        b_dq = mm(b_ds.to(b_q.dtype), tl.trans(b_kt), b_dq, UPCAST, IEEE)     # [BM, BN] @ [BN, BD]
    tl.store(tile(dq_ptr + row_offsets(i_b, m_first, i_h, stride_dqb, stride_dqs, stride_dqh,
                                       VEC), steps(BM, stride_dqs, VEC), BD),
             (b_dq * scale).to(dq_ptr.dtype.element_ty), mask=m_q)
