"""flash-attn's functional API over fusedops' GQA attention.

Served: flash_attn_func, flash_attn_varlen_func (paged prefill with block_table: forward only),
the packed variants (flash_attn_qkvpacked_func, flash_attn_kvpacked_func,
flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func: zero-copy views over the
unpacked ones) and flash_attn_with_kvcache (append or attend only, causal or not, window,
softcap, cache_batch_idx, cache_leftpad, rotary, paged caches). softcap works everywhere.
Refused with an UnsupportedError naming the argument: dropout_p > 0 (fusedops kernels are
deterministic inference/training kernels without an RNG) and alibi_slopes (no Nemotron model
uses ALiBi). ``deterministic`` is accepted and ignored: every fusedops backward is deterministic.
With ``return_attn_probs=True`` the functions return (out, softmax_lse, None): the dropout mask /
attention probabilities S_dmask flash-attn returns only for testing with dropout are not
materialised, and out stays differentiable.
"""

from __future__ import annotations

import torch

from fusedops import ops
from fusedops.gqa_attention import gqa_attention_decode, gqa_attention_forward
from fusedops.errors import UnsupportedError, ValidationError

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]

_WHY = dict(dropout_p="fusedops kernels draw no random numbers (deterministic training)",
            alibi_slopes="no ALiBi bias in the fusedops kernels")


def _unsupported(function: str, **options) -> None:
    """Options fusedops does not implement must be off (None or 0): UnsupportedError naming the
    function, the argument, the reason and the value."""
    for name, value in options.items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and value == 0):
            continue
        shown = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
                 else repr(value))
        raise UnsupportedError(f"{function}: {name}: fusedops does not implement it ({_WHY[name]}; "
                               f"expected None or 0), got {shown}")


def _attention(q, k, v, causal, softmax_scale, window_size, softcap, return_attn_probs,
               **packing):
    """The differentiable op (o, and lse when return_attn_probs: flash-attn's (out,
    softmax_lse, S_dmask) with S_dmask None)."""
    result = ops.gqa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               window_size=tuple(window_size), softcap=softcap,
                               return_lse=bool(return_attn_probs), **packing)
    return (*result, None) if return_attn_probs else result


