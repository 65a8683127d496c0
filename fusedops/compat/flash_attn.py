"""flash-attn's functional API over fusedops' GQA attention (no dropout, softcap or ALiBi)."""

from __future__ import annotations

import torch

from fusedops import ops
from fusedops.attention import gqa_attention_decode, gqa_attention_forward
from fusedops.errors import UnsupportedError


def _unsupported(function: str, **options) -> None:
    """Options fusedops does not implement must be off: None or 0."""
    for name, value in options.items():
        if value is None or (isinstance(value, (int, float)) and value == 0):
            continue
        shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise UnsupportedError(f"{function}: {name}: fusedops does not implement it (expected None "
                               f"or 0), got {shown}")


def _attention(q, k, v, causal, softmax_scale, window_size, return_attn_probs, **packing):
    if return_attn_probs:    # flash-attn returns (out, softmax_lse, S_dmask); no dropout mask here
        o, lse = gqa_attention_forward(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                       window_size=tuple(window_size), **packing)
        return o, lse, None
    return ops.gqa_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                             window_size=tuple(window_size), **packing)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """q [b, s_q, h_q, d], k, v [b, s_k, h_kv, d] -> out like q (differentiable; always
    deterministic). With return_attn_probs: (out, softmax_lse [b, h_q, s_q], None)."""
    _unsupported("flash_attn_func", dropout_p=dropout_p, softcap=softcap, alibi_slopes=alibi_slopes)
    return _attention(q, k, v, causal, softmax_scale, window_size, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Packed sequences: q [total_q, h_q, d], k, v [total_k, h_kv, d], cu_seqlens int32."""
    _unsupported("flash_attn_varlen_func", dropout_p=dropout_p, softcap=softcap,
                 alibi_slopes=alibi_slopes, block_table=block_table)
    return _attention(q, k, v, causal, softmax_scale, window_size,
                      return_attn_probs, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """Appends k, v [b, T, h_kv, d] at cache_seqlens (which it does not advance) and attends q
    [b, T, h_q, d] to the cache; contiguous [b, capacity, h_kv, d] or paged caches
    (block_table). Decoding steps: T new tokens, causal among themselves."""
    _unsupported("flash_attn_with_kvcache", rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, softcap=softcap,
                 alibi_slopes=alibi_slopes)
    if k is None or v is None:
        raise UnsupportedError("flash_attn_with_kvcache: k, v: expected the new tokens' keys and "
                               "values to append (attending without appending is not implemented)")
    if tuple(window_size) != (-1, -1):
        raise UnsupportedError(f"flash_attn_with_kvcache: window_size: expected (-1, -1), got {window_size!r}")
    if not causal and q.shape[1] > 1:
        raise UnsupportedError("flash_attn_with_kvcache: causal: expected True for more than one "
                               "new token (the decode kernel is causal among the new tokens)")
    b = q.shape[0]
    if cache_seqlens is None:
        raise UnsupportedError("flash_attn_with_kvcache: cache_seqlens: expected the cached lengths")
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    o, lse = gqa_attention_decode(q, k, v, k_cache, v_cache, cache_seqlens.to(torch.int32),
                                  block_table=block_table, softmax_scale=softmax_scale,
                                  num_splits=num_splits or None)
    return (o, lse) if return_softmax_lse else o
