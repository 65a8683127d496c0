"""Distributed fusedops: expert-parallel MoE and context-parallel Mamba2 and GQA attention on
torch.distributed (NCCL on GPUs, gloo on CPU); docs/distributed.md."""

from .attention import context_parallel_gqa_attention
from .layout import Piece, SequenceLayout
from .mamba2 import context_parallel_mamba2_scan
from .moe import ExpertParallelMoE, expert_capacity
from .moe_op import expert_parallel_relu2_moe

__all__ = ["ExpertParallelMoE", "Piece", "SequenceLayout", "context_parallel_gqa_attention",
           "context_parallel_mamba2_scan", "expert_capacity", "expert_parallel_relu2_moe"]
