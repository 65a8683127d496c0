"""Mamba2 decode benchmark: one-token state updates at the production head shape (h=128, p=64,
n=128, g=8, bf16 activations, D, z, dt_bias, softplus) for batches of 64 and more, with fp32
and fp16 states (nearest; fp16 also stochastic), and a 2b-slot pool read through
state_batch_indices with and without a status word (the cost of the index-data guards).

Rows per case: fusedops eager and under CUDA Graph replay, against mamba_ssm's
``selective_state_update`` (the same update through Mamba2's expanded [h, p] views; eager and
replayed too, when it captures) where it serves the case; a missing peer is a row saying why.
Every row states states/s, the floor's GB/s and its % of the roofline floor (``plan.floor()``
at the copy bandwidth measured in the same run). ``--quick`` runs tiny shapes on any device.

    python bench/mamba2_inference.py [--batches 64 128 256] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
import peers as found_peers  # noqa: E402

from fusedops import Mamba2StateUpdate  # noqa: E402

CASES = (  # (state dtype, rounding, slot pool, status word)
    (torch.float32, "nearest", False, False),
    (torch.float16, "nearest", False, False),
    (torch.float16, "stochastic", False, False),
    (torch.float16, "nearest", True, False),
    (torch.float16, "nearest", True, True),
)


def decode_inputs(b, h, p, g, n, state_dtype, pool, device):
    gen = torch.Generator(device=device).manual_seed(b)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    t = dict(x=rnd(b, 1, h, p).bfloat16(), dt=rnd(b, 1, h).bfloat16(),
             A=-torch.rand(h, device=device, generator=gen) - 0.5,
             B=rnd(b, 1, g, n).bfloat16(), C=rnd(b, 1, g, n).bfloat16(), D=rnd(h),
             z=rnd(b, 1, h, p).bfloat16(), dt_bias=rnd(h) - 4.0)
    slots = 2 * b if pool else b
    t["state"] = rnd(slots, h, p, n).to(state_dtype)
    if pool:
        t["state_batch_indices"] = torch.randperm(slots, device=device,
                                                  generator=gen)[:b].to(torch.int32)
    return t


def fusedops_runner(t, rounding, status, device, backend):
    """(run, floor, selected backend) of a compiled update plan on the inputs ``t``."""
    b = t["x"].shape[0]
    extra = {k: t[k] for k in ("D", "z", "dt_bias", "state_batch_indices") if k in t}
    if status:
        extra["status"] = torch.zeros(1, dtype=torch.int32, device=device)
    core = [t[k] for k in ("x", "dt", "A", "B", "C")]
    plan = Mamba2StateUpdate(t["state"], *core, dt_softplus=True, rounding=rounding,
                             backend=backend, **extra).compile()
    y = torch.empty_like(t["x"])
    rng = {}
    if rounding == "stochastic":
        rng = dict(rng_seed=torch.arange(b, device=device),
                   rng_offset=torch.zeros(b, dtype=torch.int64, device=device))
    run = lambda: plan.execute(t["state"], *core, y, **extra, **rng)  # noqa: E731
    run()
    return run, plan.floor(), plan.selected_backend


def mamba_runner(t, fn):
    """mamba_ssm's selective_state_update on the same inputs, through Mamba2's expanded views
    (dt, dt_bias, D over p; A over p and n)."""
    h, p, n = t["state"].shape[1:]
    x, z = t["x"][:, 0], t["z"][:, 0]
    dt = t["dt"][:, 0, :, None].expand(-1, h, p)
    A = t["A"][:, None, None].expand(h, p, n)
    D, bias = t["D"][:, None].expand(h, p), t["dt_bias"][:, None].expand(h, p)
    B, C = t["B"][:, 0], t["C"][:, 0]
    idx = t.get("state_batch_indices")
    return lambda: fn(t["state"], x, dt, A, B, C, D=D, z=z, dt_bias=bias, dt_softplus=True,
                      state_batch_indices=idx)


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    h, pd, g, n = 128, 64, 8, 128
    batches, reps = args.batches, 20
    if args.quick or device.type != "cuda":
        batches, reps, h, pd, n = ([1, 4] if args.quick else [1, 8]), 3, 8, 16, 32
    ceilings = harness.measured_ceilings(device)
    report = harness.Report(f"Mamba2 decode step (h={h} p={pd} n={n} g={g})",
                            harness.device_name(device), ceilings, versions=harness.versions())
    mamba, missing = found_peers.find_mamba_state_update()
    if device.type != "cuda":
        mamba, missing = None, "Triton kernels: needs a CUDA device"
    for b in batches:
        for state_dtype, rounding, pool, status in CASES:
            name = str(state_dtype).removeprefix("torch.")
            guards = " pool+status" if status else " pool" if pool else ""
            case = f"b={b} {name} {rounding}{guards}"
            t = decode_inputs(b, h, pd, g, n, state_dtype, pool, device)
            run, floor, used = fusedops_runner(t, rounding, status, device, "auto")
            rows = [(f"fusedops {used}", run)]
            if rounding == "stochastic" or status:
                reason = ("no stochastic rounding" if rounding == "stochastic"
                          else "no status word (invalid slots are not reported)")
                report.add(case=case, impl="mamba_ssm selective_state_update",
                           note=f"missing: {reason}")
            elif mamba is None:
                report.add(case=case, impl="mamba_ssm selective_state_update",
                           note=f"missing: {missing}")
            else:
                rows.append(("mamba_ssm selective_state_update", mamba_runner(t, mamba)))
            for impl, fn in rows:
                timings = [(impl, harness.time_ms(fn, device, reps=reps))]
                try:
                    replay = harness.graph_time_ms(fn, device, reps=reps)
                except RuntimeError as error:       # a peer that does not capture: say so
                    report.add(case=case, impl=f"{impl} (graph)", note=f"no capture: {error}"[:80])
                    replay = None
                if replay is not None:
                    timings.append((f"{impl} (graph)", replay))
                for label, ms in timings:
                    report.add(case=case, impl=label, us=ms * 1e3, states_per_s=b / ms * 1e3,
                               **{"floor GB/s": floor.bytes / ms / 1e6},
                               floor_ms=harness.roofline_ms(floor, ceilings))
    report.finish(args, "us")


if __name__ == "__main__":
    main()
