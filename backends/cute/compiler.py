"""Compiling, loading and launching CuTe DSL kernels, and their AOT resource figures.

A ``CuteKernel`` names a ``@cute.jit`` launcher, its compile-time arguments and the types of its
runtime arguments; ``compile_kernel`` compiles it for an explicit ``--gpu-arch`` (no GPU needed),
and ``make_launcher`` loads it on a device and returns ``launch(*runtime_args, stream)``. Runtime
pointer arguments are passed as tensors (or raw addresses) and wrapped per call; token counts are
``Int32`` runtime arguments, so one compile serves every N.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fusedops._backend import device_capability
from fusedops._cache import COMPILE_CACHE

MIN_VERSION = (4, 7)
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def unsupported_reason(device: torch.device) -> str | None:
    """Why the CuTe backend cannot serve ``device`` (version of CuTe DSL, capability), or None."""
    version = installed_version()
    if version is None:
        return "nvidia-cutlass-dsl is not installed (pip install 'fusedops[cute]')"
    if _version_tuple(version) < MIN_VERSION:
        return (f"nvidia-cutlass-dsl {version} is installed; the cute backend needs >= "
                f"{'.'.join(map(str, MIN_VERSION))}")
    if device.type != "cuda":
        return f"CuTe DSL kernels run on CUDA devices, not on {device.type}"
    cap = device_capability(device.index)
    if cap not in ARCH_BY_CAPABILITY:
        return (f"the cute kernels are built for sm_90a and sm_100a; {device} has compute "
                f"capability {cap[0]}.{cap[1]}")
    return None


def arch_of(device: torch.device) -> str:
    return ARCH_BY_CAPABILITY[device_capability(device.index)]


def cutlass_type(dtype: torch.dtype):
    import cutlass
    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32, torch.bool: cutlass.Uint8,
            torch.uint8: cutlass.Uint8, torch.int32: cutlass.Int32}[dtype]


def pointer(dtype: torch.dtype, address: int, alignment: int = 16):
    from cutlass import cute
    from cutlass.cute.runtime import make_ptr
    return make_ptr(cutlass_type(dtype), address, cute.AddressSpace.gmem, assumed_align=alignment)


@dataclass(frozen=True)
class Arg:
    """A runtime argument of a CuTe launcher: a pointer (``dtype`` of the memory, alignment) or a
    scalar (``scalar`` is "i32" or "f32")."""

    name: str
    dtype: torch.dtype | None = None
    alignment: int = 16
    scalar: str | None = None


@dataclass(frozen=True)
class CuteKernel:
    """One compiled specialisation: the ``@cute.jit`` launcher, its runtime arguments (in order,
    before the trailing stream) and its compile-time arguments (in order, after the stream)."""

    name: str
    launcher: Any
    args: tuple[Arg, ...]
    constexprs: tuple[tuple[str, Any], ...]
    dynamic_shared_bytes: int = 0

    def example_args(self) -> list:
        import cuda.bindings.driver as cuda
        from cutlass import Float32, Int32
        values = [pointer(a.dtype, 0, a.alignment) if a.dtype is not None
                  else (Int32(1) if a.scalar == "i32" else Float32(1.0)) for a in self.args]
        return values + [cuda.CUstream(0)] + [v for _, v in self.constexprs]


def compile_kernel(kernel: CuteKernel, arch: str, keep_dir: str | None = None):
    """``cute.compile`` for ``arch`` ("sm_90a", "sm_100a"); works without a GPU. With
    ``keep_dir`` the PTX is kept there and returned by ``.__ptx__``."""
    from cutlass import cute
    options = f"--gpu-arch {arch}"
    if keep_dir is not None:
        os.makedirs(keep_dir, exist_ok=True)
        options += f" --keep-ptx --dump-dir={keep_dir}"
    return cute.compile(kernel.launcher, *kernel.example_args(), options=options)


def make_launcher(kernel: CuteKernel, device: torch.device) -> Callable[..., None]:
    """Compiles ``kernel`` for ``device`` (cached process-wide), loads it into the device's
    context now, and returns ``launch(*runtime_args, stream)``; tensors given for pointer
    arguments are passed by address."""
    arch = arch_of(device)
    compiled = COMPILE_CACHE.get_or_build(("cute", kernel, arch),
                                          lambda: compile_kernel(kernel, arch))
    with torch.cuda.device(device):
        executor = compiled.to(device.index)
    makers = [(a.dtype, a.alignment) if a.dtype is not None else None for a in kernel.args]

    def launch(*runtime_args, stream):
        args = [pointer(m[0], v if isinstance(v, int) else v.data_ptr(), m[1]) if m else v
                for m, v in zip(makers, runtime_args)]
        executor(*args, stream)
    return launch


# -- ahead-of-time compiles and their resource figures ---------------------------------------
@dataclass(frozen=True)
class PtxasUsage:
    kernel: str
    arch: str
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int
    barriers: int


def ptxas_usage(kernel: CuteKernel, arch: str) -> PtxasUsage:
    """Compiles ``kernel`` for ``arch`` keeping its PTX, assembles it with ``ptxas -v`` and
    reads registers, spills and stack; shared memory is the static amount plus the kernel's
    declared dynamic shared memory."""
    with tempfile.TemporaryDirectory() as tmp:
        compiled = compile_kernel(kernel, arch, keep_dir=tmp)
        ptx_path = os.path.join(tmp, "kernel.ptx")
        ptx = compiled.__ptx__
        with open(ptx_path, "w") as f:
            f.write(ptx if ptx.lstrip().startswith(("//", ".version")) else open(ptx).read())
        proc = subprocess.run(["ptxas", f"-arch={arch}", "-v", ptx_path, "-o", ptx_path + ".cubin"],
                              capture_output=True, text=True, check=True)
    text = proc.stdout + proc.stderr
    used = re.findall(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?", text)
    spills = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text))
    stack = sum(int(s) for s in re.findall(r"(\d+) bytes stack frame", text))
    registers = max(int(u[0]) for u in used)
    barriers = max(int(u[1] or 0) for u in used)
    shared = max(int(u[2] or 0) for u in used) + kernel.dynamic_shared_bytes
    return PtxasUsage(kernel.name, arch, registers, spills, stack, shared, barriers)
