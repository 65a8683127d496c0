"""The Triton backend: production kernels for SM80+ GPUs; on CPU tensors, either Triton's
interpreter (``TRITON_INTERPRET=1``: the source) or the project's PTX emulator
(``FUSEDOPS_EMULATE=1``: the code compiled for ``FUSEDOPS_TARGET_ARCH``).

Kernels are compiled through ``triton.compile`` from an explicit specialisation (``KernelSpec``
in ``runtime``), the same one for the GPU launcher, the emulator and ahead-of-time compiles for
sm_80/sm_90a/sm_100a without a GPU. Kernels must work on triton 3.6 through 3.9: no block
pointers.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from fusedops.core.device import gpu_unavailable_reason
from fusedops.core.target import EMULATE_ENV, emulated_target

NAME = "triton"
MIN_CAPABILITY = (8, 0)


def interpreter_active() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``, which must
    be set before triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` in this process, or None if they can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'fusedops[triton]')"
    if device.type == "cpu":
        if interpreter_active() or emulated_target() is not None:
            return None
        return ("Triton kernels run on CUDA devices; on cpu only under the Triton interpreter "
                f"(TRITON_INTERPRET=1 set before triton is imported) or the PTX emulator "
                f"({EMULATE_ENV}=1)")
    return gpu_unavailable_reason("Triton kernels", device, MIN_CAPABILITY)
