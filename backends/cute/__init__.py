"""The CuTe DSL backend: kernels for Hopper (sm_90a) and Blackwell (sm_100a).

Kernels are compiled with ``cute.compile(..., options="--gpu-arch ...")`` at plan compile time
(the same call compiles them to PTX without a GPU in CI), cached process-wide by plan-time values,
and launched on the caller's stream. Needs nvidia-cutlass-dsl >= 4.7 and cuda-python. Without a
GPU, ``FUSEDOPS_EMULATE=1`` runs the kernels' PTX (for ``FUSEDOPS_TARGET_ARCH``, sm_90a by
default) on CPU tensors in the project's PTX emulator (``ptx_emulator``), checking every memory
access.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import torch

from fusedops.core.device import device_capability
from fusedops.core.target import EMULATE_ENV, emulated_target

NAME = "cute"
MIN_VERSION = (4, 7)
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def installed_version() -> str | None:
    """The installed nvidia-cutlass-dsl version, or None."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CuTe backend cannot serve ``device`` (packages, version, capability, emulator
    setting), or None."""
    if importlib.util.find_spec("cuda.bindings") is None:
        return "the cuda-python package is not installed (pip install 'fusedops[cute]')"
    version = installed_version()
    if version is None:
        return "nvidia-cutlass-dsl is not installed (pip install 'fusedops[cute]')"
    if _version_tuple(version) < MIN_VERSION:
        return (f"nvidia-cutlass-dsl {version} is installed; the cute backend needs >= "
                f"{'.'.join(map(str, MIN_VERSION))}")
    if device.type == "cpu":
        arch = emulated_target()
        if arch is None:
            return (f"CuTe DSL kernels run on CUDA devices, not on cpu; on cpu only under the PTX "
                    f"emulator ({EMULATE_ENV}=1)")
        if arch not in ARCH_BY_CAPABILITY.values():
            return (f"the cute kernels are built for {' and '.join(ARCH_BY_CAPABILITY.values())}; "
                    f"the emulated target is {arch} (FUSEDOPS_TARGET_ARCH)")
        return None
    if device.type != "cuda":
        return f"CuTe DSL kernels run on CUDA devices, not on {device.type}"
    cap = device_capability(device.index)
    if cap not in ARCH_BY_CAPABILITY:
        return (f"the cute kernels are built for sm_90a and sm_100a; {device} has compute "
                f"capability {cap[0]}.{cap[1]}")
    return None
