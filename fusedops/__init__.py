"""fusedops: fused GPU operators for hybrid LLMs, as plans (validate -> compile -> execute)
and eager wrappers. See docs/getting_started.md.

Each operator family is a package (``fusedops.engram``, ``fusedops.mamba2``,
``fusedops.mamba2_inference``, ``fusedops.attention``, ``fusedops.moe``) whose ``__all__`` (its
plans and eager functions) is re-exported here.
"""

from . import errors
from .core import TensorDesc, TupleDict, cache_clear, cache_info
from . import engram
from .engram import *  # noqa: E402,F401,F403
from . import mamba2
from .mamba2 import *  # noqa: E402,F401,F403
from . import mamba2_inference
from .mamba2_inference import *  # noqa: E402,F401,F403
from . import attention
from .attention import *  # noqa: E402,F401,F403
from . import moe
from .moe import *  # noqa: E402,F401,F403

__version__ = "0.1.0"

__all__ = ["TensorDesc", "TupleDict", "cache_clear", "cache_info", "errors", *engram.__all__]
__all__ += mamba2.__all__
__all__ += mamba2_inference.__all__
__all__ += attention.__all__
__all__ += moe.__all__

from . import ops  # noqa: E402  (registers torch.ops.fusedops.*: the differentiable torch ops)
from . import layers  # noqa: E402  (torch.nn layers on fusedops.ops)
__all__ += ["ops", "layers"]
