"""What a backend runs for one plan, and the one runner that launches it.

A backend answers a plan with a ``Program``: the layouts of the caller buffers it needs
(``workspace``; ``saved`` for a forward/backward pair) and either a list of ``Stage``s (kernel
launches, for the kernel backends) or a direct ``run`` function (the torch backend). Every
launcher, on every backend, is called the same way: ``launch(binding, stream)``, where
``binding`` maps each of the plan's tensor names (and ``workspace``/``saved``) to what execute()
was handed.

A stage names a kernel (a Triton ``KernelSpec`` or a CuTe ``CuteKernel``: both carry their
launch grid) and where each of its runtime arguments comes from. By default an argument takes
the plan tensor of its own name (a trailing ``_ptr`` dropped; ``global_scratch``, the workspace
piece of that name); ``bind`` overrides that with
another tensor name, a piece of a caller buffer (``Piece``), a stride of a bound tensor
(``Stride``: strided views go in without a copy), or a plan-time scalar. The same
stage list gives the AOT compiles, the kernel report and the benchmark's kernel list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .checks import ALIGNMENT
from .target import emulated_target
from .workspace import EMPTY, PIECE_ALIGNMENT, Layout

Binding = Mapping[str, Any]
Launch = Callable[[Binding, "int | None"], None]


class Kernel(Protocol):
    """What a stage's kernel provides (``KernelSpec``, ``CuteKernel``)."""

    name: str

    def runtime_arg_names(self) -> tuple[str, ...]: ...

    def build_launcher(self, device: torch.device) -> Callable[..., None]: ...


@dataclass(frozen=True)
class Piece:
    """A kernel argument carved from a caller buffer: piece ``name`` of the ``buffer``
    ("workspace" or "saved") laid out by the program's layout of that buffer."""

    buffer: str
    name: str


@dataclass(frozen=True)
class Stride:
    """A kernel argument: stride ``dim`` of the bound tensor ``tensor`` divided by ``unit``
    elements (pass the elements of a 16-byte vector, and multiply by that constexpr in the
    kernel: the compiler then knows every row starts 16-byte aligned and vectorises). Read from
    the tensor handed to execute() (a host fact), 0 when the tensor is absent."""

    tensor: str
    dim: int
    unit: int = 1


def workspace_piece(name: str) -> Piece:
    """Piece ``name`` of the workspace."""
    return Piece("workspace", name)


SCRATCH = workspace_piece("global_scratch")
"""Where a kernel's ``global_scratch`` argument comes from unless its stage binds it: the
workspace piece of that name (memory the kernel itself keeps state in during a launch, such as
the tensor descriptors a Triton kernel makes)."""


def saved_piece(name: str) -> Piece:
    """Piece ``name`` of the saved buffer."""
    return Piece("saved", name)


@dataclass(frozen=True)
class Stage:
    """One kernel launch: ``kernel`` and, per runtime argument that does not take the plan
    tensor of its own name, its source (a tensor name, a ``Piece`` or a scalar)."""

    kernel: Any
    bind: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.name


@dataclass(frozen=True)
class Program:
    """The buffers a backend needs for one plan and how it launches.

    ``workspace``/``saved``: layouts of the caller's workspace and saved buffer (empty when
    not needed). ``stages``: kernel launches in order; or ``run(binding, stream)``: a direct
    implementation (the torch backend).
    """

    workspace: Layout = EMPTY
    saved: Layout = EMPTY
    stages: tuple[Stage, ...] = ()
    run: Callable[[Binding, Any], None] | None = None

    def workspace_alignment(self, device: torch.device) -> int:
        """The alignment execute() requires of the workspace's address on ``device``: its
        pieces' (128 bytes) when it carries ``global_scratch`` for compiled code (a GPU, or the
        PTX emulator: Triton aligns the tensor descriptors it keeps there to 128 bytes; the CPU
        interpreter keeps them in host memory), else the 16 of every buffer."""
        compiled = device.type == "cuda" or emulated_target() is not None
        scratch = SCRATCH.name in self.workspace and compiled
        return PIECE_ALIGNMENT if scratch else ALIGNMENT

    @property
    def kernels(self) -> tuple[Any, ...]:
        """The kernels of the stages, in launch order."""
        return tuple(stage.kernel for stage in self.stages)

    def build(self, device: torch.device, names: frozenset[str]) -> Launch:
        """Builds (compiles and loads) every stage's kernel for ``device`` and returns
        ``launch(binding, stream)``. ``names``: the tensor names the plan's binding holds;
        every argument must resolve to one of them, a buffer piece or a scalar."""
        if self.run is not None:
            return self.run
        steps = tuple((stage.kernel.build_launcher(device), self._getters(stage, names))
                      for stage in self.stages)

        def launch(binding: Binding, stream) -> None:
            for kernel, getters in steps:
                kernel(*[get(binding) for get in getters], stream=stream)
        return launch

    def _getters(self, stage: Stage, names: frozenset[str]) -> tuple[Callable[[Binding], Any], ...]:
        unknown = set(stage.bind) - set(stage.kernel.runtime_arg_names())
        if unknown:
            raise ValueError(f"stage {stage.name}: bind names {sorted(unknown)}, which are not "
                             f"runtime arguments of the kernel")
        return tuple(self._getter(stage, arg, names) for arg in stage.kernel.runtime_arg_names())

    def _getter(self, stage: Stage, arg: str, names: frozenset[str]) -> Callable[[Binding], Any]:
        source = stage.bind.get(arg, SCRATCH if arg == SCRATCH.name else arg.removesuffix("_ptr"))
        if isinstance(source, (Piece, str)) and arg in getattr(stage.kernel, "scalar_args", ()):
            raise ValueError(f"stage {stage.name}: argument {arg} is a scalar in the kernel's "
                             f"spec but takes a buffer ({source!r}): give its pointer type")
        if isinstance(source, Piece):
            layout = {"workspace": self.workspace, "saved": self.saved}[source.buffer]
            if source.name not in layout:
                raise ValueError(f"stage {stage.name}: argument {arg} takes {source.buffer} piece "
                                 f"{source.name!r}, which the layout does not have ({layout})")
            return lambda binding, b=source.buffer, p=source.name, lay=layout: lay.carve(binding[b], p)
        if isinstance(source, Stride):
            if source.tensor not in names:
                raise ValueError(f"stage {stage.name}: argument {arg} takes a stride of "
                                 f"{source.tensor!r}, which the plan does not bind")

            def stride(binding, t=source.tensor, d=source.dim, u=source.unit):
                value = binding.get(t)
                return 0 if value is None else value.stride(d) // u
            return stride
        if isinstance(source, str):
            if source not in names:
                raise ValueError(f"stage {stage.name}: argument {arg} takes tensor {source!r}, "
                                 f"which the plan does not bind (it binds {sorted(names)})")
            return lambda binding, key=source: binding[key]
        return lambda binding, value=source: value
