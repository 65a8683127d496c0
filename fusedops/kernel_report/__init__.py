"""The kernel report (``fusedops kernels``): every kernel of every plan at the registry's production
shapes, compiled for each target architecture, with what the compiler made of it (registers,
spills, shared memory, occupancy, MMA kind and count from the SASS, TMA, barriers) beside the
analytic model the backend attached (FLOPs, HBM bytes) and its roofline floor time on each
modelled GPU; and per plan, the modelled total against the operator's floor. Needs no GPU.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.cost import Cost, total
from ..core.target import compiling_for, normalise_arch
from ..registry import FAMILIES
from .compiled import Compiled, compile_cute, compile_triton
from ..core.machines import GPUS, gpus_for
from .occupancy import Occupancy, occupancy

KERNEL_BACKENDS = {"triton": ("sm_90a", "sm_100a", "sm_80"), "cute": ("sm_90a", "sm_100a")}


@dataclass(frozen=True)
class PlanKernels:
    """One production plan on one backend: its kernels for an architecture, and its floor."""

    family: str
    label: str
    plan: str
    backend: str
    built: Any                   # the plan, built from TensorDescs on the CPU
    floor: Cost | None

    def kernels(self, arch: str) -> tuple[Any, ...]:
        """The kernels the backend runs for the plan on ``arch`` (its tile table's entry)."""
        with compiling_for(arch):
            return self.built.kernel_program(self.backend).kernels

    def unsupported(self, arch: str) -> str | None:
        """Why the backend cannot compile the plan for ``arch`` (its family module's
        ``unsupported_arch_reason``), or None."""
        import importlib
        module = importlib.import_module(f"fusedops.backends.{self.backend}.{self.built.backend_module}")
        check = getattr(module, "unsupported_arch_reason", None)
        return None if check is None else check(self.built.problem, normalise_arch(arch))


@dataclass
class KernelRow:
    """One kernel of one plan compiled for one architecture."""

    family: str
    label: str
    plan: str
    backend: str
    kernel: str
    arch: str
    warps: int
    stages: int
    grid_ctas: int
    compiled: Compiled
    occupancy: Occupancy
    cost: Cost | None
    artifacts: dict = field(default_factory=dict, repr=False)

    def floor_us(self) -> dict[str, float]:
        """Roofline time of the modelled cost on each GPU that runs this arch, in µs."""
        if self.cost is None:
            return {}
        return {g.name: 1e6 * _seconds(self.cost, g) for g in gpus_for(self.arch)}

    def as_dict(self) -> dict:
        c = self.compiled
        out = dict(family=self.family, label=self.label, plan=self.plan, backend=self.backend,
                   kernel=self.kernel, arch=self.arch, registers=c.registers,
                   spill_bytes=c.spill_bytes, shared_bytes=c.shared_bytes, warps=self.warps,
                   stages=self.stages, ctas_per_sm=self.occupancy.ctas_per_sm,
                   occupancy_limited_by=self.occupancy.limited_by,
                   waves=round(self.occupancy.waves, 3), grid_ctas=self.grid_ctas, mma=c.mma,
                   wgmma_async=c.wgmma_async, wgmma_in_flight=c.wgmma_in_flight,
                   wgmma_overlap=c.wgmma_overlap, copies=c.copies, barriers=c.barriers)
        if self.cost is not None:
            out.update(flops=self.cost.flops, mma_flops=self.cost.mma_flops,
                       bytes_read=self.cost.bytes_read, bytes_written=self.cost.bytes_written,
                       mma_rows=self.cost.mma_rows, mma_duplication=self.cost.mma_duplication,
                       intensity=None if math.isinf(self.cost.intensity) else self.cost.intensity,
                       floor_us=self.floor_us())
        return out


def _seconds(cost: Cost, gpu) -> float:
    """Roofline: tensor-core FLOPs at the bf16 peak and the rest at the fp32 CUDA-core peak,
    against the bytes at the HBM bandwidth."""
    compute = cost.mma_flops / (gpu.bf16_tflops * 1e12) + \
        (cost.flops - cost.mma_flops) / (gpu.fp32_tflops * 1e12)
    return max(compute, cost.bytes / (gpu.hbm_tbps * 1e12))


def production_plans(backends: Sequence[str] = tuple(KERNEL_BACKENDS),
                     only: str = "") -> Iterator[PlanKernels]:
    """Every production plan of the registry on every kernel backend that implements it."""
    for info in FAMILIES:
        for label, calls in info.production():
            for call in calls:
                plan = call.build("torch")
                for backend in backends:
                    if backend not in call.plan.backends:
                        continue
                    kernels = plan.kernel_program(backend).kernels
                    if only and not any(only in f"{label} {k.name}" for k in kernels):
                        continue
                    yield PlanKernels(info.name, label, call.plan.__name__, backend, plan,
                                      plan.floor())


@dataclass(frozen=True)
class CompileFailure:
    """A kernel that did not compile for an architecture: the compiler's message."""

    error: str


_TASKS: list = []      # (backend, kernel, arch, read) to compile; read by forked workers by index


def _compile_task(index: int):
    backend, kernel, arch, read = _TASKS[index]
    compile_one = compile_triton if backend == "triton" else compile_cute
    try:
        return compile_one(kernel, arch, read=read)
    except Exception as e:      # reported with the kernel and arch by the caller
        return CompileFailure(error_text(e))


def error_text(error: BaseException) -> str:
    """An exception and its causes, outermost first, one "Type: message" each (a Triton
    CompilationError points at the source line; its cause says what the compiler refused)."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {str(error).strip()[-2000:]}")
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return "\n".join(parts)


def compile_kernels(keys: Sequence[tuple], jobs: int | None = None,
                    read: bool = True) -> dict[tuple, Any]:
    """Compiles each (backend, kernel, arch) of ``keys`` once, ``jobs`` compiler processes side
    by side (default: one per CPU core). Per key: (Compiled, {"ptx", "sass", "cubin"}), or
    without ``read`` (None, {}) (compiled, the cubin not read back), or a ``CompileFailure``."""
    keys = list(dict.fromkeys(keys))
    _TASKS[:] = [(*key, read) for key in keys]
    jobs = max(1, jobs or os.cpu_count() or 1)
    if jobs > 1 and len(keys) > 1:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = pool.map(_compile_task, range(len(keys)), chunksize=1)
    else:
        results = [_compile_task(i) for i in range(len(keys))]
    return dict(zip(keys, results))


def plan_entries(plans: Sequence[PlanKernels],
                 archs: Sequence[str] | None = None) -> list[tuple[PlanKernels, Any, str]]:
    """(plan, kernel, arch) for every kernel of ``plans`` on each architecture of its backend
    (or of ``archs``) that the backend does not refuse (``unsupported``)."""
    entries = []
    for p in plans:
        for arch in archs or KERNEL_BACKENDS[p.backend]:
            if arch in KERNEL_BACKENDS[p.backend] and not p.unsupported(arch):
                entries += [(p, kernel, arch) for kernel in p.kernels(arch)]
    return entries


def kernel_rows(plans: Sequence[PlanKernels], archs: Sequence[str] | None = None,
                keep_artifacts: bool = False, jobs: int | None = None) -> list[KernelRow]:
    """Compiles every kernel of ``plans`` for its backend's architectures (or ``archs``); a
    kernel shared by several plans with the same specialisation is compiled once per arch.
    ``jobs`` compiler processes run side by side (default: one per CPU core). A kernel that
    does not compile raises, naming it and the arch."""
    entries = plan_entries(plans, archs)
    compiled = compile_kernels([(p.backend, kernel, arch) for p, kernel, arch in entries], jobs)
    rows = []
    for p, kernel, arch in entries:
        result = compiled[(p.backend, kernel, arch)]
        if isinstance(result, CompileFailure):
            raise RuntimeError(f"{p.label} {p.plan}: {kernel.name} does not compile for {arch}: "
                               f"{result.error}")
        rows.append(_row(p, kernel, arch, result[0], result[1] if keep_artifacts else {}))
    return rows


def _row(p: PlanKernels, kernel, arch: str, compiled: Compiled, artifacts) -> KernelRow:
    if p.backend == "triton":
        threads, warps, stages, grid = kernel.threads, kernel.num_warps, kernel.num_stages, kernel.grid
    else:
        threads, stages, grid = kernel.threads, 1, kernel.launch_grid or (0, 1, 1)
        warps = threads // 32
    ctas = math.prod(grid)
    occ = occupancy(arch, compiled.registers, threads, compiled.shared_bytes, ctas)
    return KernelRow(p.family, p.label, p.plan, p.backend, kernel.name, arch, warps, stages, ctas,
                     compiled, occ, kernel.cost, artifacts)


def unsupported(plans: Sequence[PlanKernels], archs: Sequence[str] | None = None) -> list[dict]:
    """(plan, arch) pairs a backend cannot compile, with its reason: stated, not silently left
    out of the report."""
    out = []
    for p in plans:
        for arch in archs or KERNEL_BACKENDS[p.backend]:
            reason = arch in KERNEL_BACKENDS[p.backend] and p.unsupported(arch)
            if reason:
                out.append(dict(family=p.family, label=p.label, plan=p.plan, backend=p.backend,
                                arch=arch, reason=reason))
    return out


@dataclass
class PlanTotal:
    """A plan's modelled kernels against its floor, on one backend and arch."""

    family: str
    label: str
    plan: str
    backend: str
    arch: str
    modelled: Cost | None        # None when a kernel of the plan has no model
    floor: Cost | None

    @property
    def traffic_ratio(self) -> float | None:
        """Modelled HBM bytes over the floor's."""
        if self.modelled is None or self.floor is None or not self.floor.bytes:
            return None
        return self.modelled.bytes / self.floor.bytes

    def as_dict(self) -> dict:
        out = dict(family=self.family, label=self.label, plan=self.plan, backend=self.backend,
                   arch=self.arch, traffic_ratio=self.traffic_ratio)
        for name, cost in (("modelled", self.modelled), ("floor", self.floor)):
            if cost is not None:
                out[name] = dict(flops=cost.flops, bytes=cost.bytes, floor_us={
                    g.name: 1e6 * _seconds(cost, g) for g in gpus_for(self.arch)})
        return out


def plan_totals(plans: Sequence[PlanKernels], arch: str = "sm_90a") -> list[PlanTotal]:
    """Per plan: the sum of its kernels' models (None if one is unmodelled) and its floor."""
    out = []
    for p in plans:
        if arch not in KERNEL_BACKENDS[p.backend] or p.unsupported(arch):
            continue
        costs = [k.cost for k in p.kernels(arch)]
        modelled = None if any(c is None for c in costs) else total(costs)
        out.append(PlanTotal(p.family, p.label, p.plan, p.backend, arch, modelled, p.floor))
    return out


__all__ = ["GPUS", "KERNEL_BACKENDS", "CompileFailure", "KernelRow", "PlanKernels", "PlanTotal",
           "compile_kernels", "kernel_rows", "plan_entries", "plan_totals", "production_plans",
           "unsupported"]
