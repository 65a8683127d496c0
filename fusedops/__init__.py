"""fusedops: fused GPU operators for hybrid LLMs, as plans (validate -> compile -> execute)
and eager wrappers. See docs/getting_started.md."""

from . import errors
from ._cache import cache_clear, cache_info
from ._desc import TensorDesc
from ._tupledict import TupleDict
from .engram import (EngramGateSavedBackward, EngramGateSavedForward, engram_gate_saved_backward,
                     engram_gate_saved_forward)

__version__ = "0.1.0"

__all__ = [
    "EngramGateSavedBackward", "EngramGateSavedForward", "TensorDesc", "TupleDict",
    "cache_clear", "cache_info", "engram_gate_saved_backward", "engram_gate_saved_forward",
    "errors",
]
from .mamba2 import (Mamba2ChunkScanBackward, Mamba2ChunkScanForward, mamba2_chunk_scan_backward,
                     mamba2_chunk_scan_forward)

__all__ += ["Mamba2ChunkScanBackward", "Mamba2ChunkScanForward", "mamba2_chunk_scan_backward",
            "mamba2_chunk_scan_forward"]
from .mamba2_inference import (Mamba2StateRollback, Mamba2StateUpdate, mamba2_replay,
                               mamba2_rollback, mamba2_state_update)

__all__ += ["Mamba2StateRollback", "Mamba2StateUpdate", "mamba2_replay", "mamba2_rollback",
            "mamba2_state_update"]
from .attention import (GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward,
                        gqa_attention_backward, gqa_attention_decode, gqa_attention_forward)

__all__ += ["GQAAttentionBackward", "GQAAttentionDecode", "GQAAttentionForward",
            "gqa_attention_backward", "gqa_attention_decode", "gqa_attention_forward"]
from .moe import (MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward, moe_router,
                  moe_router_backward, relu2_moe_backward, relu2_moe_forward)

__all__ += ["MoERouter", "MoERouterBackward", "ReLU2MoEBackward", "ReLU2MoEForward", "moe_router",
            "moe_router_backward", "relu2_moe_backward", "relu2_moe_forward"]
from . import ops  # noqa: E402  (registers torch.ops.fusedops.*: the differentiable torch ops)

__all__ += ["ops"]
from . import layers  # noqa: E402  (torch.nn layers on fusedops.ops)

__all__ += ["layers"]
