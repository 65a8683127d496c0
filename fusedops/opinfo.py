"""What the registry knows about an operator family (in the spirit of PyTorch's OpInfo).

One ``OpInfo`` per family, defined in the family's package and listed once in
``fusedops.registry``: the tests, the demo, ``fusedops check``, the AOT compiles, the kernel
report, the API docs and the benchmarks all iterate it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .core.dtypes import accumulator_dtype


@dataclass(frozen=True)
class Tolerance:
    """Allowed error of a result against a float64 oracle: relative L2 (||a - b|| / ||b||) and
    max-abs over max-abs, with the reason for the figures."""

    rel_l2: float
    max_rel: float
    reason: str


@dataclass(frozen=True)
class Case:
    """One sample of a family: named tensors (None for an absent optional one) and options."""

    label: str
    tensors: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (of the first floating tensor)."""
        return next(t.dtype for t in self.tensors.values()
                    if isinstance(t, torch.Tensor) and t.is_floating_point())

    def reference(self) -> Case:
        """The same case in float64 on the CPU (integer and bool tensors kept): what the
        reference backend computes the expected results from."""
        def convert(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.detach().cpu()
            return t.double() if t.is_floating_point() else t
        return Case(self.label, {k: convert(v) for k, v in self.tensors.items()}, self.options)

    def to(self, device: torch.device) -> Case:
        """The same case on ``device``."""
        return Case(self.label, {k: v.to(device) if isinstance(v, torch.Tensor) else v
                                 for k, v in self.tensors.items()}, self.options)


@dataclass(frozen=True)
class PlanCall:
    """The arguments of one plan: its tensors (tensors or TensorDescs, including what execute()
    reads beyond the constructor's, such as a forward's saved buffer) and its options."""

    plan: type
    tensors: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self, backend: str = "auto"):
        """Constructs the plan (not compiled)."""
        args = {k: v for k, v in self.tensors.items() if k in self.plan._constructor_tensors}
        return self.plan(**args, **self.options, backend=backend)


TILES = "tiles"
"""The sample kind every family has for compiled code on the emulator: the production tile
configurations (wgmma, TMA, tcgen05 paths included) on small, ragged problems."""


@dataclass(frozen=True)
class OpInfo:
    """One operator family.

    ``cases(kind, dtype=, device=, backend=)``: sample inputs; kinds "small" (oracle checks),
    "edge" (sizes at and around the tile boundaries), the family's own (``sample_kinds``),
    "tiles" (``TILES``: bf16 problems whose static sizes make every kernel take its production
    tile configuration, at runtime sizes small enough for the PTX emulator) and "demo" (the
    demonstration's shape for that backend). ``sample_kinds``: every kind but "tiles" and
    "demo", the samples the family's oracle tests run and ``fusedops kernels --samples``
    compiles for every target; ``sample_dtypes``: the activation dtypes those samples are drawn
    in. ``emulated_cases``: the cases (``"kind:index"``, bf16) CI runs on the code compiled for
    every target, on the PTX emulator: together they launch every kernel of the family.
    ``production()``: (label, [PlanCall]) at the production shapes, as
    TensorDescs on the CPU (AOT compiles, kernel report). ``plan_calls(case, backend)``: every
    plan of the family with that case's arguments, in order (a backward's saved buffer comes
    from running the forward on ``backend``). ``run(case, backend)``: forward and backward
    through the plans; every output and gradient by name. ``oracle(case)``: the same names from
    independent float64 math. ``tolerance(name, dtype)``: the allowed error of result ``name``.
    ``index_fuzz(seed, backend, device)``: for families whose plans read index tensors, drawn
    ``fusedops.testing.fuzz.FuzzCase``s (valid and invalid index data) for the memory-safety
    fuzz test. ``demo_limit``: the demonstration's allowed relative L2 error (bf16 inputs) against the
    float64 reference: ``demo_reference`` "torch" (the torch backend on the case in float64, the
    cheap reference at large shapes) or "oracle" (``oracle(case)``, for families whose plans
    take no float64). ``bench``: the scripts in bench/ that measure the family.
    """

    name: str
    title: str
    doc: str
    plans: Sequence[type]
    eager: Sequence[Callable]
    torch_ops: Sequence[Callable]
    cases: Callable[..., list[Case]]
    production: Callable[[], list[tuple[str, list[PlanCall]]]]
    plan_calls: Callable[[Case, str], list[PlanCall]]
    run: Callable[[Case, str], dict[str, torch.Tensor]]
    oracle: Callable[[Case], dict[str, torch.Tensor]]
    tolerance: Callable[[str, torch.dtype], Tolerance]
    demo_limit: float
    bench: Sequence[str] = ()
    demo_reference: str = "torch"
    index_fuzz: Callable[..., list] | None = None
    sample_kinds: Sequence[str] = ("small", "edge")
    sample_dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16, torch.float16)
    emulated_cases: Sequence[str] = ("small:0",)

    @property
    def backends(self) -> tuple[str, ...]:
        """Every backend some plan of the family has."""
        names = []
        for plan in self.plans:
            names += [b for b in plan.backends if b not in names]
        return tuple(names)


# A result rounded once to a format with unit roundoff u differs from the exact value by at most
# u relative per element; fp32 accumulation over D <= 16K terms adds well under 1e-5.
ROUNDED_ONCE = {
    torch.float64: Tolerance(1e-12, 1e-12, "float64 reference math vs float64 oracle"),
    torch.float32: Tolerance(1e-5, 5e-5, "fp32 arithmetic (u = 6e-8), reductions of up to 16K "
                             "terms, gradients that subtract terms of similar size"),
    torch.float16: Tolerance(6e-4, 1.5e-3, "one fp16 rounding (u = 4.9e-4) after fp32 math"),
    torch.bfloat16: Tolerance(4e-3, 1.2e-2, "one bf16 rounding (u = 3.9e-3) after fp32 math"),
}

# fp32 results that are sums over N tokens of products that cancel, in another order than the
# reference's (grad_weight).
FP32_REDUCTION = Tolerance(2e-5, 1e-4, "fp32 sums over tokens of cancelling products, in another "
                           "order than the reference's")


def accumulated(dtype: torch.dtype) -> Tolerance:
    """The tolerance of an fp32 (fp64) accumulator result of an operator on ``dtype`` inputs."""
    acc = accumulator_dtype(dtype)
    return ROUNDED_ONCE[acc] if acc == torch.float64 else FP32_REDUCTION
