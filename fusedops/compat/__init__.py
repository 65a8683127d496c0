"""Drop-in functions with the signatures existing models already call, so swapping an import is
the whole change:

    from fusedops.compat import mamba_chunk_scan_combined, selective_state_update   # mamba_ssm
    from fusedops.compat import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from fusedops.compat import flash_attn_qkvpacked_func, flash_attn_varlen_kvpacked_func  # ...
    from fusedops.compat import cudnn        # cudnn.engram_gate_saved_forward(..., backend="frost")

Training functions are differentiable (through fusedops.ops). Options a fusedops kernel does not
implement (dropout, ALiBi, per-channel dt) raise UnsupportedError naming the argument instead of
being ignored.
"""

from . import cudnn
from .flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                         flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                         flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .mamba_ssm import mamba_chunk_scan_combined, selective_state_update

__all__ = ["cudnn", "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
           "mamba_chunk_scan_combined", "selective_state_update"]
