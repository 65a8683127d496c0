"""GQA attention in plain torch (the math of fusedops.attention.contract): the reference and the
CPU path.

Masks follow FlashAttention: with offset = s_k - s_q (per sequence when packed), query i may see
key j when j <= i + offset (causal, bottom-right aligned) and, with a window (left, right),
i + offset - left <= j <= i + offset + right (-1: unbounded). A row that sees no key gives o = 0
and lse = -inf. The softmax is computed without NaNs for such rows, so autograd through it (the
torch backend's backward) gives zero gradients there.
"""

from __future__ import annotations

import math

import torch

from fusedops.attention.contract import FP8, FP8_MAX
from fusedops.core.dtypes import accumulator_dtype

from ._autograd import autograd_recording
from .common import direct_program, unsupported_reason

__all__ = ["attention_backward", "attention_forward", "backward_program", "decode",
           "decode_program", "forward_program", "unsupported_reason"]


def key_mask(cu_q, cu_k, total_q: int, total_k: int, causal: bool, window):
    """[total_q, total_k] mask: the query's sequence (from cu_q) may see the key (from cu_k)."""
    dev = cu_q.device
    tq, tk = torch.arange(total_q, device=dev), torch.arange(total_k, device=dev)
    seq = torch.searchsorted(cu_q[1:], tq, right=True).clamp(max=cu_q.numel() - 2)
    len_q, len_k = (cu_q[1:] - cu_q[:-1])[seq], (cu_k[1:] - cu_k[:-1])[seq]
    i = (tq - cu_q[seq])[:, None]
    j = tk[None, :] - cu_k[seq][:, None]
    offset = (len_k - len_q)[:, None]
    ok = (j >= 0) & (j < len_k[:, None])
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
                      cu_seqlens_q=None, cu_seqlens_k=None, compute_dtype=torch.float32):
    """Returns (o, lse): o like q (in q's dtype), lse [b, h_q, s_q] (or [h_q, total_q] packed)
    in compute_dtype. q [b, s_q, h_q, d], k and v [b, s_k, h_kv, d]; packed: q [total_q, h_q, d]
    and k, v [total_k, h_kv, d] with cu_seqlens."""
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
        cu_q, cu_k = cu_seqlens_q.to(dev, torch.int64), cu_seqlens_k.to(dev, torch.int64)
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
                       cu_seqlens_q=None, cu_seqlens_k=None, compute_dtype=torch.float32):
    """(dq, dk, dv) in compute_dtype, by autograd through attention_forward (dk, dv at the KV
    head count: autograd sums the repeated heads)."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    with autograd_recording():
        o, _ = attention_forward(*leaves, causal=causal, softmax_scale=softmax_scale, window=window,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                 compute_dtype=compute_dtype)
        return torch.autograd.grad(o, leaves, do.to(compute_dtype))


# -- decode with a KV cache --------------------------------------------------------------------
def quantize(values, scale):
    """values / scale saturated to the e4m3 range, as e4m3 (scale per tensor [1] or per kv head
    [h_kv], broadcast over [..., h_kv, d])."""
    return (values.float() / scale.float()[..., :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(values, scale, dtype=torch.float32):
    """The e4m3 ``values`` times their scale, in ``dtype``."""
    return values.to(dtype) * scale.to(dtype)[..., :, None]


def cache_positions(cache_seqlens, tokens: int, block_table, page_size: int, capacity: int):
    """(page or row index, offset, in range) of the new tokens' cache positions [b, T]."""
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(tokens, device=cache_seqlens.device)
    ok = pos < capacity
    pos_c = torch.where(ok, pos, torch.zeros_like(pos))
    if block_table is None:
        rows = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        return rows, pos_c, ok
    pages = torch.gather(block_table.to(torch.int64), 1, pos_c // page_size)
    return pages, pos_c % page_size, ok


def decode(q, k_new, v_new, k_cache, v_cache, cache_seqlens, *, block_table=None,
           softmax_scale=None, k_scale=None, v_scale=None, compute_dtype=torch.float32):
    """Appends k_new, v_new [b, T, h_kv, d] at cache_seqlens (in place, quantized for an fp8
    cache) and attends q [b, T, h_q, d] to the cache, causally among the new tokens. Returns
    (o [b, T, h_q, d] in q's dtype, lse [b, h_q, T] in compute_dtype). Positions past the cache
    are not written."""
    b, T = q.shape[:2]
    paged = block_table is not None
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    rows, offs, ok = cache_positions(cache_seqlens, T, block_table, page_size, capacity)
    for cache, new, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        stored = quantize(new, scale) if cache.dtype == FP8 else new.to(cache.dtype)
        current = cache[rows, offs]
        cache.index_put_((rows, offs), torch.where(ok[..., None, None], stored, current))
    if paged:
        keys = k_cache[block_table.to(torch.int64)].flatten(1, 2)       # [b, capacity, h_kv, d]
        values = v_cache[block_table.to(torch.int64)].flatten(1, 2)
    else:
        keys, values = k_cache, v_cache
    if k_cache.dtype == FP8:
        keys, values = dequantize(keys, k_scale, compute_dtype), dequantize(values, v_scale, compute_dtype)
    lengths = cache_seqlens.to(torch.int64) + T                         # keys per row after the append
    lengths = lengths.clamp(max=capacity)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    hq, hkv = q.shape[2], keys.shape[2]
    qf = q.to(compute_dtype).permute(0, 2, 1, 3)
    kf = keys.to(compute_dtype).permute(0, 2, 1, 3).repeat_interleave(hq // hkv, 1)
    vf = values.to(compute_dtype).permute(0, 2, 1, 3).repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    j = torch.arange(keys.shape[1], device=q.device)
    t = torch.arange(T, device=q.device)
    visible = j[None, None, :] <= (cache_seqlens.to(torch.int64)[:, None, None] + t[None, :, None])
    visible &= j[None, None, :] < lengths[:, None, None]
    p, lse = masked_softmax(scores, visible[:, None])
    o = torch.einsum("bhqk,bhkd->bhqd", p, vf).permute(0, 2, 1, 3)
    return o.to(q.dtype), lse


# -- the backend surface -----------------------------------------------------------------------
def _options(problem, b):
    return dict(causal=problem.causal, softmax_scale=problem.scale, window=problem.window,
                cu_seqlens_q=b.get("cu_seqlens_q"), cu_seqlens_k=b.get("cu_seqlens_k"),
                compute_dtype=accumulator_dtype(problem.dtype))


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
                        v_scale=b.get("v_scale"), compute_dtype=accumulator_dtype(problem.dtype))
        b["o"].copy_(o)
        b["lse"].copy_(lse)
    return direct_program(run)
