"""Ahead-of-time compiles of every kernel of every plan at the registry's production shapes,
no GPU needed: ``python -m fusedops.aot --backend triton --arch 90 100`` prints registers,
local (spill) and shared memory per kernel from the cubin; ``--backend cute --arch sm_90a
sm_100a`` compiles the CuTe DSL kernels to PTX and assembles them with ``ptxas -v``; ``--json``
for machines. Triton AOT compiles run in a process without ``TRITON_INTERPRET`` (the test suite
calls this module as a subprocess).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .registry import FAMILIES

KERNEL_BACKENDS = ("triton", "cute")
DEFAULT_ARCHS = {"triton": ("90", "100"), "cute": ("sm_90a", "sm_100a")}


@dataclass(frozen=True)
class ProductionKernel:
    """One kernel of one plan's program at a production shape."""

    family: str
    label: str          # the shape's label, e.g. "gate S4 D5120 bf16 mask"
    plan: str           # the plan class
    kernel: Any         # KernelSpec (triton) or CuteKernel (cute), carrying its grid


def production_kernels(backend: str) -> Iterator[ProductionKernel]:
    """Every distinct kernel ``backend`` runs for the registry's production plans (a kernel two
    plans share, with the same specialisation, is listed once)."""
    seen = set()
    for info in FAMILIES:
        for label, calls in info.production():
            for call in calls:
                if backend not in call.plan.backends:
                    continue
                plan = call.build("torch")
                for kernel in plan.kernel_program(backend).kernels:
                    if kernel in seen:
                        continue
                    seen.add(kernel)
                    yield ProductionKernel(info.name, label, call.plan.__name__, kernel)


def resource_rows(backend: str, archs, only: str = "") -> Iterator[dict]:
    """One dict per (kernel, arch): label, plan, kernel name and the compiled resources."""
    if backend == "triton":
        from .backends.triton.aot import resource_usage

        def usage(kernel, arch):
            return resource_usage(kernel, int(arch))
    else:
        from .backends.cute.aot import ptxas_usage as usage
    for item in production_kernels(backend):
        if only not in f"{item.label} {item.kernel.name}":
            continue
        for arch in archs:
            yield dict(family=item.family, label=item.label, plan=item.plan,
                       **dataclasses.asdict(usage(item.kernel, arch)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=KERNEL_BACKENDS, default="triton")
    parser.add_argument("--arch", nargs="+", help="90 100 (triton) or sm_90a sm_100a (cute)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--only", default="", help="substring of '<label> <kernel name>' to compile")
    args = parser.parse_args(argv)
    from .backends.triton import interpreter_active
    if args.backend == "triton" and interpreter_active():
        parser.error("unset TRITON_INTERPRET: AOT compiles need Triton's JIT, not the interpreter")
    for row in resource_rows(args.backend, args.arch or DEFAULT_ARCHS[args.backend], args.only):
        if args.json:
            print(json.dumps(row, default=str), flush=True)
        else:
            fields = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("family", "label", "plan"))
            print(f"{row['label']:<40} {row['plan']:<26} {fields}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
