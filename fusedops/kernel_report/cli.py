"""``fusedops kernels``: the kernel report as a table, JSON, and dumped PTX/cubin/SASS; with
``--samples``, the compile check of every registry sample (``fusedops.kernel_report.samples``)."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from . import KERNEL_BACKENDS, kernel_rows, plan_totals, production_plans, unsupported
from ..core.machines import GPUS
from .markdown import mma_text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusedops kernels", description=__doc__)
    p.add_argument("--backend", nargs="+", choices=list(KERNEL_BACKENDS), default=list(KERNEL_BACKENDS))
    p.add_argument("--arch", nargs="+", choices=["sm_80", "sm_90a", "sm_100a"],
                   help="default: sm_90a, sm_100a (and sm_80 for triton)")
    p.add_argument("--only", default="", help="substring of '<shape label> <kernel name>'")
    p.add_argument("--json", action="store_true", help="one JSON object per line, then the totals")
    p.add_argument("--dump", metavar="DIR", help="write each kernel's PTX, cubin and SASS here")
    p.add_argument("--jobs", type=int, help="compiler processes (default: one per CPU core)")
    p.add_argument("--markdown", action="store_true",
                   help="the tables of docs/performance.md (sm_90a)")
    p.add_argument("--samples", action="store_true",
                   help="instead of the report: compile every kernel of every plan of every "
                        "registry sample (each family's sample kinds and dtypes) and production "
                        "shape for each target; print what does not compile (exit status 1)")
    return p


def _fmt(x: float | None, scale: float, digits: int = 2) -> str:
    return "-" if x is None else f"{x / scale:.{digits}f}"


def table(rows) -> str:
    head = (f"{'shape':<30} {'plan':<26} {'kernel':<34} {'arch':<8} {'regs':>4} {'spill':>5} "
            f"{'smem KiB':>8} {'warps':>5} {'stg':>3} {'CTA/SM':>12} {'waves':>6} {'mma':<22} "
            f"{'tma':>4} {'bar':>4} {'GFLOP':>8} {'MB':>9} {'AI':>7}  floor µs")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r.as_dict()
        floor = " ".join(f"{g.split()[0]} {us:.1f}" for g, us in r.floor_us().items()) or "-"
        occ = f"{d['ctas_per_sm']} ({d['occupancy_limited_by'][:4]})"
        lines.append(
            f"{r.label[:30]:<30} {r.plan[:26]:<26} {r.kernel[:34]:<34} {r.arch:<8} {d['registers']:>4} "
            f"{d['spill_bytes']:>5} {d['shared_bytes'] / 1024:>8.1f} {d['warps']:>5} {d['stages']:>3} "
            f"{occ:>12} {d['waves']:>6.2f} {mma_text(d, ':'):<22} "
            f"{d['copies'].get('tma load', 0):>4} {d['barriers']:>4} "
            f"{_fmt(d.get('flops'), 1e9):>8} {_fmt(d.get('bytes_read', 0) + d.get('bytes_written', 0) if 'flops' in d else None, 1e6, 1):>9} "
            f"{_fmt(d.get('intensity'), 1, 1):>7}  {floor}")
    return "\n".join(lines)


def totals_table(totals) -> str:
    head = (f"{'shape':<30} {'plan':<26} {'backend':<7} {'modelled GB':>11} {'floor GB':>9} "
            f"{'ratio':>6}  roofline µs (modelled / floor)")
    lines = [head, "-" * len(head)]
    for t in totals:
        d = t.as_dict()
        m, f = d.get("modelled"), d.get("floor")
        times = ""
        if m and f:
            times = "  ".join(f"{g} {m['floor_us'][g]:.1f}/{f['floor_us'][g]:.1f}" for g in m["floor_us"])
        ratio = "-" if t.traffic_ratio is None else f"{t.traffic_ratio:.2f}"
        lines.append(f"{t.label[:30]:<30} {t.plan[:26]:<26} {t.backend:<7} "
                     f"{_fmt(m and m['bytes'], 1e9, 3):>11} {_fmt(f and f['bytes'], 1e9, 3):>9} "
                     f"{ratio:>6}  {times}")
    return "\n".join(lines)


def dump(rows, directory: str) -> None:
    """Each row's PTX, SASS and cubin under ``directory``; a kernel a plan launches more than
    once (one specialisation per use) gets its launch's ordinal after the name."""
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    seen: dict[str, int] = {}
    for r in rows:
        stem = re.sub(r"[^\w.-]+", "_", f"{r.family}-{r.label}-{r.plan}-{r.kernel}-{r.arch}")
        seen[stem] = seen.get(stem, 0) + 1
        stem = stem if seen[stem] == 1 else f"{stem}-{seen[stem]}"
        for ext in ("ptx", "sass"):
            (root / f"{stem}.{ext}").write_text(r.artifacts[ext])
        (root / f"{stem}.cubin").write_bytes(r.artifacts["cubin"])


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.samples and (args.dump or args.markdown):
        parser().error("--samples: expected without --dump and --markdown (it reads no cubin)")
    from ..backends.triton import interpreter_active
    if "triton" in args.backend and interpreter_active():
        raise SystemExit("fusedops kernels: unset TRITON_INTERPRET (the report compiles with "
                         "Triton's JIT, not the interpreter)")
    if args.samples:
        from .samples import main as samples_main
        return samples_main(args)
    plans = list(production_plans(args.backend, args.only))
    rows = kernel_rows(plans, args.arch, keep_artifacts=bool(args.dump), jobs=args.jobs)
    if args.only:
        rows = [r for r in rows if args.only in f"{r.label} {r.kernel}"]
    totals = [t for arch in (args.arch or ["sm_90a"]) for t in plan_totals(plans, arch)]
    if args.dump:
        dump(rows, args.dump)
    if args.markdown:
        from .markdown import kernel_table, model_table
        print("<!-- model table -->\n" + model_table([t.as_dict() for t in totals])
              + "<!-- end model table -->\n\n<!-- kernel table -->\n"
              + kernel_table([r.as_dict() for r in rows]) + "<!-- end kernel table -->")
        return 0
    if args.json:
        for r in rows:
            print(json.dumps(dict(kind="kernel", **r.as_dict())))
        for t in totals:
            print(json.dumps(dict(kind="plan", **t.as_dict())))
        for u in unsupported(plans, args.arch):
            print(json.dumps(dict(kind="unsupported", **u)))
        return 0
    print(table(rows))
    print()
    print(totals_table(totals))
    for u in unsupported(plans, args.arch):
        print(f"not compiled: {u['label']} {u['plan']} on {u['backend']} for {u['arch']}: {u['reason']}")
    print("\npeaks (dense): " + "; ".join(f"{g.name}: {g.bf16_tflops:g} TFLOP/s bf16, "
                                        f"{g.hbm_tbps:g} TB/s" for g in GPUS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
