"""The operators as differentiable torch ops.

Every operator is a ``torch.library`` custom op (``torch.ops.fusedops.*``) with a fake
implementation (shapes from the plan, no computation), so it traces under
``torch.compile(fullgraph=True)``, and an autograd formula that calls the backward op, so it
works in eager mode and with activation checkpointing. The forward's ``saved`` buffer is kept
by reference for the backward (no copies). Activations go in as they are when the plans take
their layout (last dimension contiguous, rows 16-byte aligned: views of a fused projection
included) and are made contiguous otherwise; gradients come back in the inputs' dtypes. Each family defines its ops in ``fusedops/<family>/ops.py``.

    o = fusedops.ops.gqa_attention(q, k, v, causal=True)
    o.sum().backward()
"""

from .engram_gate.ops import engram_gate
from .mamba2_scan.ops import mamba2_chunk_scan
from .gqa_attention.ops import gqa_attention
from .relu2_moe.ops import moe_router, relu2_moe

__all__ = ["engram_gate"]
__all__ += ["mamba2_chunk_scan"]
__all__ += ["gqa_attention"]
__all__ += ["moe_router", "relu2_moe"]
