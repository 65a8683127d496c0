"""Compiling and launching Triton kernels from an explicit specialisation.

A ``KernelSpec`` names a kernel, the Triton type of every argument (``constexpr`` for
compile-time ones), the constexpr values, which pointers are 16-byte aligned, the launch options
and the launch grid. The GPU launcher and the AOT compile for sm_90/sm_100 both go through
``compile_spec``, so what CI compiles without a GPU is exactly what runs on one. Runtime sizes
(token counts) are plain ``i32`` arguments: one compile serves every size, and the grid is not
part of the specialisation (two specs that differ only in grid compare equal).

Tensor descriptors a kernel makes on the device (``tl.make_tensor_descriptor``: TMA on sm_90 and
later) live in Triton's global scratch memory, DESCRIPTOR_BYTES per descriptor per program,
which Triton's launcher asks its allocator for at every launch. A spec declares how many each
program makes (``descriptors``); its launcher then takes one more runtime argument,
``global_scratch`` (a workspace piece of ``scratch_bytes``: ``scratch_piece`` sizes it for a
program's stages), and hands that region to Triton for the launch, so execute() still allocates
nothing and a CUDA Graph captures the same addresses.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fusedops.core.cache import COMPILE_CACHE
from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.program import SCRATCH
from fusedops.core.target import emulated_target
from fusedops.core.workspace import Region

from . import interpreter_active

SCRATCH_ARG = SCRATCH.name
DESCRIPTOR_BYTES = 128      # Triton's global scratch per device-made tensor descriptor (a CUtensorMap)

TRITON_POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
                        torch.bool: "*i1", torch.uint8: "*u8", torch.int32: "*i32",
                        torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}
_POINTER_DTYPES = {t: d for d, t in TRITON_POINTER_TYPES.items()}
_FLOAT_POINTERS = ("*bf16", "*fp16", "*fp32", "*fp8e4nv")


def pointer_type(dtype: torch.dtype) -> str:
    """The Triton pointer type of a tensor of ``dtype`` (``*bf16``...)."""
    return TRITON_POINTER_TYPES[dtype]


def numerics(dtype: torch.dtype) -> dict[str, bool]:
    """The dot-product constexprs every tensor-core kernel takes. UPCAST: the CPU interpreter
    multiplies bf16 bit patterns, so dot operands go to fp32 there; IEEE: fp32 inputs get exact
    fp32 products rather than tf32."""
    return dict(UPCAST=interpreter_active() and dtype == torch.bfloat16,
                IEEE=dtype == torch.float32)


@dataclass(frozen=True)
class KernelSpec:
    """One compiled specialisation of a ``@triton.jit`` kernel and its launch grid.

    ``signature`` lists (argument name, Triton type) in the kernel's argument order, with type
    ``"constexpr"`` for compile-time arguments whose values are in ``constexprs`` (an absent
    optional operand is a constexpr None: compiled out, never aliased); ``aligned`` names the
    pointer arguments guaranteed 16-byte aligned (the plans check it at execute);
    ``descriptors`` how many tensor descriptors each program makes (the module docstring: global
    scratch from the workspace). ``grid`` and
    ``cost`` (the launch's FLOPs and HBM bytes at the plan's sizes) are not part of the
    specialisation.
    """

    kernel: Any
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    aligned: tuple[str, ...] = ()
    num_warps: int = 4
    num_stages: int = 1
    maxnreg: int | None = None      # a register budget for ptxas where its own choice spills
    descriptors: int = 0            # tensor descriptors each program makes (global scratch)
    grid: tuple[int, int, int] = field(default=(1, 1, 1), compare=False)
    cost: Cost | None = field(default=None, compare=False)

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        return 32 * self.num_warps

    def __post_init__(self) -> None:
        # arguments are passed by position: put the signature in the kernel's parameter order
        params = list(self.kernel.arg_names)
        given = dict(self.signature)
        if sorted(given) != sorted(params):
            missing, extra = set(params) - set(given), set(given) - set(params)
            raise ValueError(f"KernelSpec of {self.name}: signature does not match the kernel's "
                             f"parameters (missing {sorted(missing)}, unknown {sorted(extra)})")
        object.__setattr__(self, "signature", tuple((n, given[n]) for n in params))
        object.__setattr__(self, "grid", tuple(int(g) for g in self.grid))

    @property
    def scratch_bytes(self) -> int:
        """Bytes of global scratch a launch on ``grid`` needs (0 without descriptors)."""
        return self.descriptors * DESCRIPTOR_BYTES * self.grid[0] * self.grid[1] * self.grid[2]

    @classmethod
    def make(cls, kernel, args: Mapping[str, str | None] | Sequence[tuple[str, str | None]],
             constexprs: Mapping[str, Any], grid: Sequence[int], *, num_warps: int = 4,
             num_stages: int = 1, maxnreg: int | None = None, descriptors: int = 0,
             cost: Cost | None = None) -> KernelSpec:
        """A spec of ``kernel``, whose ``@triton.jit`` signature gives the arguments' order and
        which are compile-time (annotated ``tl.constexpr``). ``args`` says only what the
        signature cannot: the Triton type of runtime arguments other than ``i32`` scalars (the
        default: sizes and strides), ``None`` for an absent optional operand (compiled out as a
        constexpr None); ``constexprs`` the value of every compile-time parameter. A name the
        kernel does not have, a compile-time parameter without a value or a runtime one given a
        value is refused. Floating-point pointers are 16-byte aligned (plans check it; workspace
        pieces are 128-byte aligned); integer and bool pointers are not assumed aligned."""
        types = dict(args)
        params = kernel_parameters(kernel)
        compile_time = {n for n, is_constexpr in params if is_constexpr}
        names = [n for n, _ in params]
        problems = [f"unknown argument {n!r}" for n in [*types, *constexprs] if n not in names]
        problems += [f"{n!r} is a tl.constexpr parameter, not a runtime argument" for n in types
                     if n in compile_time]
        problems += [f"{n!r} is a runtime parameter, not a tl.constexpr" for n in constexprs
                     if n in names and n not in compile_time]
        problems += [f"no value for tl.constexpr {n!r}" for n in names
                     if n in compile_time and n not in constexprs]
        if problems:
            name = getattr(getattr(kernel, "fn", kernel), "__name__", kernel)
            raise ValueError(f"KernelSpec of {name}: " + "; ".join(problems))
        runtime = [(n, types.get(n, "i32")) for n in names if n not in compile_time]
        present = tuple((n, t) for n, t in runtime if t is not None)
        values = tuple(constexprs.items()) + tuple((n, None) for n, t in runtime if t is None)
        return cls(kernel, present + tuple((n, "constexpr") for n, _ in values), values,
                   aligned=tuple(n for n, t in present if t in _FLOAT_POINTERS),
                   num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg,
                   descriptors=descriptors, grid=tuple(grid) + (1,) * (3 - len(grid)), cost=cost)

    @property
    def name(self) -> str:
        return self.kernel.__name__ if hasattr(self.kernel, "__name__") else self.kernel.fn.__name__

    def constexpr(self, name: str) -> Any:
        """The value of constexpr ``name``."""
        return dict(self.constexprs)[name]

    @property
    def scalar_args(self) -> frozenset[str]:
        """The runtime arguments typed as scalars (no pointer): none may take a buffer."""
        return frozenset(n for n, t in self.signature if t != "constexpr" and not t.startswith("*"))

    def runtime_arg_names(self) -> tuple[str, ...]:
        """The kernel's runtime arguments, then ``global_scratch`` when it makes descriptors."""
        names = tuple(n for n, t in self.signature if t != "constexpr")
        return names + (SCRATCH_ARG,) if self.descriptors else names

    def full_args(self, runtime_args: Sequence[Any]) -> list[Any]:
        """All kernel arguments in order: ``runtime_args`` (without the scratch) with the
        constexpr values put back."""
        constexprs = dict(self.constexprs)
        it = iter(runtime_args)
        return [constexprs[n] if t == "constexpr" else next(it) for n, t in self.signature]

    def build_launcher(self, device: torch.device) -> Callable[..., None]:
        """``launch(*runtime_args, stream)`` on ``device`` (see ``make_launcher``)."""
        return make_launcher(self, device)