def _split(function: str, name: str, packed, count: int, ndim: int, layout: str):
    """The ``count`` views packed[..., i, :, :] (unbind: no copy) of a packed tensor."""
    if not isinstance(packed, torch.Tensor) or packed.ndim != ndim or packed.shape[-3] != count:
        shown = list(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValidationError(f"{function}: {name}: expected {layout}, got {shown}")
    return packed.unbind(-3)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [b, s_q, h_q, d], k, v [b, s_k, h_kv, d] (views with the last dimension contiguous go in
    without a copy) -> out like q, differentiable (always deterministic). causal, window_size,
    softmax_scale and softcap (0: off; S = softcap·tanh(scale·q kᵀ / softcap)) as in flash-attn.
    With return_attn_probs: (out, softmax_lse [b, h_q, s_q] fp32, None), out still
    differentiable. dropout_p > 0 and alibi_slopes: UnsupportedError."""
    _unsupported("flash_attn_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    return _attention(q, k, v, causal, softmax_scale, window_size, softcap, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Packed sequences: q [total_q, h_q, d], k, v [total_k, h_kv, d], cu_seqlens_q/k [nseq + 1]
    int32, max_seqlen_q/k ints -> out like q, differentiable; with return_attn_probs (out,
    softmax_lse [h_q, total_q], None). Paged prefill: k, v pages [num_pages, page_size, h_kv, d]
    (page_size a multiple of 16) read through block_table [nseq, max_pages] int32, forward only
    (UnsupportedError when a gradient is required, as flash-attn computes none either).
    dropout_p > 0 and alibi_slopes: UnsupportedError."""
    function = "flash_attn_varlen_func"
    _unsupported(function, dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    packing = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))
    if block_table is None:
        return _attention(q, k, v, causal, softmax_scale, window_size, softcap,
                          return_attn_probs, **packing)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k, v)):
        raise UnsupportedError(f"{function}: block_table: paged prefill is forward only (expected "
                               f"no gradient required, or torch.no_grad()), got inputs that "
                               f"require grad")
    o, lse = gqa_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                   window_size=tuple(window_size), softcap=softcap,
                                   block_table=block_table, **packing)
    return (o, lse, None) if return_attn_probs else o


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv [b, s, 3, h, d] -> flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...):
    the three views go in without a copy (the gradient of qkv is assembled by autograd)."""
    _unsupported("flash_attn_qkvpacked_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    q, k, v = _split("flash_attn_qkvpacked_func", "qkv", qkv, 3, 5, "[b, s, 3, h, d]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q [b, s_q, h_q, d], kv [b, s_k, 2, h_kv, d] -> flash_attn_func(q, kv[:, :, 0],
    kv[:, :, 1], ...) on views (no copy)."""
    _unsupported("flash_attn_kvpacked_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    k, v = _split("flash_attn_kvpacked_func", "kv", kv, 2, 5, "[b, s_k, 2, h_kv, d]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv [total, 3, h, d] with cu_seqlens [nseq + 1] int32, max_seqlen ->
    flash_attn_varlen_func on the views qkv[:, 0], qkv[:, 1], qkv[:, 2] (no copy), the same
    offsets for queries and keys."""
    _unsupported("flash_attn_varlen_qkvpacked_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    q, k, v = _split("flash_attn_varlen_qkvpacked_func", "qkv", qkv, 3, 4, "[total, 3, h, d]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False,
                                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                    deterministic=False, return_attn_probs=False):
    """q [total_q, h_q, d], kv [total_k, 2, h_kv, d] -> flash_attn_varlen_func(q, kv[:, 0],
    kv[:, 1], ...) on views (no copy)."""
    _unsupported("flash_attn_varlen_kvpacked_func", dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    k, v = _split("flash_attn_varlen_kvpacked_func", "kv", kv, 2, 4, "[total_k, 2, h_kv, d]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never on a CPU build)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _lengths(function: str, cache_seqlens, q, k, k_cache, block_table):
    """cache_seqlens as an int32 [b] tensor: an int broadcast; None (attend only) the whole
    cache."""
    b = q.shape[0]
    if cache_seqlens is None:
        if k is not None:
            raise ValidationError(f"{function}: cache_seqlens: expected the cached lengths (an int "
                                  f"or an int32 [b] tensor) with k, v to append, got None")
        capacity = (block_table.shape[1] * k_cache.shape[1] if block_table is not None
                    else k_cache.shape[1])
        cache_seqlens = capacity
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise ValidationError(f"{function}: cache_seqlens: expected an int or an int32 [b] tensor, "
                              f"got {type(cache_seqlens).__name__}")
    return cache_seqlens.to(torch.int32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's decode step: appends k, v [b, N, h_kv, d] (in place) at cache_seqlens, which
    it does not advance, then attends q [b, T, h_q, d] to each row's keys [cache_leftpad,
    cache_seqlens + N), bottom-right aligned (causal, window_size, softcap as in training). k =
    v = None: attend only (cache_seqlens None: the whole cache). Caches: contiguous [rows,
    capacity, h_kv, d] (rows = b, or any with cache_batch_idx [b] int32, a negative entry a
    padding row) or paged [num_pages, page_size, h_kv, d] with block_table [b, max_pages];
    views such as kv_cache[:, :, 0] go in without a copy. rotary_cos, rotary_sin
    [seqlen_ro >= capacity, rotary_dim / 2] (with k, v): q and the appended k rotated at their
    positions (q at cache_seqlens + t when causal or windowed, else all at cache_seqlens),
    interleaved pairs or halves (``rotary_interleaved``, default True as in flash-attn).
    num_splits 0: the default split. Returns out [b, T, h_q, d] (not differentiable), with
    return_softmax_lse (out, lse [b, h_q, T] fp32).

    Rows that would append past the capacity (cache_seqlens + N > capacity), and other invalid
    index data: in eager mode the cached lengths and indices are read on the host first and a
    ValidationError names the row (flash-attn's tests expect an error). While a CUDA graph is
    being captured nothing is read on the host: the kernel then writes nothing for that row,
    gives it out = 0, lse = -inf, and reports Status.CACHE_SEQLENS into a status word when the
    plan has one (use fusedops.gqa_attention_decode with ``status=``). alibi_slopes:
    UnsupportedError."""
    function = "flash_attn_with_kvcache"
    _unsupported(function, alibi_slopes=alibi_slopes)
    if (k is None) != (v is None):
        raise ValidationError(f"{function}: k, v: expected both (tokens to append) or neither "
                              f"(attend only), got {'k' if k is not None else 'v'} alone")
    lengths = _lengths(function, cache_seqlens, q, k, k_cache, block_table)
    o, lse = gqa_attention_decode(
        q, k, v, k_cache, v_cache, lengths, block_table=block_table,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        softmax_scale=softmax_scale, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        num_splits=num_splits or None, causal=causal, window_size=tuple(window_size),
        softcap=softcap, rotary_interleaved=rotary_interleaved, check_inputs=not _capturing())
    return (o, lse) if return_softmax_lse else o
