"""Ahead-of-time compiles of every CuTe DSL kernel at its production specialisations, no GPU
needed: ``python -m fusedops.backends.cute.aot --arch sm_90a sm_100a`` keeps the PTX, assembles
it with ``ptxas -v`` and prints registers, spills and shared memory per kernel (``--json`` for
machines)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys

from .compiler import ptxas_usage

# Every CuTe operator module lists its production specialisations in ``aot_kernels()``.
OPERATOR_MODULES = ("fusedops.backends.cute.engram",)


def all_kernels():
    for module in OPERATOR_MODULES:
        yield from importlib.import_module(module).aot_kernels()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", nargs="+", default=["sm_90a", "sm_100a"])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    for label, kernel in all_kernels():
        for arch in args.arch:
            usage = ptxas_usage(kernel, arch)
            if args.json:
                print(json.dumps(dict(label=label, **dataclasses.asdict(usage))), flush=True)
            else:
                print(f"{label:<28} {usage.kernel:<18} {arch:<8} regs {usage.registers:>3}  spills "
                      f"{usage.spill_bytes:>4} B  stack {usage.stack_bytes:>3} B  shared "
                      f"{usage.shared_bytes:>5} B", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
