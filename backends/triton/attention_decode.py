"""GQA attention decode with a KV cache: Triton kernels.

append: the new tokens' k, v go into the cache at cache_seqlens (device-side; quantized to e4m3
with per-tensor or per-kv-head scales for an FP8 cache). Every program first decides its row's
validity (docs/plans.md, "Index data": 0 <= cache_seqlens <= capacity - T and, paged, every
page the row needs in [0, pages)) and writes nothing for an invalid row; the row's first program
leaves the verdict in the workspace (row_ok) and reports the status bits.
split: flash-decoding. A program owns one KV head of one row and one of NUM_SPLITS fixed key
ranges; its queries are the T new tokens of all the head's query heads (T·G rows, so K and V are
read once per KV head), causal among the new tokens; it writes a normalised partial output and
its lse (an invalid row reads nothing: lse = -inf). combine: the partials are merged in fp32
with their lse weights (all -inf: o = 0, lse = -inf).
Nothing depends on host-side lengths: split ranges are fixed by the cache capacity, empty ones
write lse = -inf. Absent operands are compiled out as None and read only under their flags:
block_table under PAGED, k_scale and v_scale under FP8.
"""

import triton
import triton.language as tl

from .attention_kernels import LN2, LOG2E
from .tiles import mm, report_if
from .rounding import nearest_even_on_grid


