"""Cache-size arithmetic for hybrid models: recurrent Mamba2 state against the attention KV
cache (seeds/004: Nemotron 3 Ultra's 48 Mamba blocks of [256, 64, 128] hold 384 MiB of fp32 state
per sequence, reached by 12 FP8 attention layers with 2 KV heads of width 128 at 65,536 tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIB = 2 ** 20


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype, or the int itself (e.g. 1 for FP8)."""
    if isinstance(dtype, int):
        return dtype
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class HybridCacheConfig:
    """The cache-relevant shape of a hybrid model (per sequence)."""

    mamba_layers: int
    mamba_heads: int
    mamba_head_dim: int
    mamba_state: int
    attention_layers: int
    kv_heads: int
    kv_head_dim: int

    def state_bytes(self, state_dtype=torch.float32) -> int:
        """Recurrent state of every Mamba layer for one sequence."""
        return (self.mamba_layers * self.mamba_heads * self.mamba_head_dim * self.mamba_state
                * dtype_bytes(state_dtype))

    def kv_bytes_per_token(self, kv_dtype=1) -> int:
        """Keys and values of every attention layer for one token."""
        return self.attention_layers * self.kv_heads * self.kv_head_dim * 2 * dtype_bytes(kv_dtype)

    def kv_bytes(self, tokens: int, kv_dtype=1) -> int:
        return tokens * self.kv_bytes_per_token(kv_dtype)

    def crossover_tokens(self, state_dtype=torch.float32, kv_dtype=1) -> int:
        """The context length at which the KV cache reaches the recurrent state's size."""
        return math.ceil(self.state_bytes(state_dtype) / self.kv_bytes_per_token(kv_dtype))


NEMOTRON_3_ULTRA = HybridCacheConfig(mamba_layers=48, mamba_heads=256, mamba_head_dim=64,
                                     mamba_state=128, attention_layers=12, kv_heads=2,
                                     kv_head_dim=128)
