"""Mamba2 decode throughput: one-token state updates for batch 1..256 at h=128 p=64 n=128 g=8,
fp32 and fp16 (nearest / stochastic) states, as states/s and GB/s against the copy bandwidth
measured in the same run (bytes: the state read and written, plus the token's inputs and y).

    python bench/mamba2_decode.py [--batches 1 8 64 256] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

from fusedops import Mamba2StateUpdate  # noqa: E402


def step_runner(b, h, p, g, n, state_dtype, rounding, device, backend):
    gen = torch.Generator(device=device).manual_seed(b)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    core = dict(x=rnd(b, 1, h, p).bfloat16(), dt=rnd(b, 1, h).bfloat16(), A=-torch.rand(h, device=device) - 0.5,
                B=rnd(b, 1, g, n).bfloat16(), C=rnd(b, 1, g, n).bfloat16())
    opts = dict(D=rnd(h), z=rnd(b, 1, h, p).bfloat16(), dt_bias=rnd(h))
    state = rnd(b, h, p, n).to(state_dtype)
    plan = Mamba2StateUpdate(state, *core.values(), dt_softplus=True, rounding=rounding,
                             backend=backend, **opts).compile()
    y = torch.empty_like(core["x"])
    rng = {}
    if rounding == "stochastic":
        rng = dict(rng_seed=torch.arange(b, device=device), rng_offset=torch.zeros(b, dtype=torch.int64, device=device))
    run = lambda: plan.execute(state, *core.values(), y, **opts, **rng)  # noqa: E731
    moved = b * h * p * n * 2 * state.element_size() + sum(
        t.numel() * t.element_size() for t in (*core.values(), opts["z"], y))
    return run, moved, plan.selected_backend


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    h, pd, g, n = 128, 64, 8, 128
    batches, reps = args.batches, 20
    if args.quick or device.type == "cpu":
        batches, reps, h = ([1, 4] if args.quick else batches), 3, 8
    copy_gbs = harness.copy_bandwidth_gbs(device)
    report = harness.Report(f"Mamba2 decode step (h={h} p={pd} n={n} g={g})", harness.device_name(device),
                            {"copy GB/s": copy_gbs}, versions=harness.versions())
    backend = "auto"
    for b in batches:
        for state_dtype, rounding in ((torch.float32, "nearest"), (torch.float16, "nearest"),
                                      (torch.float16, "stochastic")):
            run, moved, used = step_runner(b, h, pd, g, n, state_dtype, rounding, device, backend)
            ms = harness.time_ms(run, device, reps=reps)
            gbs = moved / ms / 1e6
            report.add(batch=b, state=f"{str(state_dtype).removeprefix('torch.')} {rounding}",
                       backend=used, us=ms * 1e3, states_per_s=b / ms * 1e3, **{"GB/s": gbs},
                       **{"% copy": 100 * gbs / copy_gbs})
    report.finish(args, "GB/s", label=lambda r: f"b={r['batch']} {r['state']}")


if __name__ == "__main__":
    main()
