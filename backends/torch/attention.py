"""GQA attention in plain torch (the math of fusedops.attention.contract): the reference and the
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

from fusedops.attention.contract import FP8, FP8_MAX
from fusedops.core.dtypes import accumulator_dtype
from fusedops.core.status import Status

from ._autograd import autograd_recording
from .common import direct_program, report, unsupported_reason

__all__ = ["attention_backward", "attention_forward", "backward_program", "decode",
           "decode_program", "forward_program", "sanitise_offsets", "unsupported_reason",
           "valid_rows"]


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


def attention_forward(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1),
                      cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                      status=None, compute_dtype=torch.float32):
    """Returns (o, lse): o like q (in q's dtype), lse [b, h_q, s_q] (or [h_q, total_q] packed)
    in compute_dtype. q [b, s_q, h_q, d], k and v [b, s_k, h_kv, d]; packed: q [total_q, h_q, d]
    and k, v [total_k, h_kv, d] with cu_seqlens (sanitised, sequences truncated to
    max_seqlen_q/k, default unbounded; Status.CU_SEQLENS ORed into ``status`` when needed)."""
    cd = compute_dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    packed = cu_seqlens_q is not None
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
    scores = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    dev = q.device
    if packed:
        cu_q, len_q, bad_q = sanitise_offsets(cu_seqlens_q.to(dev), sq,
                                              sq if max_seqlen_q is None else max_seqlen_q)
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
                       status=None, compute_dtype=torch.float32):
    """(dq, dk, dv) in compute_dtype, by autograd through attention_forward (dk, dv at the KV
    head count: autograd sums the repeated heads; tokens no sequence covers get zeros)."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    with autograd_recording():
        o, _ = attention_forward(*leaves, causal=causal, softmax_scale=softmax_scale, window=window,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 status=status, compute_dtype=compute_dtype)
        return torch.autograd.grad(o, leaves, do.to(compute_dtype))


# -- decode with a KV cache --------------------------------------------------------------------
def quantize(values, scale):
    """values / scale saturated to the e4m3 range, as e4m3 (scale per tensor [1] or per kv head
    [h_kv], broadcast over [..., h_kv, d])."""
    return (values.float() / scale.float()[..., :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(values, scale, dtype=torch.float32):
    """The e4m3 ``values`` times their scale, in ``dtype``."""
    return values.to(dtype) * scale.to(dtype)[..., :, None]


def valid_rows(cache_seqlens, tokens: int, block_table, page_size: int, capacity: int,
               pages: int, status=None):
    """[b] bool, device side: row i is valid when 0 <= L <= capacity - T (L = cache_seqlens[i])
    and, paged, every page it needs (j·page_size < L + T) is in [0, pages). ORs
    Status.CACHE_SEQLENS / Status.BLOCK_TABLE into ``status`` for what is not."""
    lengths = cache_seqlens.to(torch.int64)
    fits = (lengths >= 0) & (lengths <= capacity - tokens)
    report(status, Status.CACHE_SEQLENS, ~fits)
    if block_table is None:
        return fits
    j = torch.arange(block_table.shape[1], device=lengths.device)
    needed = j[None, :] * page_size < (lengths + tokens)[:, None]
    table = block_table.to(torch.int64)
    bad = needed & ((table < 0) | (table >= pages))
    report(status, Status.BLOCK_TABLE, bad)
    return fits & ~bad.any(1)


def cache_slots(cache_seqlens, tokens: int, block_table, page_size: int, valid):
    """[b, T] rows of the cache viewed as [pages·page_size (or b·capacity), h_kv, d] that the
    new tokens of each valid row go to (in range); 0 for an invalid row."""
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(tokens, device=valid.device)
    pos = torch.where(valid[:, None], pos, torch.zeros_like(pos))
    if block_table is None:                     # contiguous: page_size is the capacity
        return torch.arange(pos.shape[0], device=pos.device)[:, None] * page_size + pos
    page = torch.gather(block_table.to(torch.int64), 1, pos // page_size)
    return torch.where(valid[:, None], page, torch.zeros_like(page)) * page_size + pos % page_size


def append_rows(cache, slots, values, valid) -> None:
    """cache rows ``slots`` [b, T] = ``values`` [b, T, h_kv, d] for the valid rows; nothing else
    changes. One index_put_: the entries of invalid rows repeat the first valid entry (same
    place, same value, so the order of duplicate writes cannot matter), or write cache row 0
    back onto itself when no row is valid."""
    flat = cache.view(-1, *cache.shape[2:])
    ok = valid[:, None].expand_as(slots).reshape(-1)
    idx, vals = slots.reshape(-1), values.reshape(-1, *values.shape[2:])
    first = torch.argmax(ok.to(torch.int32)).view(1)       # a tensor index: no host read
    some = ok.any()
    fallback = idx.index_select(0, first)
    idx = torch.where(ok, idx, torch.where(some, fallback, torch.zeros_like(fallback)))
    vals = torch.where(ok[:, None, None], vals, torch.where(some, vals.index_select(0, first), flat[0]))
    flat.index_put_((idx,), vals)


def decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
           softmax_scale=None, k_scale=None, v_scale=None, status=None,
           compute_dtype=torch.float32):
    """Appends k_new, v_new [b, T, h_kv, d] at cache_seqlens (in place, quantized for an fp8
    cache) and attends q [b, T, h_q, d] to the cache, causally among the new tokens. Returns
    (o [b, T, h_q, d] in q's dtype, lse [b, h_q, T] in compute_dtype). A row with an invalid
    cache length or page (``valid_rows``) writes nothing and gets o = 0, lse = -inf."""
    b, T = q.shape[:2]
    paged = block_table is not None
    page_size, pages = k_cache.shape[1], k_cache.shape[0]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    valid = valid_rows(cache_seqlens, T, block_table, page_size, capacity, pages, status)
    if k_cache.numel() and capacity >= T:       # otherwise no row can be valid
        slots = cache_slots(cache_seqlens, T, block_table, page_size, valid)
        for cache, new, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
            stored = quantize(new, scale) if cache.dtype == FP8 else new.to(cache.dtype)
            append_rows(cache, slots, stored, valid)
    if paged and pages:
        table = block_table.to(torch.int64)
        table = torch.where((table >= 0) & (table < pages), table, torch.zeros_like(table))
        keys = k_cache[table].flatten(1, 2)                     # [b, capacity, h_kv, d]
        values = v_cache[table].flatten(1, 2)
    elif paged:
        keys = values = torch.zeros(b, capacity, *k_cache.shape[2:], dtype=k_cache.dtype,
                                    device=k_cache.device)
    else:
        keys, values = k_cache, v_cache
    if k_cache.dtype == FP8:
        keys, values = dequantize(keys, k_scale, compute_dtype), dequantize(values, v_scale, compute_dtype)
    lengths = cache_seqlens.to(torch.int64)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    hq, hkv = q.shape[2], keys.shape[2]
    qf = q.to(compute_dtype).permute(0, 2, 1, 3)
    kf = keys.to(compute_dtype).permute(0, 2, 1, 3).repeat_interleave(hq // hkv, 1)
    vf = values.to(compute_dtype).permute(0, 2, 1, 3).repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    j = torch.arange(keys.shape[1], device=q.device)
    t = torch.arange(T, device=q.device)
    visible = j[None, None, :] <= (lengths[:, None, None] + t[None, :, None])
    visible &= valid[:, None, None]
    p, lse = masked_softmax(scores, visible[:, None])
    o = torch.einsum("bhqk,bhkd->bhqd", p, vf).permute(0, 2, 1, 3)
    return o.to(q.dtype), lse


# -- the backend surface -----------------------------------------------------------------------
def _options(problem, b):
    return dict(causal=problem.causal, softmax_scale=problem.scale, window=problem.window,
                cu_seqlens_q=b.get("cu_seqlens_q"), cu_seqlens_k=b.get("cu_seqlens_k"),
                max_seqlen_q=problem.seqlen_q, max_seqlen_k=problem.seqlen_k,
                status=b.get("status"), compute_dtype=accumulator_dtype(problem.dtype))


def forward_program(problem):
    def run(b):
        o, lse = attention_forward(b["q"], b["k"], b["v"], **_options(problem, b))
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
        o, lse = decode(b["q"], b["k_new"], b["v_new"], b["k_cache"], b["v_cache"],
                        b["cache_seqlens"], block_table=b.get("block_table"),
                        softmax_scale=problem.scale, k_scale=b.get("k_scale"),
                        v_scale=b.get("v_scale"), status=b.get("status"),
                        compute_dtype=accumulator_dtype(problem.dtype))
        b["o"].copy_(o)
        b["lse"].copy_(lse)
    return direct_program(run)