def kernel_parameters(kernel) -> list[tuple[str, bool]]:
    """(name, annotated ``tl.constexpr``) of each parameter of a ``@triton.jit`` kernel (or the
    interpreter's wrapper of one), in order."""
    fn = getattr(kernel, "fn", kernel)
    return [(p.name, "constexpr" in str(p.annotation))
            for p in inspect.signature(fn).parameters.values()]


def compile_spec(spec: KernelSpec, target) -> Any:
    """``triton.compile`` of ``spec`` for ``target`` (a ``GPUTarget``); returns the
    CompiledKernel. Works without a GPU for any target Triton knows, but not in a process running
    the interpreter (there ``@triton.jit`` makes interpreted functions): AOT compiles run in a
    subprocess (``python -m fusedops.aot``)."""
    import triton
    from triton.compiler import ASTSource

    names = [n for n, _ in spec.signature]
    signature = dict(spec.signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.aligned}
    source = ASTSource(spec.kernel, signature, dict(spec.constexprs), attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "enable_fp_fusion": True}
    if spec.maxnreg is not None:
        options["maxnreg"] = spec.maxnreg
    return triton.compile(source, target=target, options=options)


def make_launcher(spec: KernelSpec, device: torch.device) -> Callable[..., None]:
    """Returns ``launch(*runtime_args, stream)`` for ``spec`` on its grid.

    On CUDA the kernel is compiled for the device's target (cached process-wide by spec and
    device) and its module loaded now; launching is then a single driver call. On CPU (the
    Triton interpreter, tests only) the interpreted kernel runs on the CPU tensors.
    """
    grid = spec.grid
    if device.type == "cpu" and not interpreter_active():
        target = emulated_target()
        if target is None:
            raise RuntimeError("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 "
                               "or FUSEDOPS_EMULATE=1")
        return _emulated_launcher(spec, target)
    if device.type == "cpu":

        pointer_dtypes = {n: _POINTER_DTYPES[t] for n, t in spec.signature if t in _POINTER_DTYPES}
        names = spec.runtime_arg_names()

        def interpret(*runtime_args, stream):
            # the interpreter reads memory through the tensor's dtype: reinterpret buffers handed
            # as raw bytes (workspace and saved pieces); it keeps descriptors in host memory
            if spec.descriptors:
                runtime_args = runtime_args[:-1]
            args = [a.tensor() if isinstance(a, Region) else a for a in runtime_args]
            args = [_reinterpret(a, pointer_dtypes[n]) if n in pointer_dtypes else a
                    for n, a in zip(names, args)]
            spec.kernel[grid](*spec.full_args(args), num_warps=spec.num_warps)
        return interpret

    compiled = COMPILE_CACHE.get_or_build(("triton", spec, device.index),
                                          lambda: _compile_for_device(spec, device))
    with torch.cuda.device(device):
        runner = compiled[grid]  # loads the module into the device's context now
    constexpr_slots = tuple(i for i, (_, t) in enumerate(spec.signature) if t == "constexpr")
    constexprs = dict(spec.constexprs)
    template = [constexprs[spec.signature[i][0]] if i in constexpr_slots else None
                for i in range(len(spec.signature))]
    runtime_slots = tuple(i for i in range(len(template)) if i not in constexpr_slots)
    from triton.runtime import _allocation
    allocator = _allocation._allocator      # the context variable Triton's launcher reads

    def launch(*runtime_args, stream):
        args = list(template)
        for slot, value in zip(runtime_slots, runtime_args):
            args[slot] = value.address() if isinstance(value, Region) else value
        if spec.descriptors:
            with _scratch(allocator, spec, runtime_args[-1]):
                runner(*args, stream=stream)
        else:
            runner(*args, stream=stream)
    return launch


