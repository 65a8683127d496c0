"""Engram saved-state gate benchmark: fusedops' kernel backends against the torch backend's
reference math, eager and under torch.compile, with achieved GB/s against the copy bandwidth
measured in the same run.

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


def forward_bytes(n, s, d, e):
    return n * (2 * s * d * e + (s + 1) * d * e + 1 + 16 * s)


def backward_bytes(n, s, d, e, workspace):
    # reads x, kv, grad_out, saved; writes grad_x, grad_kv; partials written and read; grad_weight
    return n * (3 * s * d * e + 2 * (s + 1) * d * e + 16 * s) + 2 * workspace + 4 * s * d


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
    copy_gbs = harness.copy_bandwidth_gbs(device)
    report = harness.Report("Engram saved-state gate", harness.device_name(device),
                            {"copy GB/s": copy_gbs}, versions=harness.versions())
    for n in args.tokens:
        gen = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, s, d, device=device, dtype=dtype, generator=gen)
        kv = torch.randn(n, (s + 1) * d, device=device, dtype=dtype, generator=gen)
        w = 1 + 0.1 * torch.randn(s, d, device=device, generator=gen)
        mask = torch.rand(n, device=device, generator=gen) > 0.1
        g = torch.randn_like(x)
        candidates, overheads = [], {}
        for backend in kernel_backends(device):
            run_fwd, run_bwd, workspace, _, _ = plan_runners(backend, x, kv, w, mask, g)
            candidates.append((f"fusedops {backend}", run_fwd, run_bwd))
            overheads[backend] = harness.host_overhead_us(run_fwd, device,
                                                          calls=200 if args.quick else 2000)
        fb = forward_bytes(n, s, d, x.element_size())
        bb = backward_bytes(n, s, d, x.element_size(), workspace)
        # the peers: the torch backend's reference math, eager and under torch.compile
        eager_f, eager_b, _, (ref_f, f_bind), (ref_b, b_bind) = plan_runners("torch", x, kv, w, mask, g)
        candidates.append(("torch eager", eager_f, eager_b))
        if not args.no_compile:
            compiled_f = torch.compile(lambda: ref_f.program.run(f_bind, None))
            compiled_b = torch.compile(lambda: ref_b.program.run(b_bind, None))
            candidates.append(("torch.compile", compiled_f, compiled_b))
        times = {(name, direction): harness.time_ms(fn, device, reps=5 if args.quick else 20)
                 for name, f_fn, b_fn in candidates
                 for direction, fn in (("fwd", f_fn), ("bwd", b_fn))}
        for (name, direction), ms in times.items():
            gbs = (fb if direction == "fwd" else bb) / ms / 1e6
            peer = times.get(("torch.compile", direction))
            report.add(case=f"N={n} {direction}", impl=name, us=ms * 1e3, **{"GB/s": gbs},
                       **{"% copy": 100 * gbs / copy_gbs,
                          "speedup vs compile": peer / ms if peer else None})
        for backend, us in overheads.items():
            report.add(case=f"N={n} fwd execute() host time", impl=f"fusedops {backend}", us=us)
    report.finish(args, "GB/s")


if __name__ == "__main__":
    main()
