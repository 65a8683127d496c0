"""The plan lifecycle every operator follows.

construct (validate everything, select the backend) -> compile() (build launchers, cached
process-wide) -> execute(...) many times (host checks of the handed buffers, then launch; no
allocation, conversion, compilation, synchronisation or device read).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, ClassVar

import torch

from ._backend import select_backend
from ._checks import (ALIGNMENT, check_execute_tensor, check_no_overlap, check_workspace,
                      expect_aligned)
from ._desc import TensorDesc
from ._stream import resolve_stream
from .errors import PlanStateError, UnsupportedError, ValidationError


def bind_device(name: str, device: torch.device) -> torch.device:
    """Binds a bare ``cuda`` device to the current CUDA device (at plan construction)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError(f"{name}: declared on {device}, but CUDA is not available here")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    return device


class Plan:
    """Base class of every operator plan.

    Subclasses validate their arguments in ``__init__`` through ``_declare``/``_declare_output``,
    call ``_select_backend(problem)``, and implement ``_build_launcher()`` returning a callable
    ``launch(*tensors, stream=handle)`` built from the selected backend module.
    """

    op_name: ClassVar[str]
    implementations: ClassVar[Mapping[str, str]]
    backend_preference: ClassVar[Sequence[str]] = ("triton", "torch")

    def __init__(self, backend: str = "auto") -> None:
        if not isinstance(backend, str):
            raise ValidationError(f"backend: expected a string, got {type(backend).__name__}")
        self._requested_backend = backend
        self._descs: dict[str, TensorDesc] = {}
        self._alignment: dict[str, int] = {}
        self._first_declared: str | None = None
        self._device: torch.device | None = None
        self._backend: str | None = None
        self._impl = None
        self._launch: Callable[..., None] | None = None
        self._workspace_bytes = 0

    # -- construction -------------------------------------------------------------------------
    def _declare(self, name: str, value, *, alignment: int = ALIGNMENT) -> TensorDesc:
        """Records an input given as a tensor or a TensorDesc, bound to the plan's device."""
        if isinstance(value, torch.Tensor):
            expect_aligned(name, value, alignment)
            desc = TensorDesc.from_tensor(value)
        elif isinstance(value, TensorDesc):
            desc = value
        else:
            raise ValidationError(
                f"{name}: expected a torch.Tensor or fusedops.TensorDesc, got {type(value).__name__}")
        device = bind_device(name, desc.device)
        if self._device is None:
            self._device, self._first_declared = device, name
        elif device != self._device:
            raise ValidationError(
                f"{name}: expected device {self._device} (the device of {self._first_declared}), "
                f"got {device}")
        desc = desc.bound(device)
        self._descs[name] = desc
        self._alignment[name] = alignment
        return desc

    def _declare_output(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                        alignment: int = ALIGNMENT) -> TensorDesc:
        desc = TensorDesc(shape, dtype, device=self._device)
        self._descs[name] = desc
        self._alignment[name] = alignment
        return desc

    def _select_backend(self, problem: Any) -> None:
        self._backend, self._impl = select_backend(
            self.op_name, self._requested_backend, self._device, problem, self.implementations,
            self.backend_preference)

    # -- public surface -----------------------------------------------------------------------
    @property
    def selected_backend(self) -> str:
        """The backend that serves this plan: ``torch``, ``triton`` or ``cute``."""
        return self._backend

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def workspace_size(self) -> int:
        """Bytes of caller workspace execute() needs (0 when it needs none)."""
        return self._workspace_bytes

    def allocate_workspace(self) -> torch.Tensor:
        """A uint8 tensor of ``workspace_size`` bytes on the plan's device (allocate before
        CUDA Graph capture; execute only binds it)."""
        return torch.empty(self._workspace_bytes, dtype=torch.uint8, device=self._device)

    def desc(self, name: str) -> TensorDesc:
        """The planned TensorDesc of an input, output or saved tensor, by argument name."""
        try:
            return self._descs[name]
        except KeyError:
            raise KeyError(f"{name!r}: this plan declares {sorted(self._descs)}") from None

    def compile(self) -> Plan:
        """Builds every launcher execute() will use (compiled artifacts are cached process-wide
        by plan-time values). Allocates no device memory. Returns the plan."""
        if self._launch is None:
            self._launch = self._build_launcher()
        return self

    @property
    def is_compiled(self) -> bool:
        return self._launch is not None

    def _build_launcher(self) -> Callable[..., None]:
        raise NotImplementedError

    # -- execute ------------------------------------------------------------------------------
    def _prepare_execute(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any], workspace,
                         current_stream) -> int | None:
        """Host-side checks of the buffers handed to execute(); returns the stream handle."""
        if self._launch is None:
            raise PlanStateError(f"{type(self).__name__}.execute() called before compile()")
        for group in (inputs, outputs):
            for name, tensor in group.items():
                desc = self._descs.get(name)
                if desc is None:
                    if tensor is not None:
                        raise ValidationError(
                            f"{name}: this plan was built without {name}; expected None, got "
                            f"{type(tensor).__name__}")
                    continue
                check_execute_tensor(name, tensor, desc, self._alignment[name])
        check_workspace(workspace, self._workspace_bytes, self._device)
        written = dict(outputs)
        if self._workspace_bytes:
            written["workspace"] = workspace
        check_no_overlap(inputs, written)
        return resolve_stream(current_stream, self._device)

    def _run(self, *args, stream: int | None) -> None:
        device = self._device
        if device.type == "cuda" and torch.cuda.current_device() != device.index:
            with torch.cuda.device(device):
                self._launch(*args, stream=stream)
        else:
            self._launch(*args, stream=stream)

    def __repr__(self) -> str:
        state = "compiled" if self.is_compiled else "not compiled"
        return f"{type(self).__name__}({self._describe()}, backend={self._backend}, {state})"

    def _describe(self) -> str:
        return ", ".join(f"{k}={list(d.shape)}:{str(d.dtype).removeprefix('torch.')}"
                         for k, d in self._descs.items())


class PlanCache:
    """LRU of compiled plans for the eager wrappers, keyed by TensorDescs and options."""

    def __init__(self, capacity: int = 128) -> None:
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, cls: type[Plan], *args, **options) -> Plan:
        key = (cls, args, tuple(sorted(options.items())))
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = cls(*args, **options).compile()
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._capacity:
                self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


EAGER_PLANS = PlanCache()


def describe(value) -> TensorDesc | None:
    """TensorDesc of a tensor (None stays None): the plan-cache key of an eager call."""
    return None if value is None else TensorDesc.from_tensor(value)