class _ScratchRegion:
    """Triton's allocator for one launch: the workspace region bound as its global scratch."""

    def __init__(self, spec: KernelSpec, region: Region) -> None:
        self.spec, self.region = spec, region

    def data_ptr(self) -> int:
        return self.region.address()

    def __call__(self, size: int, alignment: int, stream) -> _ScratchRegion:
        if size > self.region.numel or self.region.address() % alignment:
            raise RuntimeError(f"{self.spec.name}: Triton asks for {size} bytes of global scratch "
                               f"aligned to {alignment}; the workspace piece holds "
                               f"{self.region.numel} at {self.region.address():#x}")
        return self


@contextlib.contextmanager
def _scratch(allocator, spec: KernelSpec, region: Region):
    """Triton's allocator (the context variable ``allocator``) answers ``region`` for launches
    in the block, restored after: a caller's own allocator is untouched."""
    token = allocator.set(_ScratchRegion(spec, region))
    try:
        yield
    finally:
        allocator.reset(token)


def scratch_piece(*specs: KernelSpec) -> tuple[str, torch.dtype, int]:
    """The workspace piece the ``global_scratch`` of a program's stages takes: the stages run
    one after another on one stream, so they share it, sized for the largest."""
    return (SCRATCH_ARG, torch.uint8, max((s.scratch_bytes for s in specs), default=0))


