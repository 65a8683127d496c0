"""The plan lifecycle every operator follows, derived from each plan's declarations.

construct (validate everything, select the backend, ask it for its program) -> compile() (build
the program's launchers, cached process-wide) -> execute(...) many times (host checks of the
handed buffers, then launch; no allocation, conversion, compilation, synchronisation or device
read).

A plan class declares, once:

    op_name          the operator's name in messages
    backend_module   the family's module name in each backend package
    program          which program of that module serves the plan ("forward" ->
                     ``forward_program(problem)``)
    backends         the backends that implement it; ``auto_order``: auto's order on CUDA
    operands         its tensors (``fusedops.plan.operands``), in execute()'s order
    options          its scalar options (``fusedops.core.options.Option``)
    returns          the operands execute() returns, as a TupleDict

and implements ``_validate(descs, **options) -> problem``: the contract checks of its inputs,
the outputs it declares, and the plan-time facts (a frozen dataclass) the backend gets. The
base class derives the rest: execute()'s binding and checks, the result, the eager path and its
plan-cache key, allocation helpers and the repr.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

import torch

from ..core.checks import ExecuteChecks, expect_aligned, expect_last_dim_contiguous
from ..core.desc import TensorDesc
from ..core.index_checks import check_inputs_requested
from ..core.device import bind_device
from ..core.options import Option
from ..core.program import Program
from ..core.stream import allocation_stream, resolve_stream
from ..core.target import target_override
from ..core.tupledict import TupleDict
from ..core.workspace import aligned_bytes
from ..errors import PlanStateError, UnsupportedError, ValidationError
from .autotune import autotune_requested, tune
from .cache import EAGER_PLANS
from .operands import Operand
from .selection import select_backend


class Plan:
    """Base class of every operator plan (see the module docstring for what a subclass
    declares). Public surface: ``compile()``, ``execute(...)``, ``selected_backend``,
    ``device``, ``desc(name)``, ``workspace_size``/``allocate_workspace()``,
    ``saved_size``/``allocate_saved()``, ``allocate_outputs()``, ``program``, ``problem`` and
    one attribute per declared option."""

    op_name: ClassVar[str]
    backend_module: ClassVar[str]
    program_name: ClassVar[str] = "forward"
    backends: ClassVar[tuple[str, ...]] = ("torch", "triton")
    auto_order: ClassVar[tuple[str, ...]] = ("triton", "torch")
    operands: ClassVar[tuple[Operand, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    returns: ClassVar[tuple[str, ...]] = ()

    _constructor_tensors: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        params = inspect.signature(cls.__init__).parameters
        names = frozenset(o.name for o in cls.operands if o.name in params)
        if names:   # a subclass that only renames arguments (*args, **kwargs) keeps its parent's
            cls._constructor_tensors = names

    def __init__(self, tensors: Mapping[str, Any], options: Mapping[str, Any],
                 backend: str = "auto") -> None:
        self._requested_backend = backend
        self._descs: dict[str, TensorDesc] = {}
        self._first_declared: str | None = None
        self._device: torch.device | None = None
        self._launch: Callable[..., None] | None = None
        self.option_values = self.normalise_options(options)
        for name, value in self.option_values.items():
            setattr(self, name, value)
        for operand in self.operands:
            if operand.name in tensors and tensors[operand.name] is not None:
                self._declare(operand.name, tensors[operand.name], operand.alignment)
        if self._device is None:
            raise ValidationError(f"{type(self).__name__}: expected at least one tensor")
        self.problem = self._validate(dict(self._descs), **self.option_values)
        for operand in self.operands:                 # after the contract's shape and dtype checks
            if operand.strided and operand.name in tensors and operand.name in self._descs:
                expect_last_dim_contiguous(operand.name, self._descs[operand.name])
        self._backend, self._impl = select_backend(
            self.op_name, backend, self._device, self.problem, self.backend_module, self.backends,
            self.auto_order)
        self._program: Program = getattr(self._impl, f"{self.program_name}_program")(self.problem)
        self._alignment_of: Program | None = None
        self._execute_checks: tuple = (None, None, ())
        self._declare_program_buffers()

    # -- what a subclass implements ----------------------------------------------------------
    def _validate(self, descs: dict[str, TensorDesc], **options) -> Any:
        """Checks the declared inputs against the contract, declares the outputs
        (``_plan_tensor``) and returns the problem (plan-time facts) for the backend."""
        raise NotImplementedError

    def floor(self):
        """The operator's floor at this plan's sizes (``fusedops.core.cost.Cost``): the fewest
        FLOPs and HBM bytes any implementation needs, from the contract. None where the family
        does not model it yet."""
        return None

    def _check_index_values(self, tensors: Mapping[str, Any]) -> None:
        """Host checks of the index tensors' values (``check_index_values``); plans that read
        index data override it with the ``fusedops.core.index_checks`` helpers."""

    def _declare_program_buffers(self) -> None:
        """Declares the opaque saved buffer, sized by the selected backend's program."""
        for operand in self.operands:
            if operand.saved_buffer:
                self._descs[operand.name] = TensorDesc((self._program.saved.size,), torch.uint8,
                                                       device=self._device)

    # -- declarations --------------------------------------------------------------------------
    @classmethod
    def normalise_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """The validated, normalised option values (missing ones take their defaults)."""
        return {o.name: o.normalise(options.get(o.name, o.default)) for o in cls.options}

    def _declare(self, name: str, value, alignment: int) -> TensorDesc:
        """Records a tensor given as a tensor or a TensorDesc, bound to the plan's device."""
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
        return desc

    def _plan_tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorDesc:
        """Declares a tensor the plan itself sizes (an output, or an input such as an rng seed
        whose shape follows from the others)."""
        desc = TensorDesc(tuple(shape), dtype, device=self._device)
        self._descs[name] = desc
        return desc

    # -- public surface -----------------------------------------------------------------------
    @property
    def selected_backend(self) -> str:
        """The backend that serves this plan: ``torch``, ``triton`` or ``cute``."""
        return self._backend

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def program(self) -> Program:
        """What the selected backend runs: buffer layouts and kernel stages."""
        return self._program

    def kernel_program(self, backend: str) -> Program:
        """The program ``backend`` would run for this plan's problem, without selecting it (no
        availability check): for ahead-of-time compiles, the kernel report and benchmarks."""
        import importlib
        module = importlib.import_module(f"fusedops.backends.{backend}.{self.backend_module}")
        return getattr(module, f"{self.program_name}_program")(self.problem)

    @property
    def workspace_size(self) -> int:
        """Bytes of caller workspace execute() needs (0 when it needs none)."""
        return self._program.workspace.size

    @property
    def _workspace_alignment(self) -> int:
        """The alignment execute() requires of the workspace (the program's, on this device),
        found once per program."""
        program = self._program
        if self._alignment_of is not program:
            self._alignment_of = program
            self._alignment = program.workspace_alignment(self._device)
        return self._alignment

    def allocate_workspace(self) -> torch.Tensor:
        """A uint8 tensor of ``workspace_size`` bytes on the plan's device, aligned as execute()
        requires (allocate before CUDA Graph capture; execute only binds it)."""
        return aligned_bytes(self.workspace_size, self._workspace_alignment, self._device)

    @property
    def saved_size(self) -> int:
        """Bytes of the opaque ``saved`` buffer a forward writes and its backward reads (0 for a
        backend that recomputes, or a plan without one)."""
        return self._program.saved.size

    def allocate_saved(self) -> torch.Tensor:
        """A uint8 tensor of ``saved_size`` bytes on the plan's device."""
        return torch.empty(self.saved_size, dtype=torch.uint8, device=self._device)

    def desc(self, name: str) -> TensorDesc:
        """The planned TensorDesc of an input, output or saved tensor, by argument name."""
        try:
            return self._descs[name]
        except KeyError:
            raise KeyError(f"{name!r}: this plan declares {sorted(self._descs)}") from None

    def allocate_outputs(self, exclude=()) -> dict[str, torch.Tensor]:
        """Allocates (torch.empty) every output execute() writes, by name, except ``exclude``."""
        return {o.name: self._empty(o.name) for o in self.operands
                if o.role == "out" and o.name in self._descs and o.name not in exclude}

    def _empty(self, name: str) -> torch.Tensor:
        d = self._descs[name]
        return torch.empty(d.shape, dtype=d.dtype, device=self._device)

    def check_index_values(self, **tensors) -> None:
        """Checks the values of the index tensors among ``tensors`` (by name) on the host and
        raises ValidationError naming the argument and the first bad entry. It copies them to
        the host, a synchronisation: for eager use and debugging (the eager wrappers'
        ``check_inputs=True`` or FUSEDOPS_CHECK_INPUTS=1), never inside execute(), where the
        kernels clamp or mask and report through the ``status`` word instead."""
        self._check_index_values(tensors)

    def compile(self, autotune: bool | None = None) -> Plan:
        """Builds every launcher execute() will use (compiled artifacts are cached process-wide
        by plan-time values). Allocates no device memory. Returns the plan.

        ``autotune=True`` (or FUSEDOPS_AUTOTUNE=1 for CUDA plans) first times the backend's
        candidate configurations on the device (allocating temporary inputs) and keeps the
        fastest, remembered on disk (``fusedops.plan.autotune``); ``workspace_size`` may change
        with the choice, so allocate the workspace after compile()."""
        if self._launch is None:
            if autotune_requested(autotune, self._device):
                self._program = self._tuned_program(explicit=autotune is True)
            names = frozenset(self._descs) | {"workspace"}
            self._launch = self._program.build(self._device, names)
        return self

    def _tuned_program(self, explicit: bool) -> Program:
        candidates = getattr(self._impl, f"{self.program_name}_candidates", None)
        if candidates is None:
            if explicit:
                raise UnsupportedError(f"autotune: the {self._backend} backend has no candidate "
                                       f"configurations for {self.op_name}")
            return self._program
        build = getattr(self._impl, f"{self.program_name}_program")
        _, program = tune(self, candidates(self.problem),
                          lambda config: build(self.problem, config=config),
                          device_name=torch.cuda.get_device_name(self._device))
        if program.saved.size != self._program.saved.size:
            raise PlanStateError(f"{self.op_name}: an autotune candidate changed the saved layout")
        return program

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Valid values for the plan's index tensors when its candidates are timed (plans that
        read index data override it); other tensors get random values."""
        return {}

    def _tuning_binding(self) -> dict[str, torch.Tensor]:
        """Inputs and outputs of the plan's shapes for timing candidates (allocates)."""
        binding = dict(self._tuning_tensors())
        gen = torch.Generator(device=self._device).manual_seed(0)
        for name, desc in self._descs.items():
            if name in binding:
                continue
            if desc.dtype.is_floating_point and desc.dtype.itemsize > 1:
                binding[name] = 0.1 * torch.randn(desc.shape, generator=gen, device=self._device,
                                                  dtype=torch.float32).to(desc.dtype)
            elif desc.dtype == torch.bool:
                binding[name] = torch.ones(desc.shape, dtype=torch.bool, device=self._device)
            else:
                binding[name] = torch.zeros(desc.shape, dtype=desc.dtype, device=self._device)
        return binding

    @property
    def is_compiled(self) -> bool:
        return self._launch is not None

    # -- execute ------------------------------------------------------------------------------
    def _execute(self, args: Mapping[str, Any]) -> Any:
        """execute()'s body: checks the handed buffers (host facts only; ``ExecuteChecks``:
        decided once per argument signature, overlap on every call), launches, returns."""
        if self._launch is None:
            raise PlanStateError(f"{type(self).__name__}.execute() called before compile()")
        program, checks, names = self._execute_checks
        if program is not self._program:
            program, checks, names = self._execute_checks = self._make_execute_checks()
        checks(args)
        binding = {name: args.get(name) for name in names}
        stream = resolve_stream(args.get("current_stream"), self._device)
        self._run(binding, stream)
        return self._result(binding)

    def _make_execute_checks(self) -> tuple[Program, ExecuteChecks, tuple[str, ...]]:
        """(the program they hold for, execute()'s checks, the names execute() binds)."""
        operands = [(o.name, self._descs.get(o.name), o.alignment, o.strided, o.is_written)
                    for o in self.operands]
        checks = ExecuteChecks(operands, (self.workspace_size, self._device,
                                          self._workspace_alignment))
        names = tuple(o.name for o in self.operands if o.name in self._descs) + ("workspace",)
        return self._program, checks, names

    def _result(self, binding: Mapping[str, Any]) -> Any:
        """The TupleDict of the declared ``returns`` the plan has."""
        return TupleDict(**{name: binding[name] for name in self.returns if name in binding})

    def _run(self, binding: Mapping[str, Any], stream) -> None:
        device = self._device
        if device.type == "cuda" and torch.cuda.current_device() != device.index:
            with torch.cuda.device(device):
                self._launch(binding, stream)
        else:
            self._launch(binding, stream)

    # -- eager ----------------------------------------------------------------------------------
    @classmethod
    def cached(cls, tensors: Mapping[str, Any], *, backend: str = "auto", **options) -> Plan:
        """The compiled plan for these tensors (tensors or TensorDescs) and options, from the
        process-wide eager plan cache (keyed also by a forced tile-table family: see
        ``core.target.target_override``). Options are validated before the lookup."""
        signature = _call_signature(cls, tensors, options, backend)
        plan = EAGER_PLANS.lookup(signature) if signature is not None else None
        if plan is not None:
            return plan
        values = cls.normalise_options(options)
        descs = {name: _describe(name, value) for name, value in tensors.items()
                 if name in cls._constructor_tensors}
        key = (cls, tuple(sorted(descs.items())), tuple(values.items()), backend,
               target_override())
        plan = EAGER_PLANS.get(key, lambda: cls(**descs, **values, backend=backend).compile())
        if signature is not None:
            EAGER_PLANS.put(signature, plan)
        return plan

    @classmethod
    def eager(cls, tensors: Mapping[str, Any], *, backend: str = "auto", current_stream=None,
              check_inputs: bool | None = None, **options) -> Any:
        """Builds (cached) the plan, allocates its outputs, saved buffer and workspace on the
        launch stream and executes; returns execute()'s result. ``check_inputs`` (default: the
        FUSEDOPS_CHECK_INPUTS environment switch) first checks the index tensors' values on the
        host (``check_index_values``)."""
        check = check_inputs_requested(check_inputs)
        plan = cls.cached(tensors, backend=backend, **options)
        if check:
            plan.check_index_values(**tensors)
        given = {n for n, v in tensors.items() if isinstance(v, torch.Tensor)}
        with allocation_stream(current_stream, plan.device):
            buffers = plan.allocate_outputs(exclude=given)
            workspace = plan.allocate_workspace() if plan.workspace_size else None
        return plan._execute({**tensors, **buffers, "workspace": workspace,
                              "current_stream": current_stream})

    # -- repr ----------------------------------------------------------------------------------
    def __repr__(self) -> str:
        state = "compiled" if self.is_compiled else "not compiled"
        tensors = ", ".join(f"{k}={list(d.shape)}:{str(d.dtype).removeprefix('torch.')}"
                            for k, d in self._descs.items())
        options = "".join(f", {k}={v!r}" for k, v in self.option_values.items())
        return f"{type(self).__name__}({tensors}{options}, backend={self._backend}, {state})"


def _call_signature(cls, tensors: Mapping[str, Any], options: Mapping[str, Any],
                    backend: str) -> tuple | None:
    """An eager call's arguments as they were passed, cheap to build: each constructor tensor's
    dtype, shape, strides and device (what its TensorDesc holds), each option with its type (so
    64 and 64.0, 1 and True differ), the backend and the forced target. It maps to the plan only
    after a call with exactly these arguments was validated and built; None (look up by the
    validated key) when an argument is neither a tensor nor None or an option is unhashable."""
    parts = []
    for name in sorted(tensors):
        if name not in cls._constructor_tensors:
            continue
        value = tensors[name]
        if value is None:
            parts.append((name, None))
        elif isinstance(value, torch.Tensor):
            parts.append((name, value.dtype, value.shape, value.stride(), value.device))
        else:
            return None
    given = tuple((name, type(value), value) for name, value in sorted(options.items()))
    signature = (cls, tuple(parts), given, backend, target_override())
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


def _describe(name: str, value) -> TensorDesc | None:
    if value is None or isinstance(value, TensorDesc):
        return value
    if isinstance(value, torch.Tensor):
        return TensorDesc.from_tensor(value)
    raise ValidationError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
