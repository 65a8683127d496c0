"""fusedops: fused GPU operators for hybrid LLMs, as plans (validate -> compile -> execute)
and eager wrappers. See docs/getting_started.md.

Each operator family is a package (``fusedops.engram``, ``fusedops.mamba2``,
``fusedops.mamba2_inference``, ``fusedops.attention``, ``fusedops.moe``) whose ``__all__`` (its
plans and eager functions) is re-exported here; ``fusedops.ops`` holds the differentiable torch
ops and ``fusedops.layers`` the nn.Modules built on them.
"""

from . import attention, engram, errors, mamba2, mamba2_inference, moe
from .attention import *  # noqa: F401,F403
from .core import TensorDesc, TupleDict, cache_clear, cache_info
from .engram import *  # noqa: F401,F403
from .mamba2 import *  # noqa: F401,F403
from .mamba2_inference import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403

__version__ = "0.1.0"

__all__ = ["TensorDesc", "TupleDict", "cache_clear", "cache_info", "distributed", "errors", "layers", "ops",
           *engram.__all__, *mamba2.__all__, *mamba2_inference.__all__, *attention.__all__,
           *moe.__all__]

from . import distributed, layers, ops  # noqa: E402  (ops registers torch.ops.fusedops.*)
