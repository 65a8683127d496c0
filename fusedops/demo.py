"""The demonstration and environment report behind ``python -m fusedops``: every operator family
of the registry, forward and backward, on every backend this machine runs, against the float64
reference."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass

import torch

from . import __version__
from .errors import UnsupportedError
from .opinfo import OpInfo
from .plan.selection import BACKENDS, backend_unavailable_reason
from .registry import FAMILIES
from .testing import default_device, runnable_backends


@dataclass
class Row:
    op: str
    backend: str
    shape: str
    fwd_err: float
    bwd_err: float | None
    ms: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.fwd_err <= self.limit and (self.bwd_err is None or self.bwd_err <= self.limit)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    a, e = actual.double().cpu(), expected.double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


def gradient_names(info: OpInfo) -> set[str]:
    """The results of the family's backward plans."""
    return {name for plan in info.plans if plan.program_name == "backward" for name in plan.returns}


def _label(backend: str, device: torch.device) -> str:
    if device.type != "cpu":
        return backend
    return backend + {"triton": " (interpreter)", "cute": " (PTX emulator)"}.get(backend, "")


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def family_rows(info: OpInfo, device: torch.device, backends: list[str]) -> list[Row]:
    """One row per (demo case, backend): the largest relative L2 error of the forward results
    and of the gradients against the torch backend in float64, and one warm run's time."""
    rows, grads = [], gradient_names(info)
    for backend in backends:
        for case in info.cases("demo", dtype=torch.bfloat16, device=device, backend=backend):
            try:
                results = info.run(case, backend)
            except UnsupportedError as error:
                print(f"  {info.title} on {backend}: not run ({error})")
                continue
            ms = _timed(lambda: info.run(case, backend), device)
            expected = (info.oracle(case) if info.demo_reference == "oracle"
                        else info.run(case.reference(), "torch"))
            fwd = [rel_l2(v, expected[k]) for k, v in results.items() if k not in grads]
            bwd = [rel_l2(v, expected[k]) for k, v in results.items() if k in grads]
            rows.append(Row(info.title, _label(backend, device), case.label, max(fwd),
                            max(bwd) if bwd else None, ms, info.demo_limit))
    return rows


def run_demo() -> int:
    device = default_device()
    print(f"fusedops {__version__} demo on {device} ({_device_label(device)})")
    print("each operator family forward + backward against the float64 torch reference; errors "
          "are the largest relative L2 error over the forward results and over the gradients\n")
    backends = runnable_backends(device)
    rows = []
    for i, info in enumerate(FAMILIES, 1):
        print(f"  [{i}/{len(FAMILIES)}] {info.title} ...", file=sys.stderr, flush=True)
        rows += family_rows(info, device, [b for b in backends if b in info.backends])
    header = (f"{'operator':<36} {'backend':<21} {'shape':<40} {'fwd err':>9} {'bwd err':>9} "
              f"{'limit':>8} {'ms':>9}  result")
    print(header)
    print("-" * len(header))
    for r in rows:
        bwd = f"{r.bwd_err:>9.2e}" if r.bwd_err is not None else f"{'-':>9}"
        print(f"{r.op:<36} {r.backend:<21} {r.shape:<40} {r.fwd_err:>9.2e} {bwd} "
              f"{r.limit:>8.1e} {r.ms:>9.2f}  {'PASS' if r.ok else 'FAIL'}")
    print("\nlimits: one bf16 rounding after fp32 math (8e-3); bf16 operands of tensor-core "
          "products (2.5e-2). Times are one warm forward + backward through the plans "
          "(construction and compile-cache lookups included), not a benchmark (see bench/).")
    return 0 if rows and all(r.ok for r in rows) else 1


def _device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def run_check() -> int:
    import importlib.metadata as md
    print(f"fusedops {__version__}, python {platform.python_version()}, torch {torch.__version__}")
    for dist in ("triton", "nvidia-cutlass-dsl", "cuda-python"):
        try:
            print(f"  {dist}: {md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"  {dist}: not installed")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
            devices.append(torch.device("cuda", i))
    else:
        print("  CUDA: not available")
    for device in devices:
        print(f"\nbackends on {device}:")
        for backend in BACKENDS:
            reason = backend_unavailable_reason(backend, device)
            served = [p.op_name for info in FAMILIES for p in info.plans if backend in p.backends]
            if reason is None and served:
                print(f"  {backend:<7} serves: {', '.join(served)}")
            else:
                print(f"  {backend:<7} unavailable: {reason or 'no operator implemented on this backend yet'}")
    return 0
