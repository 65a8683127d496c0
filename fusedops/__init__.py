"""fusedops: fused GPU operators for hybrid LLMs, as plans (validate -> compile -> execute)
and eager wrappers. See docs/getting_started.md.

Each operator family is a package (``fusedops.engram_gate``, ``fusedops.mamba2_scan``,
``fusedops.mamba2_inference``, ``fusedops.gqa_attention``, ``fusedops.relu2_moe``) whose ``__all__`` (its
plans and eager functions) is re-exported here; ``fusedops.ops`` holds the differentiable torch
ops and ``fusedops.layers`` the nn.Modules built on them.
"""

from fusedops import (gqa_attention as attention, engram_gate as engram, errors,
                      mamba2_scan as mamba2, mamba2_inference, relu2_moe as moe)
from .gqa_attention import *  # noqa: F401,F403
from .core import TensorDesc, TupleDict, cache_clear, cache_info
from .engram_gate import *  # noqa: F401,F403
from .mamba2_scan import *  # noqa: F401,F403
from .mamba2_inference import *  # noqa: F401,F403
from .relu2_moe import *  # noqa: F401,F403

__version__ = "0.1.0"

__all__ = ["TensorDesc", "TupleDict", "cache_clear", "cache_info", "distributed", "errors", "layers", "ops",
           *engram.__all__, *mamba2.__all__, *mamba2_inference.__all__, *attention.__all__,
           *moe.__all__]

from . import distributed, layers, ops  # noqa: E402  (ops registers torch.ops.fusedops.*)
