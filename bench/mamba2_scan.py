"""Mamba2 chunked scan benchmark (forward, backward, forward+backward).

GPU: fusedops (triton) against mamba_ssm's Triton ``mamba_chunk_scan_combined`` and
flash-linear-attention's ``chunk_simple_gla`` when installed, and ``torch.compile`` of the
torch backend, at h=128 p=64 n=128 g=8 for l = 2K/8K/32K; ratios are against fusedops.
CPU: the torch backend against transformers' ``mamba2_chunk_scan`` (time and peak memory, each
measured in a fresh process).

    python bench/mamba2_scan.py [--lengths 2048 8192 32768] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import resource
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import fusedops  # noqa: E402


def inputs(b, l, h, p, g, n, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    return dict(x=rnd(b, l, h, p).to(dtype), dt=rnd(b, l, h).to(dtype),
                A=-torch.rand(h, device=device, generator=gen) - 0.5,
                B=rnd(b, l, g, n).to(dtype), C=rnd(b, l, g, n).to(dtype),
                D=rnd(h), dt_bias=rnd(h)), rnd(b, l, h, p).to(dtype)


def fusedops_runners(t, dy, chunk, backend):
    opts = dict(chunk_size=chunk, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, backend=backend)
    core = [t[k] for k in ("x", "dt", "A", "B", "C")]
    fwd = fusedops.Mamba2ChunkScanForward(*core, **opts).compile()
    bwd = fusedops.Mamba2ChunkScanBackward(*core, dy, **opts).compile()
    y = torch.empty_like(t["x"])
    fin = torch.empty(fwd.desc("final_states").shape, device=y.device)
    saved, wf, wb = fwd.allocate_saved(), fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = {k: torch.empty(bwd.desc(k).shape, dtype=bwd.desc(k).dtype, device=y.device)
             for k in bwd.gradient_names}
    extra = dict(D=t["D"], dt_bias=t["dt_bias"])
    run_f = lambda: fwd.execute(*core, y, fin, saved, **extra, workspace=wf)  # noqa: E731
    run_b = lambda: bwd.execute(*core, dy, saved, **grads, **extra, workspace=wb)  # noqa: E731
    run_f()
    return run_f, run_b


def compiled_reference_runners(t, dy, chunk):
    """torch.compile of the torch backend's forward and backward programs, reached through the
    plans (backend="torch"): the reference math, compiled."""
    opts = dict(chunk_size=chunk, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, backend="torch")
    core = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    fwd = fusedops.Mamba2ChunkScanForward(**core, **opts)
    bwd = fusedops.Mamba2ChunkScanBackward(**core, dy=dy, **opts)
    run_fwd, run_bwd = torch.compile(fwd.program.run), torch.compile(bwd.program.run)
    extra = dict(D=t["D"], dt_bias=t["dt_bias"], workspace=None)
    f_binding = dict(core, **extra, **fwd.allocate_outputs())
    b_binding = dict(core, **extra, dy=dy, saved=f_binding["saved"], **bwd.allocate_outputs())
    run_f = lambda: run_fwd(f_binding, None)  # noqa: E731
    run_b = lambda: run_bwd(b_binding, None)  # noqa: E731
    run_f()
    return run_f, run_b


def autograd_runners(fn, t, dy):
    """(forward, backward) of an autograd-differentiable fn(x, dt, A, B, C, D, dt_bias) -> y."""
    leaves = {k: v.detach().requires_grad_() for k, v in t.items()}
    state = {}

    def run_f():
        state["y"] = fn(**leaves)

    def run_b():
        torch.autograd.grad(state["y"], list(leaves.values()), dy, allow_unused=True)
    run_f()
    return run_f, run_b


def peers(device, chunk):
    """name -> fn(x, dt, A, B, C, D, dt_bias) -> y for the installed peers (differentiated by
    autograd), or name -> runners(t, dy) -> (forward, backward) for the compiled reference."""
    found = {}
    if device.type == "cuda":
        found["torch.compile(torch backend)"] = lambda t, dy: compiled_reference_runners(t, dy, chunk)
        try:
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
            found["mamba_ssm"] = lambda x, dt, A, B, C, D, dt_bias: mamba_chunk_scan_combined(
                x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        except ImportError:
            pass
        try:
            from fla.ops.simple_gla import chunk_simple_gla

            def gla(x, dt, A, B, C, D, dt_bias):
                h, g = x.shape[2], B.shape[2]
                dtv = torch.nn.functional.softplus(dt.float() + dt_bias)
                q = C.repeat_interleave(h // g, 2)
                k = B.repeat_interleave(h // g, 2)
                v = (x * dtv[..., None]).to(x.dtype)
                y, _ = chunk_simple_gla(q, k, v, g=dtv * A, scale=1.0)
                return y + D[:, None] * x
            found["fla chunk_simple_gla"] = gla
        except ImportError:
            pass
    else:
        try:
            from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan
            found["transformers mamba2_chunk_scan"] = lambda x, dt, A, B, C, D, dt_bias: mamba2_chunk_scan(
                x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True)
        except ImportError:
            pass
    return found


def measure(name, shape, chunk, device, dtype, reps):
    b, l, h, p, g, n = shape
    t, dy = inputs(b, l, h, p, g, n, device, dtype)
    if name.startswith("fusedops"):
        run_f, run_b = fusedops_runners(t, dy, chunk, name.split()[1])
    elif name.startswith("torch.compile"):
        run_f, run_b = peers(device, chunk)[name](t, dy)
    else:
        run_f, run_b = autograd_runners(peers(device, chunk)[name], t, dy)
    fwd_ms = harness.time_ms(run_f, device, reps=reps)
    both_ms = harness.time_ms(lambda: (run_f(), run_b()), device, reps=reps)
    return fwd_ms, both_ms


def _child(conn, args):
    """Runs one measurement in a fresh process and reports its peak resident memory."""
    torch.set_num_threads(torch.get_num_threads())
    fwd_ms, both_ms = measure(*args)
    conn.send((fwd_ms, both_ms, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--compile-max-length", type=int, default=8192,
                   help="skip the torch.compile peer above this length (its compile and memory grow)")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        shape_of = lambda l: (1, l, 128, 64, 8, 128)  # noqa: E731
        lengths, dtype, reps = args.lengths or [2048, 8192, 32768], torch.bfloat16, 10
        candidates = ["fusedops triton"]
    else:
        shape_of = lambda l: (1, l, 16, 64, 2, 64)  # noqa: E731
        lengths, dtype, reps = args.lengths or [1024, 4096], torch.float32, 3
        candidates = ["fusedops torch"]
    if args.quick:
        lengths, reps, args.chunk = [256], 2, 64
    candidates += list(peers(device, args.chunk))
    ceilings = {"copy GB/s": harness.copy_bandwidth_gbs(device)}
    if device.type == "cuda":
        ceilings["bf16 matmul TFLOP/s"] = harness.matmul_tflops(device)
    report = harness.Report("Mamba2 chunked scan", harness.device_name(device), ceilings,
                            versions=harness.versions())
    for l in lengths:
        shape = shape_of(l)
        baseline = None
        for name in candidates:
            if name.startswith("torch.compile") and l > args.compile_max_length:
                continue
            job = (name, shape, args.chunk, device, dtype, reps)
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    fwd_ms, both_ms = measure(*job)
                    peak_mb = torch.cuda.max_memory_allocated() / 2**20
                else:
                    import multiprocessing as mp
                    ctx = mp.get_context("spawn")
                    parent, child = ctx.Pipe()
                    proc = ctx.Process(target=_child, args=(child, job))
                    proc.start()
                    fwd_ms, both_ms, peak_mb = parent.recv()
                    proc.join()
            except Exception as error:  # a peer that cannot run this shape: say so, go on
                report.add(case=f"l={l}", impl=name, error=str(error)[:80])
                continue
            baseline = baseline or both_ms
            report.add(case=f"l={l} h={shape[2]} p={shape[3]} n={shape[5]}", impl=name,
                       fwd_ms=fwd_ms, bwd_ms=both_ms - fwd_ms, fwd_bwd_ms=both_ms,
                       peak_MiB=peak_mb, **{"fusedops speedup": both_ms / baseline})
    report.finish(args, "fwd_bwd_ms")


if __name__ == "__main__":
    main()
