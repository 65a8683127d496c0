"""A family's oracle cases on compiled kernels: each plan's kernels compiled for a target
architecture (its tile table's entries) and their PTX run on CPU tensors in the PTX emulator,
every result checked against the family's float64 oracle within its tolerance.

Run it in a process of its own (Triton compiles only where its interpreter is off)::

    FUSEDOPS_EMULATE=1 python -m fusedops.testing.emulated --family gqa_attention \\
        --arch sm_90a --kind small --dtype bfloat16 [--schedule skewed] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from ..core.target import compiling_for, emulated_target, normalise_arch
from ..errors import UnsupportedError
from ..registry import FAMILIES, family
from . import NoTorchOps, errors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CaseResult:
    """One case: its label, whether every result is within tolerance, the worst errors, the
    failure (an emulator fault, an exception) if any, and its time."""

    family: str
    arch: str
    label: str
    ok: bool
    seconds: float
    failures: list[str] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None      # why the target does not take the case (its plans refuse it)


def run_cases(
    name: str,
    arch: str,
    kinds=("small",),
    dtype=torch.bfloat16,
    backend="triton",
    only: set[int] | None = None,
) -> list[CaseResult]:
    """Every case of ``kinds`` of family ``name`` through its plans on ``backend``, compiled
    for ``arch`` and run on the emulator (``FUSEDOPS_EMULATE`` must be set)."""
    if emulated_target() is None:
        raise RuntimeError("run_cases needs FUSEDOPS_EMULATE=1 (and TRITON_INTERPRET unset)")
    info = family(name)
    out = []
    with compiling_for(arch):
        cases = [c for kind in kinds for c in info.cases(kind, dtype=dtype)]
        for i, case in enumerate(cases):
            if only is not None and i not in only:
                continue
            start = time.perf_counter()
            try:
                results = info.run(case, backend)
                expected = info.oracle(case)
                failures = []
                for key, value in results.items():
                    if key not in expected or value is None or expected[key] is None:
                        continue
                    tol = info.tolerance(key, case.dtype)
                    rel_l2, max_rel = errors(value, expected[key])
                    finite = bool(torch.isfinite(value.detach().double()).all())
                    if not finite or rel_l2 > tol.rel_l2 or max_rel > tol.max_rel:
                        failures.append(
                            f"{key}: rel L2 {rel_l2:.2e} (limit {tol.rel_l2:.1e}), "
                            f"max rel {max_rel:.2e} (limit {tol.max_rel:.1e})"
                            + ("" if finite else ", non-finite")
                        )
                out.append(
                    CaseResult(
                        name, arch, case.label, not failures, time.perf_counter() - start, failures
                    )
                )
            except UnsupportedError as exc:     # the plans refuse the case on this target
                out.append(CaseResult(name, arch, case.label, True, time.perf_counter() - start,
                                      skipped=str(exc)))
            except Exception as exc:  # noqa: BLE001  (reported per case, with its traceback's tail)
                tail = traceback.format_exc().strip().splitlines()[-1]
                out.append(
                    CaseResult(
                        name,
                        arch,
                        case.label,
                        False,
                        time.perf_counter() - start,
                        error=f"{type(exc).__name__}: {exc}"[:4000] or tail,
                    )
                )
    return out


def execute_contract(name: str, arch: str, backend: str = "triton") -> list[str]:
    """Every plan of the family's first small case, compiled for ``arch``, executed on the
    emulator inside ``NoTorchOps``: the real launch path allocates nothing, converts nothing
    and reads nothing back (what CUDA Graph capture needs). Returns the violations."""
    info = family(name)
    problems = []
    with compiling_for(arch):
        case = info.cases("small", dtype=torch.bfloat16)[0]
        for call in info.plan_calls(case, backend):
            if backend not in call.plan.backends:
                continue
            plan = call.build(backend).compile()
            args = {o.name: call.tensors.get(o.name) for o in plan.operands if o.is_read}
            args.update(plan.allocate_outputs())
            args.update({o.name: call.tensors[o.name] for o in plan.operands if o.role == "inout"})
            args["workspace"] = plan.allocate_workspace() if plan.workspace_size else None
            try:
                with NoTorchOps():
                    plan.execute(**args)
            except AssertionError as exc:
                problems.append(f"{arch} {call.plan.__name__}: {exc}")
    return problems


TILE_CONSTEXPR = re.compile(r"^(B[A-Z]|BLOCK_\w+|DX_BN|TMA|SWAP|QUARTERS|FEATURES_M|HELD|"
                            r"TRANSPOSED\w*|WITH_DX)$")
"""The constexprs that are a kernel's tiles or choose its code path (block sizes, TMA,
transposed products, held rows...), as opposed to problem sizes and options."""


def tile_signature(spec) -> tuple:
    """What makes two specs of one kernel run the same tiles: name, warps, stages, register
    budget and the tile constexprs."""
    tiles = tuple(sorted((n, v) for n, v in spec.constexprs if TILE_CONSTEXPR.match(n)))
    return (spec.name, spec.num_warps, spec.num_stages, spec.maxnreg, tiles)


def _kernels(calls, backend: str, arch: str):
    """The kernels ``backend`` runs for ``calls`` (those it can compile for ``arch``)."""
    for call in calls:
        if backend not in call.plan.backends:
            continue
        plan = call.build("torch")
        module = importlib.import_module(f"fusedops.backends.{backend}.{plan.backend_module}")
        refuse = getattr(module, "unsupported_arch_reason", None)
        if refuse is not None and refuse(plan.problem, normalise_arch(arch)):
            continue
        yield from plan.kernel_program(backend).kernels


def production_signatures(name: str, arch: str, backend: str = "triton") -> set[tuple]:
    """The tile signatures of every kernel of the family's production plans on ``arch``."""
    info = family(name)
    with compiling_for(arch):
        return {tile_signature(k) for _, calls in info.production()
                for k in _kernels(calls, backend, arch)}


