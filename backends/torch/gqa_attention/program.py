"""GQA attention in plain torch (the math of fusedops.gqa_attention.contract): the reference and the
CPU path.

Masks follow FlashAttention: with offset = s_k - s_q (per sequence when packed), query i may see
key j when j <= i + offset (causal, bottom-right aligned) and, with a window (left, right),
i + offset - left <= j <= i + offset + right (-1: unbounded). A row that sees no key gives o = 0
and lse = -inf. The softmax is computed without NaNs for such rows, so autograd through it (the
torch backend's backward) gives zero gradients there.

Index data (docs/plans.md, "Index data") is sanitised with device ops before use, never read on
the host: packed offsets as c' = clamp(cummax(c), 0, total), each sequence truncated to
max_seqlen (tokens no sequence covers see nothing: o = 0, lse = -inf, zero gradients); a decode
row with an invalid cache length or page appends nothing and sees nothing. The status word gets
the bits of what was found.
"""

from __future__ import annotations

import math

import torch

from fusedops.gqa_attention.contract import FP8, FP8_MAX
from fusedops.core.dtypes import accumulator_dtype
from fusedops.core.status import Status

from .._autograd import autograd_recording
from ..common import direct_program, report, unsupported_reason

__all__ = ["attention_backward", "attention_forward", "backward_program", "decode",
           "decode_program", "forward_program", "rotate", "sanitise_offsets",
           "unsupported_reason", "valid_rows"]


def sanitise_offsets(cu, total: int, longest: int):
    """(c', lengths, bad) of packed offsets ``cu`` [nseq + 1] (any values): c'[0] = clamp(c[0], 0,
    total), c'[i] = clamp(c[i], c'[i-1], total) (= clamp(cummax(c), 0, total)); sequence i
    covers its first lengths[i] = min(c'[i+1] - c'[i], longest) tokens; ``bad``: a device bool,
    the offsets needed sanitising (not starting at 0, decreasing, past ``total``) or a sequence
    is longer than ``longest``."""
    c = cu.to(torch.int64)
    s = torch.cummax(c, 0).values.clamp(0, total)
    spans = s[1:] - s[:-1]
    bad = (c[0] != 0) | (c[1:] < c[:-1]).any() | (c[-1] > total) | (spans > longest).any()
    return s, spans.clamp(max=longest), bad


def key_mask(cu_q, cu_k, total_q: int, total_k: int, causal: bool, window, len_q=None, len_k=None):
    """[total_q, total_k] mask: the query's sequence (from cu_q, non-decreasing) may see the key
    (from cu_k). ``len_q``, ``len_k``: the tokens each sequence covers (default: all its
    tokens); a query no sequence covers sees no key."""
    dev = cu_q.device
    tq, tk = torch.arange(total_q, device=dev), torch.arange(total_k, device=dev)
    len_q = cu_q[1:] - cu_q[:-1] if len_q is None else len_q
    len_k = cu_k[1:] - cu_k[:-1] if len_k is None else len_k
    seq = torch.searchsorted(cu_q[1:], tq, right=True).clamp(max=cu_q.numel() - 2)
    i_q = tq - cu_q[seq]
    len_q, len_k = len_q[seq], len_k[seq]
    i = i_q[:, None]
    j = tk[None, :] - cu_k[seq][:, None]
    offset = (len_k - len_q)[:, None]
    ok = (j >= 0) & (j < len_k[:, None]) & ((i_q >= 0) & (i_q < len_q))[:, None]
    if causal:
        ok &= j <= i + offset
    left, right = window
    if left >= 0:
        ok &= j >= i + offset - left
    if right >= 0:
        ok &= j <= i + offset + right
    return ok


