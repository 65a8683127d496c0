"""GQA attention: training forward/backward and KV-cache decode (contract, plans, eager wrappers,
torch op, samples and oracle). See docs/gqa_attention.md."""

from .contract import DTYPES, FP8, MAX_HEAD_DIM, AttentionProblem, DecodeAttentionProblem
from .decode import GQAAttentionDecode, gqa_attention_decode
from .plans import (GQAAttentionBackward, GQAAttentionForward, gqa_attention_backward,
                    gqa_attention_forward)

__all__ = ["GQAAttentionBackward", "GQAAttentionDecode", "GQAAttentionForward",
           "gqa_attention_backward", "gqa_attention_decode", "gqa_attention_forward"]
