"""Compiling, loading and launching CuTe DSL kernels, and their AOT resource figures.

A ``CuteKernel`` names a ``@cute.jit`` launcher, its compile-time arguments, the types of its
runtime arguments and its grid function; ``compile_kernel`` compiles it for an explicit
``--gpu-arch`` (no GPU needed), and ``make_launcher`` loads it on a device and returns
``launch(*runtime_args, stream)``. Runtime pointer arguments are passed as tensors (or raw
addresses) and wrapped per call; an absent optional operand is passed as None, a null pointer
the kernel never dereferences (its constexpr flag compiles the access out). Token counts are
``Int32`` runtime arguments, so one compile serves every N.

Without a GPU, ``FUSEDOPS_EMULATE=1`` (with ``FUSEDOPS_TARGET_ARCH`` sm_90a or sm_100a) lets the
backend serve CPU tensors: the kernel is compiled to PTX for that architecture as for a GPU, and
``ptx_emulator`` runs that PTX, checking every memory access against the launch's buffers.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fusedops.core.cache import COMPILE_CACHE
from fusedops.core.cost import Cost
from fusedops.core.device import device_capability
from fusedops.core.dtypes import element_size
from fusedops.core.target import emulated_target
from fusedops.core.workspace import Region

from . import ARCH_BY_CAPABILITY


def arch_of(device: torch.device) -> str:
    if device.type == "cpu":
        return emulated_target()
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
    scalar (``scalar`` is "i32" or "f32"). ``launch_only`` arguments shape the launch (grid)
    and are not kernel parameters."""

    name: str
    dtype: torch.dtype | None = None
    alignment: int = 16
    scalar: str | None = None
    launch_only: bool = False


@dataclass(frozen=True)
class CuteKernel:
    """One compiled specialisation: the ``@cute.jit`` launcher, its runtime arguments (in order,
    before the trailing stream), its compile-time arguments (in order, after the stream) and
    ``grid(**arguments)``, the launch grid from the arguments by name (the function the launcher
    itself calls); the kernel's parameters are the runtime arguments that are not launch_only.
    ``threads`` (per CTA), ``launch_grid`` and ``cost`` (FLOPs and HBM bytes at the plan's
    sizes) describe a launch for the kernel report; the last two are not part of the
    specialisation."""

    name: str
    launcher: Any
    args: tuple[Arg, ...]
    constexprs: tuple[tuple[str, Any], ...]
    grid: Callable[..., Any]
    dynamic_shared_bytes: int = 0
    threads: int = 0                                  # threads per CTA (for occupancy)
    launch_grid: tuple[int, int, int] | None = field(default=None, compare=False)
    cost: Cost | None = field(default=None, compare=False)

    def runtime_arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def build_launcher(self, device: torch.device) -> Callable[..., None]:
        """``launch(*runtime_args, stream)`` on ``device`` (see ``make_launcher``)."""
        return make_launcher(self, device)

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


def compile_ptx(kernel: CuteKernel, arch: str) -> str:
    """The PTX text ``cute.compile`` produces for ``kernel`` on ``arch``."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = compile_kernel(kernel, arch, keep_dir=tmp).__ptx__
        if ptx.lstrip().startswith(("//", ".version")):
            return ptx
        with open(ptx) as f:  # some versions return the path of the kept file
            return f.read()


def make_launcher(kernel: CuteKernel, device: torch.device) -> Callable[..., None]:
    """Compiles ``kernel`` for ``device`` (cached process-wide), loads it into the device's
    context now, and returns ``launch(*runtime_args, stream)``; tensors given for pointer
    arguments are passed by address. On cpu (under FUSEDOPS_EMULATE) the launch runs the
    kernel's PTX in the emulator; pointer arguments must then be tensors."""
    arch = arch_of(device)
    if device.type == "cpu":
        return _emulated_launcher(kernel, arch)
    compiled = COMPILE_CACHE.get_or_build(("cute", kernel, arch),
                                          lambda: compile_kernel(kernel, arch))
    with torch.cuda.device(device):
        executor = compiled.to(device.index)
    makers = [(a.dtype, a.alignment) if a.dtype is not None else None for a in kernel.args]

    def launch(*runtime_args, stream):
        args = [pointer(m[0], _address(v), m[1]) if m else v for m, v in zip(makers, runtime_args)]
        executor(*args, stream)
    return launch


def _address(value) -> int:
    if value is None:
        return 0
    if isinstance(value, Region):
        return value.address()
    return value if isinstance(value, int) else value.data_ptr()


def _emulated_launcher(kernel: CuteKernel, arch: str) -> Callable[..., None]:
    from fusedops.core.target import emulation_mode

    from ..ptx_emulator import Memory, PtxFault, PtxProgram, launch as emulate, options_for
    program = COMPILE_CACHE.get_or_build(("cute-ptx", kernel, arch),
                                         lambda: PtxProgram.parse(compile_ptx(kernel, arch)))
    constexprs = dict(kernel.constexprs)

    def launch(*runtime_args, stream):
        memory, params = Memory(), []
        for arg, value in zip(kernel.args, runtime_args, strict=True):
            if isinstance(value, Region):      # the piece alone bounds the kernel's accesses
                memory.add(value.address(), value.numel * element_size(value.dtype), arg.name)
                params.append(value.address())
                continue
            if arg.dtype is not None and value is None:
                value = 0       # an absent operand: a null pointer, registered nowhere
            elif arg.dtype is not None:
                if not isinstance(value, torch.Tensor):
                    raise PtxFault(f"{arg.name}: the emulator needs a tensor (its extent bounds "
                                   f"the kernel's accesses), got {type(value).__name__}")
                memory.add_tensor(value, arg.name)
                value = value.data_ptr()
            if not arg.launch_only:
                params.append(value)
        named = dict(zip((a.name for a in kernel.args), runtime_args)) | constexprs
        emulate(program, kernel.grid(**named), params, memory, kernel.dynamic_shared_bytes,
                options=options_for(emulation_mode()))
    return launch
