"""GQA attention decode with a KV cache: Triton kernels.

append: the N new tokens' k, v go into the cache at cache_seqlens (device-side; rotated with
rotary, quantized to e4m3 with per-tensor or per-kv-head scales for an FP8 cache; N = 0: nothing
is appended). Every program first decides its row's validity (docs/plans.md, "Index data": 0 <=
cache_seqlens <= capacity - N, 0 <= cache_leftpad <= cache_seqlens, the rotary positions in the
table, the cache row below the cache's rows and, appending, not an earlier row's, and, paged,
every page the row needs in [0, pages)) and writes nothing for an invalid row; the row's first
program leaves the verdict in the workspace (row_ok) and reports the status bits. With rotary,
the programs past the k/v blocks rotate q into the workspace (q_rot), which the split kernel
reads instead of q.
split: flash-decoding. A program owns one KV head of one row and one of NUM_SPLITS fixed key
ranges; its queries are the T queries of all the head's query heads (T·G rows, so K and V are
read once per KV head), masked bottom-right aligned (offset = L + N - T: causal, window) to the
row's keys [cache_leftpad, L + N); it writes a normalised partial output and its lse (an invalid
row reads nothing: lse = -inf). combine: the partials are merged in fp32 with their lse weights
(all -inf: o = 0, lse = -inf).
Every tensor is addressed through its strides (batch or page, position, head; in units of a
16-byte vector, VEC elements of the tensor's dtype): q, k_new, v_new, o and the caches may be
views. Nothing depends on host-side lengths: split ranges are fixed by the cache capacity, empty
ones write lse = -inf. Absent operands are compiled out as None and read only under their
flags: block_table under PAGED, cache_batch_idx under BATCH_IDX, cache_leftpad under LEFTPAD,
k_scale and v_scale under FP8, the rotary tables under ROTARY.
"""

import triton
import triton.language as tl

from .kernels import LN2, LOG2E, bad_pages, log2_scores, row_offsets
from ..primitives import mm, report_if
from ..rounding import nearest_even_on_grid