def _reinterpret(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.dtype == dtype:
        return tensor
    flat = tensor.reshape(-1).view(torch.uint8)
    size = torch.empty((), dtype=dtype).element_size()
    return flat[: flat.numel() - flat.numel() % size].view(dtype)


EMULATED_CAPABILITY = {"sm_80": 80, "sm_90a": 90, "sm_100a": 100}


def compile_for_emulator(spec: KernelSpec, target: str):
    """(parsed PTX, dynamic shared bytes) of ``spec`` compiled for ``target`` (sm_80, sm_90a,
    sm_100a), cached process-wide (and on disk by Triton's own cache)."""
    def build():
        from triton.backends.compiler import GPUTarget

        from ..ptx_emulator import PtxProgram
        compiled = compile_spec(spec, GPUTarget("cuda", EMULATED_CAPABILITY[target], 32))
        check_scratch(spec, compiled)
        return PtxProgram.parse(compiled.asm["ptx"]), int(compiled.metadata.shared)
    return COMPILE_CACHE.get_or_build(("triton-emulated", spec, target), build)


def _emulated_launcher(spec: KernelSpec, target: str) -> Callable[..., None]:
    """``launch(*runtime_args, stream)`` running ``spec``'s PTX for ``target`` on CPU tensors in
    the PTX emulator: every tensor argument bounds the kernel's accesses; Triton's two hidden
    trailing parameters get the workspace's global scratch (tensor descriptors) and no
    profiling scratch. Like a GPU launch it dispatches no torch operator."""
    from fusedops.core.target import emulation_mode

    from ..ptx_emulator import Memory, PtxFault, launch as emulate, options_for
    program, shared = compile_for_emulator(spec, target)
    names = spec.runtime_arg_names()
    hidden = len(program.params) - (len(names) - (1 if spec.descriptors else 0))
    if hidden != 2:
        raise PtxFault(f"{spec.name}: the PTX takes {len(program.params)} parameters for "
                       f"{len(names)} runtime arguments; expected Triton's two hidden ones")

    def launch(*runtime_args, stream):
        memory, params = Memory(), []
        scratch = 0
        for name, value in zip(names, runtime_args, strict=True):
            if isinstance(value, Region):      # the piece alone bounds the kernel's accesses
                memory.add(value.address(), value.numel * element_size(value.dtype), name)
                value = value.address()
            elif isinstance(value, torch.Tensor):
                memory.add_tensor(value, name)
                value = value.data_ptr()
            if name == SCRATCH_ARG:
                scratch = value
            else:
                params.append(value)
        emulate(program, spec.grid, params + [scratch, 0], memory, shared, (spec.threads, 1, 1),
                options_for(emulation_mode()))
    return launch


def _compile_for_device(spec: KernelSpec, device: torch.device):
    from triton.runtime import driver
    with torch.cuda.device(device):
        compiled = compile_spec(spec, driver.active.get_current_target())
    check_scratch(spec, compiled)
    return compiled


def check_scratch(spec: KernelSpec, compiled) -> None:
    """Refuses a compiled kernel whose global scratch exceeds what its spec declares (the
    workspace carries only that: Triton would otherwise allocate at launch) or that wants
    profiling scratch."""
    used = getattr(compiled.metadata, "global_scratch_size", 0) or 0
    profile = getattr(compiled.metadata, "profile_scratch_size", 0) or 0
    if used > spec.descriptors * DESCRIPTOR_BYTES or profile:
        raise RuntimeError(f"{spec.name} needs {used} bytes of Triton global scratch per program "
                           f"(and {profile} of profiling scratch); its spec declares "
                           f"{spec.descriptors} tensor descriptors ({spec.descriptors * DESCRIPTOR_BYTES} "
                           "bytes): the workspace must carry all of it, or execute() would allocate")
