"""``fusedops kernels --samples``: every kernel of every plan of every registry sample compiled
for every target, beside the production plans: what the tests run on the interpreter and
emulator at small and edge shapes must also compile for a GPU.

Each family's ``sample_kinds`` in each of its ``sample_dtypes`` (``fusedops.opinfo.OpInfo``):
the plans of ``plan_calls(case, "torch")`` (a backward's saved buffer from the torch backend's
forward), each built on the CPU and asked for every kernel backend's program with each target's
tile table; identical kernel specialisations are compiled once per target (``compile_kernels``,
the report's process pool), without reading the cubins back.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Iterator, Sequence

from ..registry import FAMILIES
from . import (KERNEL_BACKENDS, CompileFailure, PlanKernels, compile_kernels, error_text,
               plan_entries, production_plans, unsupported)

PRODUCTION = "production"
"""The label prefix of the production plans among the samples."""


def _matches(plan, backend: str, label: str, only: str) -> bool:
    return not only or any(only in f"{label} {k.name}"
                           for k in plan.kernel_program(backend).kernels)


def sample_plans(backends: Sequence[str] = tuple(KERNEL_BACKENDS),
                 only: str = "") -> Iterator[PlanKernels]:
    """Every plan of every registry sample, labelled "<kind> <case label>", then every
    production plan, labelled "production <label>", on every kernel backend that implements
    it (``only``: a substring of "<label> <kernel name>")."""
    for info in FAMILIES:
        if not any(b in backends for b in info.backends):
            continue
        for dtype in info.sample_dtypes:
            for kind in info.sample_kinds:
                for case in info.cases(kind, dtype=dtype):
                    label = f"{kind} {case.label}"
                    for call in info.plan_calls(case, "torch"):
                        plan = call.build("torch")
                        for backend in backends:
                            if backend in call.plan.backends and _matches(plan, backend, label,
                                                                          only):
                                yield PlanKernels(info.name, label, call.plan.__name__, backend,
                                                  plan, None)
    for p in production_plans(backends, only):
        yield dataclasses.replace(p, label=f"{PRODUCTION} {p.label}")


def sample_compiles(plans: Sequence[PlanKernels], archs: Sequence[str] | None = None,
                    jobs: int | None = None) -> tuple[int, list[dict]]:
    """Compiles every kernel of ``plans`` for its backend's architectures (or ``archs``), each
    distinct specialisation once per arch. Returns (distinct specialisations, failures): one
    dict per (plan, kernel, arch) that did not compile, naming its family, label, plan,
    backend, kernel and arch, with the compiler's error; a program the backend could not build
    for the arch is a failure of kernel "(program)"."""
    entries, failures = [], []
    for p in plans:
        for arch in archs or KERNEL_BACKENDS[p.backend]:
            try:
                entries += plan_entries([p], [arch])
            except Exception as e:      # the program's construction, reported with the plan
                failures.append(_failure(p, "(program)", arch, error_text(e)))
    results = compile_kernels([(p.backend, kernel, arch) for p, kernel, arch in entries], jobs,
                              read=False)
    for p, kernel, arch in entries:
        result = results[(p.backend, kernel, arch)]
        if isinstance(result, CompileFailure):
            failures.append(_failure(p, kernel.name, arch, result.error))
    return len(results), failures


def _failure(p: PlanKernels, kernel: str, arch: str, error: str) -> dict:
    return dict(family=p.family, label=p.label, plan=p.plan, backend=p.backend, kernel=kernel,
                arch=arch, error=error)


def summary(plans: Sequence[PlanKernels]) -> dict[str, dict]:
    """Per family: its plans (one per plan and backend) and the sample kinds they came from."""
    out: dict[str, dict] = collections.defaultdict(lambda: dict(plans=0, kinds=set()))
    for p in plans:
        out[p.family]["plans"] += 1
        out[p.family]["kinds"].add(p.label.split(" ", 1)[0])
    return {f: dict(plans=v["plans"], kinds=sorted(v["kinds"])) for f, v in out.items()}


def main(args) -> int:
    """The ``--samples`` run of ``fusedops kernels`` (``args``: its parsed arguments): prints
    each failure and unsupported (plan, arch), then a summary; with ``--json`` one object per
    line of kind "failed", "unsupported" and "samples". Exit status 1 when a kernel does not
    compile."""
    plans = list(sample_plans(args.backend, args.only))
    compiled, failures = sample_compiles(plans, args.arch, args.jobs)
    skipped = unsupported(plans, args.arch)
    archs = args.arch or sorted({a for b in args.backend for a in KERNEL_BACKENDS[b]})
    if args.json:
        for f in failures:
            print(json.dumps(dict(kind="failed", **f)))
        for u in skipped:
            print(json.dumps(dict(kind="unsupported", **u)))
        print(json.dumps(dict(kind="samples", specialisations=compiled, archs=archs,
                              families=summary(plans))))
        return 1 if failures else 0
    for f in failures:
        error = f["error"].strip().splitlines()[-1] if f["error"].strip() else ""
        print(f"FAILED {f['family']} | {f['label']} | {f['plan']} | {f['kernel']} | "
              f"{f['arch']}: {error}")
    for u in skipped:
        print(f"not compiled: {u['label']} {u['plan']} on {u['backend']} for {u['arch']}: "
              f"{u['reason']}")
    print(f"{len(plans)} sample and production plans, {compiled} kernel specialisations "
          f"compiled for {', '.join(archs)}: {len(failures)} failed")
    return 1 if failures else 0