@triton.jit
def row_check(i_b, cache_seqlens_ptr, block_table_ptr, cache_batch_idx_ptr, cache_leftpad_ptr, N,
              CAPACITY, PAGES, ROOM, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
              PAGED: tl.constexpr, BATCH_IDX: tl.constexpr, LEFTPAD: tl.constexpr,
              APPEND: tl.constexpr, TABLE_BLOCK: tl.constexpr):
    """(cache length, cache row, bad length, bad page, bad slot, padding) of row i_b: the length
    outside [0, min(CAPACITY - N, ROOM)] or the left padding outside [0, length]; (paged) a page
    the row needs (j·PAGE < length + N) outside [0, PAGES); the cache row (cache_batch_idx) at or
    past PAGES or, appending, an earlier row's; a negative cache row: padding."""
    length = tl.load(cache_seqlens_ptr + i_b).to(tl.int64)
    bad_length = (length < 0) | (length > CAPACITY - N) | (length > ROOM)
    if LEFTPAD:
        pad = tl.load(cache_leftpad_ptr + i_b)
        bad_length |= (pad < 0) | (pad > length)
    bad_page = bad_length & False                   # no pages to check (contiguous cache)
    if PAGED:
        need = tl.maximum(length + N, 0)
        wrong = bad_pages(block_table_ptr + i_b.to(tl.int64) * MAX_PAGES,
                          tl.minimum((need + PAGE - 1) // PAGE, MAX_PAGES), PAGES, TABLE_BLOCK)
        bad_page = wrong > 0
    row = i_b
    bad_slot = bad_length & False
    padding = bad_length & False
    if BATCH_IDX:
        row = tl.load(cache_batch_idx_ptr + i_b)
        padding = row < 0
        bad_slot = row >= PAGES
        if APPEND:                                  # one appending row per cache row
            count = i_b * 0
            for j0 in range(0, i_b, TABLE_BLOCK):
                o_j = j0 + tl.arange(0, TABLE_BLOCK)
                m = o_j < i_b
                count += tl.sum((m & (tl.load(cache_batch_idx_ptr + o_j, mask=m, other=-1) == row)
                                 ).to(tl.int32), 0)
            bad_slot |= (count > 0) & ~padding
    return length, row, bad_length, bad_page, bad_slot, padding


@triton.jit
def cache_offset(row, pos, block_table_ptr, i_b, stride_b, stride_s, PAGE: tl.constexpr,
                 MAX_PAGES: tl.constexpr, PAGED: tl.constexpr, VEC: tl.constexpr):
    """int64 element offset of position pos of a row's cache: (PAGED) row pos % PAGE of page
    block_table[i_b, pos // PAGE], else position pos of cache row ``row``."""
    if PAGED:
        page = tl.load(block_table_ptr + i_b.to(tl.int64) * MAX_PAGES + pos // PAGE).to(tl.int64)
        return page * stride_b * VEC + (pos % PAGE) * stride_s * VEC
    else:
        return row.to(tl.int64) * stride_b * VEC + pos * stride_s * VEC


@triton.jit
def rotated(src_ptr, base, o, m, pos, cos_ptr, sin_ptr, D: tl.constexpr, HALF: tl.constexpr,
            INTERLEAVED: tl.constexpr, ROTARY: tl.constexpr):
    """The BLOCK elements o (flattened head·D + feature, at base + head offset) of one token,
    in fp32; ROTARY: the first 2·HALF features of each head rotated at position pos (pairs
    (x0, x1), ... INTERLEAVED, else halves): (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)."""
    x = tl.load(src_ptr + base + o % D, mask=m, other=0.0).to(tl.float32)
    if ROTARY:
        f = o % D
        rot = m & (f < 2 * HALF)
        if INTERLEAVED:
            partner = f ^ 1
            idx = f // 2
            sign = tl.where(f % 2 == 0, -1.0, 1.0)
        else:
            first = f < HALF
            partner = tl.where(first, f + HALF, f - HALF)
            idx = tl.where(first, f, f - HALF)
            sign = tl.where(first, -1.0, 1.0)
        xp = tl.load(src_ptr + base + partner, mask=rot, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + pos * HALF + idx, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + pos * HALF + idx, mask=rot, other=0.0).to(tl.float32)
        x = tl.where(rot, x * c + sign * xp * s, x)
    return x


@triton.jit
def stored(b_x, scale_ptr, o, m, D: tl.constexpr, FP8: tl.constexpr,
           SCALE_PER_HEAD: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_NEAREST: tl.constexpr):
    """What the cache holds for fp32 values b_x: themselves, or (FP8) value / scale saturated to
    ±FP8_MAX (rounded to nearest-even e4m3 on the grid when EXACT_NEAREST)."""
    if FP8:
        if SCALE_PER_HEAD:
            b_scale = tl.load(scale_ptr + o // D, mask=m, other=1.0)
        else:
            b_scale = tl.load(scale_ptr)
        b_x = tl.minimum(tl.maximum(b_x / b_scale, -FP8_MAX), FP8_MAX)
        if EXACT_NEAREST:       # e4m3: 3 mantissa bits, smallest normal exponent -6
            b_x = nearest_even_on_grid(b_x, 3, -6)
    return b_x


@triton.jit
def decode_append_kernel(q_ptr, k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr,
                         block_table_ptr, cache_batch_idx_ptr, cache_leftpad_ptr, k_scale_ptr,
                         v_scale_ptr, rotary_cos_ptr, rotary_sin_ptr, q_rot_ptr, row_ok_ptr,
                         status_ptr, stride_qb, stride_qt, stride_qh, stride_knb, stride_knt,
                         stride_knh, stride_vnb, stride_vnt, stride_vnh, stride_kcb, stride_kcs,
                         stride_kch, stride_vcb, stride_vcs, stride_vch, T, N, CAPACITY, PAGES,
                         ROOM,
                         HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                         KV_BLOCKS: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                         PAGED: tl.constexpr, BATCH_IDX: tl.constexpr, LEFTPAD: tl.constexpr,
                         APPEND: tl.constexpr, ROTARY: tl.constexpr, HALF: tl.constexpr,
                         INTERLEAVED: tl.constexpr, ROTATE_EACH_QUERY: tl.constexpr,
                         FP8: tl.constexpr, SCALE_PER_HEAD: tl.constexpr, FP8_MAX: tl.constexpr,
                         EXACT_NEAREST: tl.constexpr, TABLE_BLOCK: tl.constexpr,
                         LENGTH_BIT: tl.constexpr, TABLE_BIT: tl.constexpr,
                         SLOT_BIT: tl.constexpr, HAS_STATUS: tl.constexpr, VEC: tl.constexpr,
                         VEC_C: tl.constexpr):
    """Grid (b, max(N, T with rotary, 1), KV_BLOCKS + (q blocks with rotary)): program (i, t, c)
    appends block c of token t's k and v (c < KV_BLOCKS, t < N) or rotates block c - KV_BLOCKS
    of query t into q_rot; every program checks the row first, the row's first program records
    the verdict."""
    i_b, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length, row, bad_length, bad_page, bad_slot, padding = row_check(
        i_b, cache_seqlens_ptr, block_table_ptr, cache_batch_idx_ptr, cache_leftpad_ptr, N,
        CAPACITY, PAGES, ROOM, PAGE, MAX_PAGES, PAGED, BATCH_IDX, LEFTPAD, APPEND, TABLE_BLOCK)
    bad = bad_length | bad_page | bad_slot | padding
    if (i_t == 0) & (i_c == 0):
        tl.store(row_ok_ptr + i_b, tl.where(bad, 0, 1))
        report_if(status_ptr, bad_length, LENGTH_BIT, HAS_STATUS)
        report_if(status_ptr, bad_page, TABLE_BIT, HAS_STATUS)
        report_if(status_ptr, bad_slot, SLOT_BIT, HAS_STATUS)
    if bad:                                         # decided before any write
        return
    if i_c < KV_BLOCKS:
        if APPEND:
            if i_t < N:
                pos = length + i_t                  # < CAPACITY: the row is valid
                o = i_c * BLOCK + tl.arange(0, BLOCK)
                m = o < HKV * D
                head = o // D
                dst = cache_offset(row, pos, block_table_ptr, i_b, stride_kcb, stride_kcs, PAGE,
                                   MAX_PAGES, PAGED, VEC_C)
                dst_v = cache_offset(row, pos, block_table_ptr, i_b, stride_vcb, stride_vcs, PAGE,
                                     MAX_PAGES, PAGED, VEC_C)
                src_k = row_offsets(i_b, i_t, 0, stride_knb, stride_knt, 0, VEC) + \
                    head * stride_knh * VEC
                src_v = row_offsets(i_b, i_t, 0, stride_vnb, stride_vnt, 0, VEC) + \
                    head * stride_vnh * VEC
                b_k = stored(rotated(k_new_ptr, src_k, o, m, pos, rotary_cos_ptr, rotary_sin_ptr,
                                     D, HALF, INTERLEAVED, ROTARY),
                             k_scale_ptr, o, m, D, FP8, SCALE_PER_HEAD, FP8_MAX, EXACT_NEAREST)
                b_v = stored(rotated(v_new_ptr, src_v, o, m, pos, rotary_cos_ptr, rotary_sin_ptr,
                                     D, HALF, INTERLEAVED, False),
                             v_scale_ptr, o, m, D, FP8, SCALE_PER_HEAD, FP8_MAX, EXACT_NEAREST)
                tl.store(k_cache_ptr + dst + head * stride_kch * VEC_C + o % D,
                         b_k.to(k_cache_ptr.dtype.element_ty), mask=m)
                tl.store(v_cache_ptr + dst_v + head * stride_vch * VEC_C + o % D,
                         b_v.to(v_cache_ptr.dtype.element_ty), mask=m)
    elif ROTARY:
        if i_t < T:
            o = (i_c - KV_BLOCKS) * BLOCK + tl.arange(0, BLOCK)
            m = o < HQ * D
            pos = length
            if ROTATE_EACH_QUERY:
                pos += i_t
            src = row_offsets(i_b, i_t, 0, stride_qb, stride_qt, 0, VEC) + (o // D) * stride_qh * VEC
            b_q = rotated(q_ptr, src, o, m, pos, rotary_cos_ptr, rotary_sin_ptr, D, HALF,
                          INTERLEAVED, True)
            tl.store(q_rot_ptr + (i_b.to(tl.int64) * T + i_t) * (HQ * D) + o,
                     b_q.to(q_rot_ptr.dtype.element_ty), mask=m)


@triton.jit
def _split_scores(b_q, n0, o_bn, m_r, m_d, in_k, in_vt, end, first, diagonal, row, i_b,
                  k_cache_ptr, v_cache_ptr, block_table_ptr, stride_kcb, stride_kcs, stride_vcb,
                  stride_vcs, qk_scale, cap_in, cap_out, BM: tl.constexpr, BN: tl.constexpr,
                  PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, PAGED: tl.constexpr,
                  CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                  SOFTCAP: tl.constexpr, FP8: tl.constexpr, VEC_C: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """(Sᵀ [BN, BM] in the log2 domain, -inf where a position is hidden or outside [first,
    end); vᵀ [BD, BN] in q's dtype) of the BN cache positions from n0 (one page's: BN divides
    PAGE)."""
    o_n = n0 + o_bn
    m_n = (o_n < end) & (o_n >= first)
    k0 = cache_offset(row, n0, block_table_ptr, i_b, stride_kcb, stride_kcs, PAGE, MAX_PAGES,
                      PAGED, VEC_C)
    v0 = cache_offset(row, n0, block_table_ptr, i_b, stride_vcb, stride_vcs, PAGE, MAX_PAGES,
                      PAGED, VEC_C)
    b_k = tl.load(k_cache_ptr + k0 + in_k, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_vt = tl.load(v_cache_ptr + v0 + in_vt, mask=m_n[None, :] & m_d[:, None], other=0.0)
    if FP8:
        b_k = b_k.to(b_q.dtype)
        b_vt = b_vt.to(b_q.dtype)
    b_st, _ = log2_scores(mm(b_k, tl.trans(b_q), tl.zeros([BN, BM], dtype=tl.float32), UPCAST,
                             IEEE), qk_scale, cap_in, cap_out, SOFTCAP)           # [BN, BM]
    ok = m_n[:, None] & m_r[None, :]
    if CAUSAL:
        ok &= o_n[:, None] <= diagonal[None, :]
    if LEFT >= 0:
        ok &= o_n[:, None] >= diagonal[None, :] - LEFT
    if RIGHT >= 0:
        ok &= o_n[:, None] <= diagonal[None, :] + RIGHT
    return tl.where(ok, b_st, float("-inf")), b_vt


@triton.jit
def _split_softmax(b_st, b_m, b_l, b_acc, dtype: tl.constexpr):
    """The online softmax down the columns of Sᵀ: the new running max and sum per query row,
    oᵀ rescaled to the new max, and Pᵀ in ``dtype``."""
    b_m_new = tl.maximum(b_m, tl.max(b_st, axis=0))
    b_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_pt = tl.exp2(b_st - b_safe[None, :])
    b_alpha = tl.exp2(b_m - b_safe)
    b_l = b_l * b_alpha + tl.sum(b_pt, axis=0)
    return b_m_new, b_l, b_acc * b_alpha[None, :], b_pt.to(dtype)


@triton.jit
def decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr, block_table_ptr,
                        cache_batch_idx_ptr, cache_leftpad_ptr, k_scale_ptr, v_scale_ptr,
                        row_ok_ptr, o_part_ptr, lse_part_ptr, stride_qb, stride_qt, stride_qh,
                        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, T,
                        N, CAPACITY, scale, cap_in, cap_out,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr,
                        SPLIT_LEN: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                        PAGED: tl.constexpr, BATCH_IDX: tl.constexpr, LEFTPAD: tl.constexpr,
                        CAUSAL: tl.constexpr, LEFT: tl.constexpr, RIGHT: tl.constexpr,
                        SOFTCAP: tl.constexpr, FP8: tl.constexpr, SCALE_PER_HEAD: tl.constexpr,
                        VEC: tl.constexpr, VEC_C: tl.constexpr, UPCAST: tl.constexpr,
                        IEEE: tl.constexpr):
    i_bk, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_kh = i_bk // HKV, i_bk % HKV
    G: tl.constexpr = HQ // HKV
    length = tl.load(cache_seqlens_ptr + i_b).to(tl.int64)
    # an invalid row (decided by the append kernel) reads nothing; a valid one ends in the cache
    total = tl.where(tl.load(row_ok_ptr + i_b) != 0, length + N, 0)
    offset = total - T                              # query t's diagonal key: t + offset
    first = total * 0
    if LEFTPAD:
        first = tl.maximum(first, tl.load(cache_leftpad_ptr + i_b).to(tl.int64))
    lo = first
    hi = total
    if LEFT >= 0:
        lo = tl.maximum(lo, offset - LEFT)
    if CAUSAL:
        hi = tl.minimum(hi, offset + T)
    if RIGHT >= 0:
        hi = tl.minimum(hi, offset + T + RIGHT)
    row = i_b
    if BATCH_IDX:
        row = tl.maximum(tl.load(cache_batch_idx_ptr + i_b), 0)    # valid rows: in range
    start = tl.maximum(i_s * SPLIT_LEN, (lo // BN) * BN)            # whole BN tiles of a page
    end = tl.minimum(i_s * SPLIT_LEN + SPLIT_LEN, hi)
    o_r = tl.arange(0, BM)                         # row r = query (r // G), query head g (r % G)
    m_r = o_r < T * G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    r_t, r_g = o_r // G, o_r % G
    p_q = row_offsets(i_b, r_t, i_kh * G + r_g, stride_qb, stride_qt, stride_qh, VEC)
    b_q = tl.load(q_ptr + p_q[:, None] + o_d[None, :], mask=m_r[:, None] & m_d[None, :], other=0.0)
    if FP8:
        if SCALE_PER_HEAD:
            k_scale = tl.load(k_scale_ptr + i_kh)
            v_scale = tl.load(v_scale_ptr + i_kh)
        else:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        qk_scale = scale * LOG2E * k_scale
        cap_in = cap_in * k_scale
    else:
        qk_scale = scale * LOG2E
    diagonal = r_t + offset
    # a tile's keys from its first position's (int64) offset: BN positions of one page and the
    # head, small int32 offsets computed once
    o_bn = tl.arange(0, BN)
    in_k = (o_bn * stride_kcs * VEC_C + i_kh * stride_kch * VEC_C)[:, None] + o_d[None, :]
    in_vt = (o_bn * stride_vcs * VEC_C + i_kh * stride_vch * VEC_C)[None, :] + o_d[:, None]
    # every product transposed, the BN cache positions (and then the BD features) as M: the
    # T·G query rows (16 at the production shapes) are below wgmma's and tcgen05's 64, the
    # positions and features are not; the softmax runs down the columns
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BD, BM], dtype=tl.float32)                               # oᵀ
    # each step issues this block's scores, then the previous block's vᵀ Pᵀ, then the softmax
    # of this block, which runs while the tensor cores compute that product
    b_pt = tl.zeros([BN, BM], dtype=b_q.dtype)
    b_vt = tl.zeros([BD, BN], dtype=b_q.dtype)
    if start < end:
        b_st, b_vt = _split_scores(b_q, start, o_bn, m_r, m_d, in_k, in_vt, end, first, diagonal,
                                   row, i_b, k_cache_ptr, v_cache_ptr, block_table_ptr, stride_kcb,
                                   stride_kcs, stride_vcb, stride_vcs, qk_scale, cap_in, cap_out,
                                   BM, BN, PAGE, MAX_PAGES, PAGED, CAUSAL, LEFT, RIGHT, SOFTCAP,
                                   FP8, VEC_C, UPCAST, IEEE)
        b_m, b_l, b_acc, b_pt = _split_softmax(b_st, b_m, b_l, b_acc, b_q.dtype)
    for n0 in range(start + BN, end, BN):
        b_st, b_vt_next = _split_scores(b_q, n0, o_bn, m_r, m_d, in_k, in_vt, end, first, diagonal,
                                        row, i_b, k_cache_ptr, v_cache_ptr, block_table_ptr,
                                        stride_kcb, stride_kcs, stride_vcb, stride_vcs, qk_scale,
                                        cap_in, cap_out, BM, BN, PAGE, MAX_PAGES, PAGED, CAUSAL,
                                        LEFT, RIGHT, SOFTCAP, FP8, VEC_C, UPCAST, IEEE)
        b_acc = mm(b_vt, b_pt, b_acc, UPCAST, IEEE)                 # [BD, BN] @ [BN, BM]
        b_m, b_l, b_acc, b_pt = _split_softmax(b_st, b_m, b_l, b_acc, b_q.dtype)
        b_vt = b_vt_next
    if start < end:
        b_acc = mm(b_vt, b_pt, b_acc, UPCAST, IEEE)
    if FP8:
        b_acc *= v_scale
    seen = b_l > 0
    b_o = b_acc / tl.where(seen, b_l, 1.0)[None, :]                          # [BD, BM]
    part = i_bk.to(tl.int64) * SPLITS + i_s
    tl.store(o_part_ptr + (part * BM + o_r)[None, :] * BD + o_d[:, None], b_o)
    tl.store(lse_part_ptr + part * BM + o_r,
             tl.where(seen, b_m + tl.log2(tl.where(seen, b_l, 1.0)), float("-inf")))


@triton.jit
def decode_combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, stride_ob, stride_ot,
                          stride_oh, T,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                          BD: tl.constexpr, SPLITS: tl.constexpr, VEC: tl.constexpr):
    """o = sum_s exp2(lse_s - lse) o_s over the splits, in fp32; lse in natural log."""
    i_bk = tl.program_id(0)
    i_b, i_kh = i_bk // HKV, i_bk % HKV
    G: tl.constexpr = HQ // HKV
    o_r = tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    base = i_bk.to(tl.int64) * SPLITS
    b_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    for i_s in range(SPLITS):
        b_max = tl.maximum(b_max, tl.load(lse_part_ptr + (base + i_s) * BM + o_r))
    b_safe = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_sum = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    for i_s in range(SPLITS):
        b_w = tl.exp2(tl.load(lse_part_ptr + (base + i_s) * BM + o_r) - b_safe)
        b_sum += b_w
        b_acc += b_w[:, None] * tl.load(o_part_ptr + ((base + i_s) * BM + o_r)[:, None] * BD + o_d[None, :])
    seen = b_sum > 0
    b_o = b_acc / tl.where(seen, b_sum, 1.0)[:, None]
    r_t, r_g = o_r // G, o_r % G
    m_r = o_r < T * G
    head = i_kh * G + r_g
    p_o = row_offsets(i_b, r_t, head, stride_ob, stride_ot, stride_oh, VEC)
    tl.store(o_ptr + p_o[:, None] + o_d[None, :], b_o.to(o_ptr.dtype.element_ty),
             mask=m_r[:, None] & (o_d < D)[None, :])
    b_lse = tl.where(seen, (b_safe + tl.log2(tl.where(seen, b_sum, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + (i_b.to(tl.int64) * HQ + head) * T + r_t, b_lse, mask=m_r)