def masked_softmax(scores, mask):
    """(probabilities, lse) of scores [..., s_q, s_k] where mask holds; rows without any key
    give zero probabilities and lse = -inf, without producing NaN anywhere."""
    if scores.shape[-1] == 0:
        return scores, torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype,
                                  device=scores.device)
    s = scores.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    lse = torch.where(total > 0, m + torch.log(torch.where(total > 0, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return p, lse[..., 0]


def scores_of(q, k, scale: float, softcap: float):
    """scale·q kᵀ [b, h, s_q, s_k] of q [b, h, s_q, d], k [b, h, s_k, d]; with softcap c > 0,
    c·tanh(scale·q kᵀ / c)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    return softcap * torch.tanh(s / softcap) if softcap else s


def paged_keys(k, v, block_table, cu_k, longest: int, status=None):
    """A paged prefill's keys as packed sequences: (k, v [nseq·cap, h_kv, d], offsets i·cap,
    the key lengths) of pages k, v [num_pages, page, h_kv, d] read through block_table [nseq,
    max_pages]; a sequence that needs a page outside the pool gets no keys
    (Status.BLOCK_TABLE)."""
    nseq, max_pages = block_table.shape
    page, pages = k.shape[1], k.shape[0]
    cap = max_pages * page
    _, len_k, bad = sanitise_offsets(cu_k, nseq * longest, longest)
    table = block_table.to(torch.int64)
    j = torch.arange(max_pages, device=table.device)
    wrong = (j[None, :] * page < len_k[:, None]) & ((table < 0) | (table >= pages))
    report(status, Status.BLOCK_TABLE, wrong)
    len_k = torch.where(wrong.any(1), torch.zeros_like(len_k), len_k)
    safe = torch.where((table >= 0) & (table < pages), table, torch.zeros_like(table))
    if not pages:
        keys = values = k.new_zeros(nseq * cap, *k.shape[2:])
    else:     # rows past a sequence's keys may hold anything (NaN): zeros, as the kernels mask
        live = (torch.arange(cap, device=table.device)[None, :] < len_k[:, None]).reshape(-1)
        keys = torch.where(live[:, None, None], k[safe].flatten(0, 2), 0)
        values = torch.where(live[:, None, None], v[safe].flatten(0, 2), 0)
    offsets = torch.arange(nseq + 1, device=table.device) * cap
    return keys, values, offsets, len_k, bad


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1),
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      softcap=0.0, block_table=None, status=None, compute_dtype=torch.float32):
    """Returns (o, lse): o like q (in q's dtype), lse [b, h_q, s_q] (or [h_q, total_q] packed)
    in compute_dtype. q [b, s_q, h_q, d], k and v [b, s_k, h_kv, d]; packed: q [total_q, h_q, d]
    and k, v [total_k, h_kv, d] with cu_seqlens (sanitised, sequences truncated to
    max_seqlen_q/k, default unbounded; Status.CU_SEQLENS ORed into ``status`` when needed), or
    paged k, v [num_pages, page, h_kv, d] with block_table (``paged_keys``). Views of any
    strides are read as they are (no copies)."""
    cd = compute_dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    packed = cu_seqlens_q is not None
    dev = q.device
    if block_table is not None:
        k, v, cu_k, len_k, bad_k = paged_keys(k, v, block_table, cu_seqlens_k.to(dev),
                                              max_seqlen_k, status)
    if packed:
        q4, k4, v4 = q[None], k[None], v[None]
    else:
        q4, k4, v4 = q, k, v
    b, sq, hq, d = q4.shape
    sk, hkv = k4.shape[1], k4.shape[2]
    rep = hq // hkv
    qf = q4.to(cd).permute(0, 2, 1, 3)                                   # [b, hq, sq, d]
    kf = k4.to(cd).permute(0, 2, 1, 3).repeat_interleave(rep, 1)         # [b, hq, sk, d]
    vf = v4.to(cd).permute(0, 2, 1, 3).repeat_interleave(rep, 1)
    scores = scores_of(qf, kf, scale, softcap)
    if packed:
        cu_q, len_q, bad_q = sanitise_offsets(cu_seqlens_q.to(dev), sq,
                                              sq if max_seqlen_q is None else max_seqlen_q)
        if block_table is None:
            cu_k, len_k, bad_k = sanitise_offsets(cu_seqlens_k.to(dev), sk,
                                                  sk if max_seqlen_k is None else max_seqlen_k)
        report(status, Status.CU_SEQLENS, bad_q | bad_k)
        mask = key_mask(cu_q, cu_k, sq, sk, causal, window, len_q, len_k)[None, None]
    else:
        cu_q = torch.tensor([0, sq], device=dev)
        cu_k = torch.tensor([0, sk], device=dev)
        mask = key_mask(cu_q, cu_k, sq, sk, causal, window)[None, None]
    p, lse = masked_softmax(scores, mask)
    o = torch.einsum("bhqk,bhkd->bhqd", p, vf).permute(0, 2, 1, 3)        # [b, sq, hq, d]
    if packed:
        return o[0].to(q.dtype), lse[0]
    return o.to(q.dtype), lse


def attention_backward(q, k, v, do, *, causal=False, softmax_scale=None, window=(-1, -1),
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                       softcap=0.0, status=None, compute_dtype=torch.float32):
    """(dq, dk, dv) in compute_dtype, by autograd through attention_forward (dk, dv at the KV
    head count: autograd sums the repeated heads; tokens no sequence covers get zeros)."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    with autograd_recording():
        o, _ = attention_forward(*leaves, causal=causal, softmax_scale=softmax_scale, window=window,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 softcap=softcap, status=status, compute_dtype=compute_dtype)
        return torch.autograd.grad(o, leaves, do.to(compute_dtype))


# -- decode with a KV cache --------------------------------------------------------------------
def quantize(values, scale):
    """values / scale saturated to the e4m3 range, as e4m3 (scale per tensor [1] or per kv head
    [h_kv], broadcast over [..., h_kv, d])."""
    return (values.float() / scale.float()[..., :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(values, scale, dtype=torch.float32):
    """The e4m3 ``values`` times their scale, in ``dtype``."""
    return values.to(dtype) * scale.to(dtype)[..., :, None]


def valid_rows(cache_seqlens, new_tokens: int, block_table, page_size: int, capacity: int,
               pages: int, status=None, *, cache_batch_idx=None, cache_leftpad=None,
               rotary_room: int | None = None):
    """([b] bool, [b] int64 cache rows), device side: row i is valid when 0 <= L <= capacity - N
    (L = cache_seqlens[i]; and L <= ``rotary_room`` with rotary), 0 <= cache_leftpad[i] <= L,
    its cache row c = cache_batch_idx[i] (default i) is below ``pages`` (negative: padding) and,
    appending, no earlier row has the same c, and, paged, every page it needs (j·page_size <
    L + N) is in [0, pages). ORs Status.CACHE_SEQLENS / BLOCK_TABLE / SLOT_INDEX into ``status``
    for what is not (padding rows excepted). The cache rows of invalid rows are 0."""
    lengths = cache_seqlens.to(torch.int64)
    b = lengths.shape[0]
    fits = (lengths >= 0) & (lengths <= capacity - new_tokens)
    if rotary_room is not None:
        fits &= lengths <= rotary_room
    if cache_leftpad is not None:
        pad = cache_leftpad.to(torch.int64)
        fits &= (pad >= 0) & (pad <= lengths)
    report(status, Status.CACHE_SEQLENS, ~fits)
    rows = torch.arange(b, device=lengths.device)
    if cache_batch_idx is not None:
        rows = cache_batch_idx.to(torch.int64)
        wrong = rows >= pages
        if new_tokens:
            earlier = torch.ones(b, b, dtype=torch.bool, device=rows.device).tril(-1)
            wrong |= ((rows[:, None] == rows[None, :]) & earlier).any(1) & (rows >= 0)
        report(status, Status.SLOT_INDEX, wrong)
        fits &= ~wrong & (rows >= 0)
    if block_table is not None:
        j = torch.arange(block_table.shape[1], device=lengths.device)
        needed = j[None, :] * page_size < (lengths + new_tokens)[:, None]
        table = block_table.to(torch.int64)
        bad = needed & ((table < 0) | (table >= pages))
        report(status, Status.BLOCK_TABLE, bad)
        fits &= ~bad.any(1)
    return fits, torch.where(fits, rows, torch.zeros_like(rows))


def cache_slots(cache_seqlens, new_tokens: int, block_table, page_size: int, rows, valid):
    """(first, second) index tensors [b, N] of the 4-D cache positions the new tokens of each
    valid row go to: (cache row, position), or paged (page, row in page); in range (0) for an
    invalid row."""
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(new_tokens, device=valid.device)
    pos = torch.where(valid[:, None], pos, torch.zeros_like(pos))
    if block_table is None:
        return rows[:, None].expand_as(pos), pos
    page = torch.gather(block_table.to(torch.int64), 1, pos // page_size)
    return torch.where(valid[:, None], page, torch.zeros_like(page)), pos % page_size


def append_rows(cache, slots, values, valid) -> None:
    """cache[slots] = ``values`` [b, N, h_kv, d] for the valid rows; nothing else changes. One
    index_put_ on the (possibly strided) 4-D cache: the entries of invalid rows repeat the first
    valid entry (same place, same value, so the order of duplicate writes cannot matter), or
    write cache position (0, 0) back onto itself when no row is valid."""
    ok = valid[:, None].expand_as(slots[0]).reshape(-1)
    first, second = (s.reshape(-1) for s in slots)
    vals = values.reshape(-1, *values.shape[2:])
    pick = torch.argmax(ok.to(torch.int32)).view(1)          # a tensor index: no host read
    some = ok.any()
    zero = torch.zeros_like(pick)
    first = torch.where(ok, first, torch.where(some, first.index_select(0, pick), zero))
    second = torch.where(ok, second, torch.where(some, second.index_select(0, pick), zero))
    vals = torch.where(ok[:, None, None], vals,
                       torch.where(some, vals.index_select(0, pick), cache[0, 0][None]))
    cache.index_put_((first, second), vals)


def rotate(x, cos, sin, positions, interleaved: bool, compute_dtype):
    """x [b, t, h, d] rotated on its first r = 2·cos.shape[1] features at ``positions`` [b, t]
    (clamped to the table) in compute_dtype, rounded back to x's dtype: pairs (x0, x1), ... (interleaved)
    or halves (x[:r/2], x[r/2:r]) map to (x1 cos - x2 sin, x1 sin + x2 cos)."""
    half = cos.shape[1]
    positions = positions.clamp(0, cos.shape[0] - 1)
    c = cos.to(compute_dtype)[positions][:, :, None, :]                 # [b, t, 1, r/2]
    s = sin.to(compute_dtype)[positions][:, :, None, :]
    xr = x[..., :2 * half].to(compute_dtype)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1)
    return torch.cat((out, x[..., 2 * half:].to(compute_dtype)), -1).to(x.dtype)


def decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
           cache_batch_idx=None, cache_leftpad=None, softmax_scale=None, k_scale=None,
           v_scale=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=False, causal=True,
           window=(-1, -1), softcap=0.0, status=None, compute_dtype=torch.float32):
    """Appends k_new, v_new [b, N, h_kv, d] (None: nothing) at cache_seqlens (in place, rotated
    with rotary, quantized for an fp8 cache) and attends q [b, T, h_q, d] (rotated with rotary)
    to each row's keys [cache_leftpad, cache_seqlens + N), bottom-right aligned (offset =
    cache_seqlens + N - T) with ``causal`` and ``window``. Returns (o [b, T, h_q, d] in q's
    dtype, lse [b, h_q, T] in compute_dtype). A row with invalid index data (``valid_rows``)
    writes nothing and gets o = 0, lse = -inf. The caches may be strided views."""
    b, T = q.shape[:2]
    N = 0 if k_new is None else k_new.shape[1]
    paged = block_table is not None
    page_size, pages = k_cache.shape[1], k_cache.shape[0]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    rotary = rotary_cos is not None
    rotary_queries = T if causal or tuple(window) != (-1, -1) else 1
    room = rotary_cos.shape[0] - rotary_queries if rotary else None
    valid, rows = valid_rows(cache_seqlens, N, block_table, page_size, capacity, pages, status,
                             cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                             rotary_room=room)
    lengths = torch.where(valid, cache_seqlens.to(torch.int64), torch.zeros_like(rows))
    if rotary:
        t_q = torch.arange(T, device=q.device) if rotary_queries == T else torch.zeros(
            T, dtype=torch.int64, device=q.device)
        q = rotate(q, rotary_cos, rotary_sin, lengths[:, None] + t_q, rotary_interleaved,
                   compute_dtype)
        k_new = rotate(k_new, rotary_cos, rotary_sin,
                       lengths[:, None] + torch.arange(N, device=q.device), rotary_interleaved,
                       compute_dtype)
    if N and k_cache.numel() and capacity >= N:       # otherwise no row can append
        slots = cache_slots(cache_seqlens, N, block_table, page_size, rows, valid)
        for cache, new, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
            stored = quantize(new, scale) if cache.dtype == FP8 else new.to(cache.dtype)
            append_rows(cache, slots, stored, valid)
    if paged and pages:
        table = block_table.to(torch.int64)
        table = torch.where((table >= 0) & (table < pages), table, torch.zeros_like(table))
        keys = k_cache[table].flatten(1, 2)                     # [b, capacity, h_kv, d]
        values = v_cache[table].flatten(1, 2)
    elif paged or not pages:
        keys = values = torch.zeros(b, capacity, *k_cache.shape[2:], dtype=k_cache.dtype,
                                    device=k_cache.device)
    else:
        keys, values = k_cache[rows], v_cache[rows]             # the rows' caches (a gather)
    if k_cache.dtype == FP8:
        keys, values = dequantize(keys, k_scale, compute_dtype), dequantize(values, v_scale, compute_dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    hq, hkv = q.shape[2], keys.shape[2]
    qf = q.to(compute_dtype).permute(0, 2, 1, 3)
    kf = keys.to(compute_dtype).permute(0, 2, 1, 3).repeat_interleave(hq // hkv, 1)
    vf = values.to(compute_dtype).permute(0, 2, 1, 3).repeat_interleave(hq // hkv, 1)
    scores = scores_of(qf, kf, scale, softcap)
    j = torch.arange(keys.shape[1], device=q.device)[None, None, :]
    t = torch.arange(T, device=q.device)[None, :, None]
    end = (lengths + N)[:, None, None]
    diagonal = t + end - T                                      # the key each query is aligned to
    visible = (j < end) & valid[:, None, None] & (t >= 0)       # [b, T, capacity]
    if cache_leftpad is not None:
        visible &= j >= cache_leftpad.to(torch.int64)[:, None, None]
    left, right = window
    if causal:
        visible &= j <= diagonal
    if left >= 0:
        visible &= j >= diagonal - left
    if right >= 0:
        visible &= j <= diagonal + right
    p, lse = masked_softmax(scores, visible[:, None])
    # positions no query sees may hold anything (an uninitialised cache): never multiplied in
    vf = torch.where(visible.any(1)[:, None, :, None], vf, 0)
    o = torch.einsum("bhqk,bhkd->bhqd", p, vf).permute(0, 2, 1, 3)
    return o.to(q.dtype), lse


# -- the backend surface -----------------------------------------------------------------------
def _options(problem, b):
    return dict(causal=problem.causal, softmax_scale=problem.scale, window=problem.window,
                cu_seqlens_q=b.get("cu_seqlens_q"), cu_seqlens_k=b.get("cu_seqlens_k"),
                max_seqlen_q=problem.seqlen_q, max_seqlen_k=problem.seqlen_k,
                softcap=problem.softcap, status=b.get("status"),
                compute_dtype=accumulator_dtype(problem.dtype))


def forward_program(problem):
    def run(b):
        o, lse = attention_forward(b["q"], b["k"], b["v"], block_table=b.get("block_table"),
                                   **_options(problem, b))
        b["o"].copy_(o)
        b["lse"].copy_(lse)
    return direct_program(run)


def backward_program(problem):
    def run(b):
        grads = attention_backward(b["q"], b["k"], b["v"], b["do"], **_options(problem, b))
        for name, value in zip(("dq", "dk", "dv"), grads):
            b[name].copy_(value)
    return direct_program(run)


def decode_program(problem):
    def run(b):
        o, lse = decode(b["q"], b.get("k_new"), b.get("v_new"), b["k_cache"], b["v_cache"],
                        b["cache_seqlens"], block_table=b.get("block_table"),
                        cache_batch_idx=b.get("cache_batch_idx"),
                        cache_leftpad=b.get("cache_leftpad"), softmax_scale=problem.scale,
                        k_scale=b.get("k_scale"), v_scale=b.get("v_scale"),
                        rotary_cos=b.get("rotary_cos"), rotary_sin=b.get("rotary_sin"),
                        rotary_interleaved=problem.rotary_interleaved, causal=problem.causal,
                        window=problem.window, softcap=problem.softcap, status=b.get("status"),
                        compute_dtype=accumulator_dtype(problem.dtype))
        b["o"].copy_(o)
        b["lse"].copy_(lse)
    return direct_program(run)
