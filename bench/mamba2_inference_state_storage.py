"""Error of storing the Mamba2 decode state in fp16/bf16 (nearest or stochastic rounding, written
every token or every k tokens) against the fp32 state, over a long decode. Numerics only: runs on
any device (the torch backend on CPU), with Mamba2-like parameters (A = -exp(U[0, log 16]), dt
around softplus^-1 of [1e-3, 1e-1]).

    python bench/mamba2_inference_state_storage.py [--tokens 4096] [--json out.json]
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import fusedops  # noqa: E402


SCENARIOS = {"typical dt 1e-3..1e-1": (1e-3, 1e-1), "slow dt 1e-5..1e-4": (1e-5, 1e-4)}


def problem(tokens, dt_range, h=8, p=32, n=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dt_target = torch.exp(torch.empty(h).uniform_(math.log(dt_range[0]), math.log(dt_range[1]), generator=gen))
    core = dict(x=torch.randn(1, tokens, h, p, generator=gen),
                dt=0.5 * torch.randn(1, tokens, h, generator=gen),
                A=-torch.exp(torch.empty(h).uniform_(0.0, math.log(16.0), generator=gen)),
                B=torch.randn(1, tokens, 1, n, generator=gen),
                C=torch.randn(1, tokens, 1, n, generator=gen))
    opts = dict(dt_bias=torch.log(torch.expm1(dt_target)), D=torch.ones(h), dt_softplus=True)
    return core, opts, torch.randn(1, h, p, n, generator=gen)


def run(core, opts, state, period, rounding="nearest", dtype=torch.float32):
    state = state.to(dtype, copy=True)
    rng = dict(rng_seed=torch.tensor([1234]), rng_offset=torch.tensor([0])) if rounding == "stochastic" else {}
    y = fusedops.mamba2_state_update(state, *core.values(), **opts, rounding=rounding,
                                     checkpoint_period=period, backend="torch", **rng)["y"]
    return state.float(), y


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args(argv)
    tokens = 256 if args.quick else args.tokens
    report = harness.Report(f"Mamba2 decode state storage, {tokens} tokens, h=8 p=32 n=64",
                            "numerics (torch backend)", {}, versions=harness.versions())
    tail = slice(tokens - tokens // 8, tokens)
    for scenario, dt_range in SCENARIOS.items():
        core, opts, state0 = problem(tokens, dt_range)
        ref_state, ref_y = run(core, opts, state0, 1)
        for dtype in (torch.float16, torch.bfloat16):
            for rounding in ("nearest", "stochastic"):
                for period in (1, 8):
                    s, y = run(core, opts, state0, period, rounding, dtype)
                    report.add(scenario=scenario, storage=str(dtype).removeprefix("torch."),
                               rounding=rounding, written_every=period,
                               state_rel_err=rel(s, ref_state),
                               y_rel_err_last_eighth=rel(y[:, tail], ref_y[:, tail]))
    report.finish(args)


if __name__ == "__main__":
    main()
