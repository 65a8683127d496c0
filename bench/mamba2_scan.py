"""Mamba2 chunked scan benchmark: forward, and forward + backward, at the registry's production
shape (b=2, l=8192, h=128, p=64, n=128, g=8, chunk 256, bf16, with D, z, dt_bias and softplus).

Rows per case: fusedops (Triton) eager and under CUDA Graph replay, also with the tokens packed
as 4 sequences and a status word (the cost of the index-data guards); the torch backend; and the
peers users would otherwise pick: mamba_ssm's ``mamba_chunk_scan_combined`` (the same problem)
and flash-linear-attention's ``chunk_simple_gla`` with the problem mapped onto it (per-head
scalar decay g = dt·A, q = C, k = B·dt, v = x; what the mapping leaves out is in the row's note).
A missing peer is a row saying why. Every row states its % of the roofline floor: the plans'
floors (``plan.floor()``, fusedops.core.cost) at the copy bandwidth and matmul rate measured in
the same run. ``--quick`` runs tiny shapes on any device (CI's dry run).

    python bench/mamba2_scan.py [--batch 2] [--lengths 8192] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
import peers as found_peers  # noqa: E402

import fusedops  # noqa: E402
from fusedops.testing import runnable_backends  # noqa: E402

PACKED_SEQUENCES = 4
FLA_NOTE = ("mapped: q = C and k = B·dt expanded from g groups to h heads, v = x, g = dt·A; the "
            "dt transform, D, the z gate and their gradients are left out (done once outside "
            "the timing), FLA's own chunk of 64 tokens")


def inputs(b, l, h, p, g, n, device, dtype, seed=0):
    """The scan's inputs (every option of the production plans but the initial states) and
    dy."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    t = dict(x=rnd(b, l, h, p).to(dtype), dt=rnd(b, l, h).to(dtype),
             A=-torch.rand(h, device=device, generator=gen) - 0.5,
             B=rnd(b, l, g, n).to(dtype), C=rnd(b, l, g, n).to(dtype),
             D=rnd(h), z=rnd(b, l, h, p).to(dtype), dt_bias=rnd(h) - 4.0)
    return t, rnd(b, l, h, p).to(dtype)


def fusedops_runners(t, dy, chunk, backend, packed=False, autotune=False):
    """(forward, backward, floors) through compiled plans and their buffers; ``packed``: the
    b·l tokens as one row of PACKED_SEQUENCES sequences (cu_seqlens) with a status word: the
    same tokens and segments as the b rows when b·l / PACKED_SEQUENCES is a multiple of the
    chunk; ``autotune``: each plan compiled with autotune=True (the fastest candidate on this
    device, the candidates' times kept in the autotune record)."""
    device = t["x"].device
    b, l = t["x"].shape[:2]
    flat = (lambda v: v.reshape(1, b * l, *v.shape[2:])) if packed else (lambda v: v)
    core = {k: (v if k in ("A", "D", "dt_bias") else flat(v)) for k, v in t.items()}
    dy = flat(dy)
    extra = dict(D=core.pop("D"), z=core.pop("z"), dt_bias=core.pop("dt_bias"))
    if packed:
        extra["cu_seqlens"] = (torch.arange(PACKED_SEQUENCES + 1, device=device) * (b * l)
                               // PACKED_SEQUENCES).to(torch.int32)
        extra["status"] = torch.zeros(1, dtype=torch.int32, device=device)
    opts = dict(chunk_size=chunk, dt_softplus=True, backend=backend)
    fwd = fusedops.Mamba2ChunkScanForward(**core, **extra, **opts).compile(autotune=autotune)
    bwd = fusedops.Mamba2ChunkScanBackward(**core, dy=dy, **extra, **opts).compile(
        autotune=autotune)
    outputs = fwd.allocate_outputs()
    grads = bwd.allocate_outputs()
    wf = fwd.allocate_workspace() if fwd.workspace_size else None
    wb = bwd.allocate_workspace() if bwd.workspace_size else None
    run_f = lambda: fwd.execute(**core, **outputs, **extra, workspace=wf)  # noqa: E731
    run_b = lambda: bwd.execute(**core, dy=dy, saved=outputs["saved"], **grads, **extra,  # noqa: E731
                                workspace=wb)
    run_f()
    return run_f, run_b, (fwd.floor(), bwd.floor())


def autograd_runners(fn, leaves: dict, dy):
    """(forward, backward) of an autograd-differentiable fn(**leaves) -> y."""
    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in leaves.items()}
    state = {}
    wrt = [v for v in leaves.values() if v.requires_grad]

    def run_f():
        state["y"] = fn(**leaves)

    def run_b():
        torch.autograd.grad(state["y"], wrt, dy, allow_unused=True)
    run_f()
    return run_f, run_b


