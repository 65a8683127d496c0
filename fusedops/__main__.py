"""``fusedops demo | check | bench | memory`` (also ``python -m fusedops ...``)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

CROSS_CUTTING_BENCHMARKS = ("host_overhead",)
"""bench/ scripts that measure every family at once (no registry entry lists them)."""


def benchmarks() -> list[str]:
    """The bench/ scripts of every registry family, in registry order, then the cross-cutting
    ones (``CROSS_CUTTING_BENCHMARKS``)."""
    from .registry import FAMILIES
    return [name for info in FAMILIES for name in info.bench] + list(CROSS_CUTTING_BENCHMARKS)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedops")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="every operator forward+backward on every backend this "
                                       "machine runs, against the float64 reference")
    demo.add_argument("--no-interpreter", action="store_true",
                      help="on a machine without CUDA, skip the Triton interpreter and PTX emulator rows")
    sub.add_parser("check", help="environment report: versions, device, backends per operator")
    sub.add_parser("kernels", add_help=False,
                   help="every kernel of every plan at production shapes, compiled for sm_90a/"
                        "sm_100a: registers, spills, occupancy, MMA kind, traffic model and "
                        "roofline (fusedops kernels --help)")
    bench = sub.add_parser("bench", help="run the benchmarks of a source checkout's bench/ and "
                                         "write their JSON and PNG plots")
    bench.add_argument("names", nargs="*", metavar="NAME",
                       help="which of the registry's benchmarks (default: all)")
    bench.add_argument("--out", default="bench_out", help="directory for logs, JSON and plots")
    bench.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    memory = sub.add_parser("memory", help="decode state / KV cache and training saved/workspace "
                                           "bytes per layer of a NemotronH config")
    memory.add_argument("config", help="a NemotronH model directory or config.json (read by "
                                       "transformers' NemotronHConfig.from_pretrained)")
    memory.add_argument("--tokens", type=int, default=8192, help="tokens per training step")
    memory.add_argument("--sequences", type=int, default=1, help="sequences packed in the step")
    memory.add_argument("--context", type=int, default=65536, help="decode context length")
    memory.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kernels"]:
        from .kernel_report.cli import main as kernels_main
        return kernels_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "bench":
        known = benchmarks()
        unknown = [n for n in args.names if n not in known]
        if unknown:
            raise SystemExit(f"fusedops bench: names: expected some of {', '.join(known)}, got {unknown}")
        return run_benchmarks(args.names or known, Path(args.out), args.quick)
    if args.command == "memory":
        return run_memory(args)
    import torch
    if args.command == "demo" and not torch.cuda.is_available() and not args.no_interpreter \
            and "triton" not in sys.modules:
        # without a GPU the Triton kernels can still run, slowly, on the CPU interpreter, and
        # the CuTe kernels' PTX in the emulator
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("FUSEDOPS_EMULATE", "1")
    from . import demo as demo_module
    if args.command == "demo":
        return demo_module.run_demo()
    return demo_module.run_check()


def bench_directory() -> Path:
    """bench/ of the source checkout this package was installed from (editable installs)."""
    here = Path(__file__).resolve().parent.parent / "bench"
    if not (here / "harness.py").exists():
        raise SystemExit("fusedops bench: the benchmarks live in the source checkout's bench/ "
                         f"(not found at {here}); install fusedops from a checkout with pip -e")
    return here


def run_benchmarks(names, out: Path, quick: bool) -> int:
    directory = bench_directory()
    out.mkdir(parents=True, exist_ok=True)
    status = 0
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] bench/{name}.py", flush=True)
        cmd = [sys.executable, str(directory / f"{name}.py"), "--json", str(out / f"{name}.json")]
        if name != "mamba2_inference_state_storage":
            cmd += ["--png", str(out / f"{name}.png")]
        if quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        print(proc.stdout.rstrip())
        if proc.returncode:
            print(f"bench/{name}.py failed (exit {proc.returncode}); see {out / (name + '.log')}",
                  file=sys.stderr)
            status = 1
    return status


def run_memory(args) -> int:
    import torch
    from .memory import format_model_bytes, load_config, missing_fields, model_bytes
    where = f"fusedops memory: {args.config}"
    try:
        config = load_config(args.config)
    except Exception as error:  # noqa: BLE001  (the CLI's boundary: one line, never a traceback)
        raise SystemExit(f"{where}: expected a NemotronH model directory or config.json "
                         f"transformers can read ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    missing = missing_fields(config)
    if missing:
        raise SystemExit(f"{where}: the config lacks {', '.join(missing)}")
    kv = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    try:
        rows = model_bytes(config, tokens=args.tokens, context=args.context, sequences=args.sequences,
                           kv_dtype=kv)
    except Exception as error:  # noqa: BLE001  (the CLI's boundary: one line, never a traceback)
        raise SystemExit(f"{where}: {type(error).__name__}: {str(error).splitlines()[0]}")
    print(f"{args.config}: bf16 activations, fp32 recurrent state, {args.kv_dtype} KV cache")
    print(format_model_bytes(rows, tokens=args.tokens, context=args.context))
    return 0


if __name__ == "__main__":
    sys.exit(main())
