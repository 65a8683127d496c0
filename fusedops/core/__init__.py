"""The bottom layer of fusedops: what every operator, backend and plan shares.

TensorDesc (declaring a tensor without storage), input and option checks, dtype policies,
device binding, the workspace layout, stream handles, the compile cache, TupleDict and the
staged launch program. Nothing here imports an operator, a backend or a plan.
"""

from .cache import COMPILE_CACHE, CacheInfo, CompileCache, cache_clear, cache_info
from .desc import TensorDesc
from .tupledict import TupleDict

__all__ = ["COMPILE_CACHE", "CacheInfo", "CompileCache", "TensorDesc", "TupleDict", "cache_clear",
           "cache_info"]