@triton.jit
def row_check(i_b, cache_seqlens_ptr, block_table_ptr, T, CAPACITY, PAGES, PAGE: tl.constexpr,
              MAX_PAGES: tl.constexpr, PAGED: tl.constexpr, TABLE_BLOCK: tl.constexpr):
    """(cache length, bad length, bad page) of row i_b: the length outside [0, CAPACITY - T];
    (paged) a page the row needs (j·PAGE < length + T) outside [0, PAGES)."""
    length = tl.load(cache_seqlens_ptr + i_b).to(tl.int64)
    bad_length = (length < 0) | (length > CAPACITY - T)
    bad_page = bad_length & False                   # no pages to check (contiguous cache)
    if PAGED:
        need = tl.maximum(length + T, 0)
        pages_needed = tl.minimum((need + PAGE - 1) // PAGE, MAX_PAGES)
        count = i_b * 0
        for p0 in range(0, pages_needed, TABLE_BLOCK):
            o_p = p0 + tl.arange(0, TABLE_BLOCK)
            m = o_p < pages_needed
            page = tl.load(block_table_ptr + i_b.to(tl.int64) * MAX_PAGES + o_p, mask=m, other=0)
            count += tl.sum((m & ((page < 0) | (page >= PAGES))).to(tl.int32), 0)
        bad_page = count > 0
    return length, bad_length, bad_page


@triton.jit
def cache_row(i_b, pos, block_table_ptr, CAPACITY, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
              PAGED: tl.constexpr):
    """Row of the cache (in units of HKV·D elements) holding position pos of row i_b."""
    if PAGED:
        page = tl.load(block_table_ptr + i_b * MAX_PAGES + pos // PAGE).to(tl.int64)
        return page * PAGE + pos % PAGE
    else:
        return i_b.to(tl.int64) * CAPACITY + pos


@triton.jit
def append_one(new_ptr, cache_ptr, scale_ptr, src, dst, o, m, D: tl.constexpr, FP8: tl.constexpr,
               SCALE_PER_HEAD: tl.constexpr, FP8_MAX: tl.constexpr, EXACT_NEAREST: tl.constexpr):
    b_x = tl.load(new_ptr + src, mask=m, other=0.0)
    if FP8:
        if SCALE_PER_HEAD:
            b_scale = tl.load(scale_ptr + o // D, mask=m, other=1.0)
        else:
            b_scale = tl.load(scale_ptr)
        b_x = tl.minimum(tl.maximum(b_x.to(tl.float32) / b_scale, -FP8_MAX), FP8_MAX)
        if EXACT_NEAREST:       # e4m3: 3 mantissa bits, smallest normal exponent -6
            b_x = nearest_even_on_grid(b_x, 3, -6)
    tl.store(cache_ptr + dst, b_x.to(cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def decode_append_kernel(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr,
                         block_table_ptr, k_scale_ptr, v_scale_ptr, row_ok_ptr, status_ptr, T,
                         CAPACITY, PAGES, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                         PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, PAGED: tl.constexpr,
                         FP8: tl.constexpr, SCALE_PER_HEAD: tl.constexpr, FP8_MAX: tl.constexpr,
                         EXACT_NEAREST: tl.constexpr, TABLE_BLOCK: tl.constexpr,
                         LENGTH_BIT: tl.constexpr, TABLE_BIT: tl.constexpr,
                         HAS_STATUS: tl.constexpr):
    i_b, i_t, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length, bad_length, bad_page = row_check(i_b, cache_seqlens_ptr, block_table_ptr, T, CAPACITY,
                                             PAGES, PAGE, MAX_PAGES, PAGED, TABLE_BLOCK)
    bad = bad_length | bad_page
    if (i_t == 0) & (i_c == 0):
        tl.store(row_ok_ptr + i_b, tl.where(bad, 0, 1))
        report_if(status_ptr, bad_length, LENGTH_BIT, HAS_STATUS)
        report_if(status_ptr, bad_page, TABLE_BIT, HAS_STATUS)
    if bad:                                         # decided before any write
        return
    pos = length + i_t                              # < CAPACITY: the row is valid
    row = cache_row(i_b, pos, block_table_ptr, CAPACITY, PAGE, MAX_PAGES, PAGED)
    o = i_c * BLOCK + tl.arange(0, BLOCK)
    m = o < HKV * D
    src = (i_b.to(tl.int64) * T + i_t) * (HKV * D) + o
    dst = row * (HKV * D) + o
    append_one(k_new_ptr, k_cache_ptr, k_scale_ptr, src, dst, o, m, D, FP8, SCALE_PER_HEAD,
               FP8_MAX, EXACT_NEAREST)
    append_one(v_new_ptr, v_cache_ptr, v_scale_ptr, src, dst, o, m, D, FP8, SCALE_PER_HEAD,
               FP8_MAX, EXACT_NEAREST)


@triton.jit
def decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, cache_seqlens_ptr, block_table_ptr,
                        k_scale_ptr, v_scale_ptr, row_ok_ptr, o_part_ptr, lse_part_ptr, T, CAPACITY,
                        scale,
                        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BD: tl.constexpr, SPLITS: tl.constexpr,
                        SPLIT_LEN: tl.constexpr, PAGE: tl.constexpr, MAX_PAGES: tl.constexpr,
                        PAGED: tl.constexpr, FP8: tl.constexpr, SCALE_PER_HEAD: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr):
    i_bk, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_kh = i_bk // HKV, i_bk % HKV
    G: tl.constexpr = HQ // HKV
    length = tl.load(cache_seqlens_ptr + i_b).to(tl.int64)
    # an invalid row (decided by the append kernel) reads nothing; a valid one ends in the cache
    total = tl.where(tl.load(row_ok_ptr + i_b) != 0, tl.minimum(length + T, CAPACITY), 0)
    start = i_s * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, total)
    o_r = tl.arange(0, BM)                         # row r = token (r // G), query head g (r % G)
    m_r = o_r < T * G
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    r_t, r_g = o_r // G, o_r % G
    p_q = (i_b.to(tl.int64) * T + r_t)[:, None] * (HQ * D) + (i_kh * G + r_g)[:, None] * D + o_d[None, :]
    b_q = tl.load(q_ptr + p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)
    if FP8:
        if SCALE_PER_HEAD:
            k_scale = tl.load(k_scale_ptr + i_kh)
            v_scale = tl.load(v_scale_ptr + i_kh)
        else:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        qk_scale = scale * LOG2E * k_scale
    else:
        qk_scale = scale * LOG2E
    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    for n0 in range(start, end, BN):
        o_n = n0 + tl.arange(0, BN)
        m_n = o_n < end
        row0 = cache_row(i_b, n0, block_table_ptr, CAPACITY, PAGE, MAX_PAGES, PAGED)   # BN divides PAGE
        p_kv = (row0 + tl.arange(0, BN))[:, None] * (HKV * D) + i_kh * D + o_d[None, :]
        b_k = tl.load(k_cache_ptr + p_kv, mask=m_n[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(v_cache_ptr + p_kv, mask=m_n[:, None] & m_d[None, :], other=0.0)
        if FP8:
            b_k = b_k.to(b_q.dtype)
            b_v = b_v.to(b_q.dtype)
        b_s = mm(b_q, tl.trans(b_k), tl.zeros([BM, BN], dtype=tl.float32), UPCAST, IEEE) * qk_scale
        ok = m_r[:, None] & m_n[None, :] & (o_n[None, :] <= length + r_t[:, None])
        b_s = tl.where(ok, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_safe = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_p = tl.exp2(b_s - b_safe[:, None])
        b_alpha = tl.exp2(b_m - b_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = mm(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], UPCAST, IEEE)
        b_m = b_m_new
    if FP8:
        b_acc *= v_scale
    seen = b_l > 0
    b_o = b_acc / tl.where(seen, b_l, 1.0)[:, None]
    part = i_bk.to(tl.int64) * SPLITS + i_s
    tl.store(o_part_ptr + (part * BM + o_r)[:, None] * BD + o_d[None, :], b_o)
    tl.store(lse_part_ptr + part * BM + o_r,
             tl.where(seen, b_m + tl.log2(tl.where(seen, b_l, 1.0)), float("-inf")))


@triton.jit
def decode_combine_kernel(o_part_ptr, lse_part_ptr, o_ptr, lse_ptr, T,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                          BD: tl.constexpr, SPLITS: tl.constexpr):
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
    p_o = (i_b.to(tl.int64) * T + r_t)[:, None] * (HQ * D) + head[:, None] * D + o_d[None, :]
    tl.store(o_ptr + p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_r[:, None] & (o_d < D)[None, :])
    b_lse = tl.where(seen, (b_safe + tl.log2(tl.where(seen, b_sum, 1.0))) * LN2, float("-inf"))
    tl.store(lse_ptr + (i_b.to(tl.int64) * HQ + head) * T + r_t, b_lse, mask=m_r)