def case_signatures(name: str, arch: str, kinds, dtype=torch.bfloat16, backend: str = "triton",
                    only: set[int] | None = None) -> set[tuple]:
    """The tile signatures of every kernel the family's cases of ``kinds`` (those at the
    indexes ``only``) run on ``arch``."""
    info = family(name)
    with compiling_for(arch):
        cases = [c for kind in kinds for c in info.cases(kind, dtype=dtype)]
        return {tile_signature(k) for i, case in enumerate(cases) if only is None or i in only
                for k in _kernels(info.plan_calls(case, "torch"), backend, arch)}


def verification_table() -> str:
    """docs/backends.md's table: every kernel of every production plan, by family and backend,
    and the rungs CI runs it on, per target ("—" where the target's plans do not launch it;
    the CuTe kernels have no interpreter and only the sm_90a/sm_100a targets)."""
    rows = []
    for info in FAMILIES:
        for backend in ("triton", "cute"):
            used = {}
            for arch in ("sm_80", "sm_90a", "sm_100a"):
                if backend == "cute" and arch == "sm_80":
                    continue
                with compiling_for(arch):
                    for _, calls in info.production():
                        for k in _kernels(calls, backend, arch):
                            used.setdefault(k.name, set()).add(arch)
            for name in sorted(used):
                targets = ", ".join("CI" if a in used[name] else "—"
                                    for a in ("sm_80", "sm_90a", "sm_100a"))
                interpreter = "CI" if backend == "triton" else "— (none exists)"
                rows.append(f"| {info.name} | `{name}` ({backend}) | CI | {interpreter} | {targets} "
                            f"| {targets} | not yet |\n")
    return "".join(rows)


def _selection(families, cases) -> tuple[list[str], list[int]]:
    """(kinds, indexes into their concatenated cases) of ``KIND:INDEX`` selections (of one
    family's cases)."""
    if not families or len(families) != 1:
        raise SystemExit("--case selects cases of one --family")
    info = family(families[0])
    wanted = [(c.split(":")[0], int(c.split(":")[1])) for c in cases]
    kinds = list(dict.fromkeys(kind for kind, _ in wanted))
    offsets, start = {}, 0
    for kind in kinds:
        offsets[kind] = start
        start += len(info.cases(kind, dtype=torch.bfloat16))
    return kinds, [offsets[kind] + index for kind, index in wanted]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusedops.testing.emulated", description=__doc__)
    p.add_argument("--family", action="append", choices=[i.name for i in FAMILIES])
    p.add_argument("--arch", action="append", choices=["sm_80", "sm_90a", "sm_100a"])
    p.add_argument("--kind", action="append", help="sample kinds (default: small)")
    p.add_argument("--dtype", action="append", choices=list(DTYPES))
    p.add_argument("--backend", default="triton", choices=["triton", "cute"])
    p.add_argument("--only", type=int, action="append", help="case indexes")
    p.add_argument("--case", action="append", metavar="KIND:INDEX",
                   help="run only these cases (instead of --kind/--only)")
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    p.add_argument(
        "--coverage",
        action="store_true",
        help="list the production tile signatures the cases do not run (no emulation)",
    )
    p.add_argument(
        "--names",
        action="store_true",
        help="with --coverage: compare kernel names only (every kernel runs)",
    )
    p.add_argument(
        "--contract",
        action="store_true",
        help="execute() of each plan on the emulator dispatches no torch operator",
    )
    args = p.parse_args(argv)
    if args.case:
        args.kind, args.only = _selection(args.family, args.case)
    status = 0
    if args.contract:
        for name in args.family or [i.name for i in FAMILIES if "triton" in i.backends]:
            for arch in args.arch or ["sm_80", "sm_90a", "sm_100a"]:
                for problem in execute_contract(name, arch, args.backend):
                    print(f"FAIL {name} {problem}", flush=True)
                    status = 1
        return status
    if args.coverage:
        only = set(args.only) if args.only else None
        for name in args.family or [i.name for i in FAMILIES if "triton" in i.backends]:
            for arch in args.arch or ["sm_80", "sm_90a", "sm_100a"]:
                run = case_signatures(name, arch, tuple(args.kind or ["small"]), only=only)
                missing = production_signatures(name, arch) - run
                if args.names:
                    names = {sig[0] for sig in run}
                    missing = {sig[:1] for sig in missing if sig[0] not in names}
                for sig in sorted(missing, key=str):
                    print(f"{arch} {name} not run: {sig}")
                status |= bool(missing)
        return status
    for name in args.family or [i.name for i in FAMILIES if "triton" in i.backends]:
        for arch in args.arch or ["sm_80", "sm_90a", "sm_100a"]:
            for dtype in args.dtype or ["bfloat16"]:
                for r in run_cases(
                    name,
                    arch,
                    tuple(args.kind or ["small"]),
                    DTYPES[dtype],
                    args.backend,
                    set(args.only) if args.only else None,
                ):
                    status |= not r.ok
                    if args.json:
                        print(json.dumps(asdict(r)), flush=True)
                    else:
                        verdict = "skip" if r.skipped else "ok  " if r.ok else "FAIL"
                        detail = r.skipped or r.error or "; ".join(r.failures)
                        print(
                            f"{verdict} {r.arch:<8} {r.family:<16} {r.seconds:6.1f}s "
                            f"{r.label} {detail}",
                            flush=True,
                        )
    return status


if __name__ == "__main__":
    sys.exit(main())
