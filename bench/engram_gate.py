"""Engram saved-state gate benchmark: fusedops' kernel backends (eager and under CUDA Graph
replay) against the torch backend's reference math, eager and under torch.compile. GB/s counts
the bytes the operator requires (its floor, plan.floor()); "% copy" sets them against the copy
bandwidth measured in the same run, "% floor" the roofline floor time against the time.

    python bench/engram_gate.py [--tokens 4096 8192 16384] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import fusedops  # noqa: E402
from fusedops.testing import runnable_backends  # noqa: E402


def kernel_backends(device) -> list[str]:
    """Every fusedops kernel backend that serves the gate here (torch on a CPU-only machine)."""
    found = [b for b in runnable_backends(device) if b != "torch"] if device.type == "cuda" else []
    return found or ["torch"]


def plan_runners(backend, x, kv, w, mask, g):
    """(forward, backward, workspace bytes, (fwd plan, fwd binding), (bwd plan, bwd binding))
    over compiled plans and their buffers."""
    fwd = fusedops.EngramGateSavedForward(x, kv, w, mask, backend=backend).compile()
    out, saved = fwd.allocate_outputs().values()
    bwd = fusedops.EngramGateSavedBackward(x, kv, w, saved, g, backend=backend).compile()
    grads = bwd.allocate_outputs()
    ws = bwd.allocate_workspace()
    fwd.execute(x, kv, w, mask, out, saved)
    f_binding = dict(x=x, kv=kv, weight=w, mask=mask, out=out, saved=saved, workspace=None)
    b_binding = dict(x=x, kv=kv, weight=w, saved=saved, grad_out=g, **grads, workspace=ws)
    return (lambda: fwd.execute(x, kv, w, mask, out, saved),
            lambda: bwd.execute(x, kv, w, saved, g, **grads, workspace=ws), bwd.workspace_size,
            (fwd, f_binding), (bwd, b_binding))


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.quick:
        args.tokens, args.hidden = [64], 256
    dtype, s, d = torch.bfloat16, args.streams, args.hidden
    ceilings = harness.measured_ceilings(device)
    report = harness.Report("Engram saved-state gate", harness.device_name(device), ceilings,
                            versions=harness.versions())
    reps = 5 if args.quick else 20
    for n in args.tokens:
        gen = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, s, d, device=device, dtype=dtype, generator=gen)
        kv = torch.randn(n, (s + 1) * d, device=device, dtype=dtype, generator=gen)
        w = 1 + 0.1 * torch.randn(s, d, device=device, generator=gen)
        mask = torch.rand(n, device=device, generator=gen) > 0.1
        g = torch.randn_like(x)
        candidates, overheads, floors = [], {}, {}
        for backend in kernel_backends(device):
            run_fwd, run_bwd, _, (fwd, _), (bwd, _) = plan_runners(backend, x, kv, w, mask, g)
            floors = dict(fwd=fwd.floor(), bwd=bwd.floor())
            candidates.append((f"fusedops {backend}", run_fwd, run_bwd, True))
            overheads[backend] = harness.host_overhead_us(run_fwd, device,
                                                          calls=200 if args.quick else 2000)
        # the peers: the torch backend's reference math, eager and under torch.compile
        eager_f, eager_b, _, (ref_f, f_bind), (ref_b, b_bind) = plan_runners("torch", x, kv, w, mask, g)
        floors = floors or dict(fwd=ref_f.floor(), bwd=ref_b.floor())
        candidates.append(("torch eager", eager_f, eager_b, False))
        if not args.no_compile:
            compiled_f = torch.compile(lambda: ref_f.program.run(f_bind, None))
            compiled_b = torch.compile(lambda: ref_b.program.run(b_bind, None))
            candidates.append(("torch.compile", compiled_f, compiled_b, False))
        for name, f_fn, b_fn, ours in candidates:
            for direction, fn in (("fwd", f_fn), ("bwd", b_fn)):
                timings = [(name, harness.time_ms(fn, device, reps=reps))]
                graph = harness.graph_time_ms(fn, device, reps=reps) if ours else None
                if graph is not None:
                    timings.append((f"{name} (graph)", graph))
                floor = floors[direction]
                for impl, ms in timings:
                    report.add(case=f"N={n} {direction}", impl=impl, us=ms * 1e3,
                               **{"GB/s": floor.bytes / ms / 1e6,
                                  "% copy": 100 * floor.bytes / ms / 1e6 / ceilings["copy GB/s"]},
                               floor_ms=harness.roofline_ms(floor, ceilings))
        for backend, us in overheads.items():
            report.add(case=f"N={n} execute() host µs", impl=f"fusedops {backend}", us=us)
    report.finish(args, "GB/s")


if __name__ == "__main__":
    main()