def peer_runners(device, chunk, t, dy):
    """name -> (forward, backward, note) for each peer, or name -> the reason it is missing."""
    out = {}
    mamba, reason = found_peers.find_mamba_chunk_scan()
    fla, fla_reason = found_peers.find_fla_simple_gla()
    if device.type != "cuda":
        mamba = fla = None
        reason = fla_reason = "Triton kernels: needs a CUDA device"
    if mamba is None:
        out["mamba_ssm mamba_chunk_scan_combined"] = reason
    else:
        def run(x, dt, A, B, C, D, z, dt_bias):
            return mamba(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        out["mamba_ssm mamba_chunk_scan_combined"] = (*autograd_runners(run, t, dy), "")
    if fla is None:
        out["fla chunk_simple_gla"] = fla_reason
    else:
        h, g = t["x"].shape[2], t["B"].shape[2]
        dt = torch.nn.functional.softplus(t["dt"].float() + t["dt_bias"])
        mapped = dict(q=t["C"].repeat_interleave(h // g, 2),
                      k=(t["B"].repeat_interleave(h // g, 2) * dt[..., None]).to(t["x"].dtype),
                      v=t["x"], g=(dt * t["A"]).contiguous())

        def run(q, k, v, g):
            return fla(q, k, v, g=g, scale=1.0)[0]
        out["fla chunk_simple_gla"] = (*autograd_runners(run, mapped, dy), FLA_NOTE)
    return out


def compiled_reference_runners(t, dy, chunk):
    """torch.compile of the torch backend's forward and backward programs (opt-in)."""
    opts = dict(chunk_size=chunk, dt_softplus=True, backend="torch")
    core = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    extra = dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"])
    fwd = fusedops.Mamba2ChunkScanForward(**core, **extra, **opts)
    bwd = fusedops.Mamba2ChunkScanBackward(**core, dy=dy, **extra, **opts)
    run_fwd, run_bwd = torch.compile(fwd.program.run), torch.compile(bwd.program.run)
    f_binding = dict(core, **extra, workspace=None, **fwd.allocate_outputs())
    b_binding = dict(core, **extra, workspace=None, dy=dy, saved=f_binding["saved"],
                     **bwd.allocate_outputs())
    run_f = lambda: run_fwd(f_binding, None)  # noqa: E731
    run_b = lambda: run_bwd(b_binding, None)  # noqa: E731
    run_f()
    return run_f, run_b


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--torch-compile", action="store_true",
                   help="add torch.compile of the torch backend (minutes of compilation)")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    h, pd, g, n = 128, 64, 8, 128
    dtype, reps = torch.bfloat16, 10
    if args.quick or device.type != "cuda":
        args.batch, args.lengths, args.chunk, reps = 2, [256], 64, 2
        h, pd, g, n, dtype = 4, 16, 2, 16, torch.float32
    ceilings = harness.measured_ceilings(device)
    report = harness.Report(f"Mamba2 chunked scan (h={h} p={pd} n={n} g={g} Q={args.chunk})",
                            harness.device_name(device), ceilings, versions=harness.versions())
    ours = [b for b in runnable_backends(device) if b != "torch"
            and b in fusedops.Mamba2ChunkScanForward.backends] if device.type == "cuda" else []
    for l in args.lengths:
        b = args.batch
        t, dy = inputs(b, l, h, pd, g, n, device, dtype)
        case = f"b={b} l={l}"
        rows = []           # (impl, forward, backward, floors or None, graph?, note)
        floors = None
        for backend in ours:
            run_f, run_b, floors = fusedops_runners(t, dy, args.chunk, backend)
            rows.append((f"fusedops {backend}", run_f, run_b, True, ""))
            run_f, run_b, _ = fusedops_runners(t, dy, args.chunk, backend, packed=True)
            rows.append((f"fusedops {backend} packed+status", run_f, run_b, True,
                         f"the b·l tokens as {PACKED_SEQUENCES} packed sequences"))
            if backend == "triton":
                run_f, run_b, _ = fusedops_runners(t, dy, args.chunk, backend, autotune=True)
                rows.append(("fusedops triton autotuned", run_f, run_b, True,
                             "the fastest tile-table candidate: the fused or the split forward, "
                             "dx in the dB/dC launch or its own, BN = 128, BP = 32"))
        run_f, run_b, torch_floors = fusedops_runners(t, dy, args.chunk, "torch")
        floors = floors or torch_floors
        rows.append(("fusedops torch", run_f, run_b, True, "the reference backend"))
        for name, entry in peer_runners(device, args.chunk, t, dy).items():
            if isinstance(entry, str):
                for direction in ("fwd", "fwd+bwd"):
                    report.add(case=f"{case} {direction}", impl=name, note=f"missing: {entry}")
                continue
            rows.append((name, entry[0], entry[1], False, entry[2]))
        if args.torch_compile and device.type == "cuda":
            run_f, run_b = compiled_reference_runners(t, dy, args.chunk)
            rows.append(("torch.compile(torch backend)", run_f, run_b, False, ""))
        fwd_floor, bwd_floor = floors
        both = fwd_floor + bwd_floor
        for impl, run_f, run_b, graph, note in rows:
            for direction, fn, floor in (("fwd", run_f, fwd_floor),
                                         ("fwd+bwd", lambda: (run_f(), run_b()), both)):
                timings = [(impl, harness.time_ms(fn, device, reps=reps))]
                try:
                    replay = harness.graph_time_ms(fn, device, reps=reps) if graph else None
                except RuntimeError as error:       # a step that does not capture: say so
                    report.add(case=f"{case} {direction}", impl=f"{impl} (graph)",
                               note=f"no capture: {error}"[:80])
                    replay = None
                if replay is not None:
                    timings.append((f"{impl} (graph)", replay))
                for name, ms in timings:
                    report.add(case=f"{case} {direction}", impl=name, us=ms * 1e3,
                               **{"floor GB/s": floor.bytes / ms / 1e6},
                               floor_ms=harness.roofline_ms(floor, ceilings), note=note)
    report.finish(args, "us")


if __name__ == "__main__":
    main()
