"""Ahead-of-time compiles of every Triton kernel at its production specialisations, no GPU
needed: ``python -m fusedops.backends.triton.aot --arch 90 100`` prints registers, local (spill)
and shared memory per kernel from the cubin, ``--json`` for machines. Runs in a process without
``TRITON_INTERPRET`` (the test suite calls it as a subprocess)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys

from fusedops._backend import triton_interpreter_active

from .compiler import resource_usage

# Every Triton operator module lists its production specialisations in ``aot_specs()``.
OPERATOR_MODULES = ("fusedops.backends.triton.engram", "fusedops.backends.triton.mamba2",
                    "fusedops.backends.triton.mamba2_inference", "fusedops.backends.triton.attention",
                    "fusedops.backends.triton.moe_router", "fusedops.backends.triton.moe")


def all_specs():
    for module in OPERATOR_MODULES:
        yield from importlib.import_module(module).aot_specs()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 100])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--only", default="", help="substring of the labels to compile")
    args = parser.parse_args(argv)
    if triton_interpreter_active():
        parser.error("unset TRITON_INTERPRET: AOT compiles need Triton's JIT, not the interpreter")
    for label, spec in all_specs():
        if args.only not in label:
            continue
        for arch in args.arch:
            usage = resource_usage(spec, arch)
            if args.json:
                print(json.dumps(dict(label=label, **dataclasses.asdict(usage))), flush=True)
            else:
                print(f"{label:<44} {usage.row()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
