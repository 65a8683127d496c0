"""Mamba2 chunked scan on the CPU: the torch backend's plans against autograd through
transformers' pure-torch ``mamba2_chunk_scan`` (the NemotronH modeling code), the CPU path a user
would otherwise take. Same inputs as bench/mamba2_scan.py (D, z, dt_bias, softplus; fp32);
transformers' scan has no z, so its row gates y·silu(z) in torch after it (the gate and its
gradient are counted).

Timing: the implementations interleaved, one forward and one backward of each per round
(``--rounds``, after a warm-up round), medians reported; the backward of the autograd path
is ``torch.autograd.grad`` through the graph its forward built (timed separately), the torch
backend's the backward plan's execute (it recomputes what it needs from the inputs). Peak: the
most bytes the CPU allocator held at once, over a forward followed by its backward, above what
was held before (torch.profiler's allocation events).

    OMP_NUM_THREADS=1 python bench/mamba2_scan_cpu.py [--batch 2] [--length 2048] [--heads 16]
        [--head-dim 64] [--state 64] [--groups 8] [--chunk 256] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import mamba2_scan  # noqa: E402

MIB = 1 << 20


def transformers_runners(t, dy, chunk):
    """(forward, backward) of autograd through transformers' mamba2_chunk_scan, gated after."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    def scan(x, dt, A, B, C, D, z, dt_bias):
        y = mamba2_chunk_scan(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        return y * F.silu(z)
    return mamba2_scan.autograd_runners(scan, t, dy)


def peak_bytes(step) -> int:
    """The most bytes allocated at once while ``step()`` runs, above what was held before."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    pending = [prof.profiler.kineto_results.experimental_event_tree()]
    sizes = []
    while pending:
        for event in pending.pop():
            if event.tag == _EventType.Allocation:
                sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
            pending.append(event.children)
    held = peak = 0
    for _, size in sorted(sizes):
        held += size
        peak = max(peak, held)
    return peak


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=64)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    cpu = torch.device("cpu")
    t, dy = mamba2_scan.inputs(args.batch, args.length, args.heads, args.head_dim, args.groups,
                               args.state, cpu, torch.float32)
    impls = {"fusedops torch": mamba2_scan.fusedops_runners(t, dy, args.chunk, "torch")[:2],
             "transformers mamba2_chunk_scan + autograd": transformers_runners(t, dy, args.chunk)}
    times = {name: ([], []) for name in impls}
    for round_ in range(args.rounds + 1):
        for name, (run_f, run_b) in impls.items():
            forward, backward = timed_ms(run_f), timed_ms(run_b)
            if round_:                                       # round 0 warms up
                times[name][0].append(forward)
                times[name][1].append(backward)
    print(f"Mamba2 chunked scan on the CPU: b={args.batch} l={args.length} h={args.heads} "
          f"p={args.head_dim} n={args.state} g={args.groups} Q={args.chunk} fp32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'impl':>42}  {'fwd ms':>8}  {'bwd ms':>8}  {'fwd+bwd ms':>10}  {'peak MiB':>8}")
    for name, (run_f, run_b) in impls.items():
        forward, backward = (statistics.median(v) for v in times[name])
        peak = peak_bytes(lambda: (run_f(), run_b())) / MIB
        print(f"{name:>42}  {forward:8.1f}  {backward:8.1f}  {forward + backward:10.1f}  "
              f"{peak:8.0f}")


if __name__ == "__main__":
    main()
