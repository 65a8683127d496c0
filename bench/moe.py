"""Routed ReLU2 MoE benchmark: the expert path's forward and backward (the router excluded) at
Nemotron 3 Nano shapes (H=2688, E=128, k=6, I=1856, shared expert 3712) and Super's expert shapes
(latent 1024, E=512, k=22, I=2688), t = 4K..32K tokens, against a torch ``grouped_mm`` pipeline
(sort, gather, grouped_mm, relu², grouped_mm, weight, index_add; autograd backward) and the
fusedops torch backend in the same run; then the routed up GEMM alone (dispatch already done)
against grouped_mm alone and the measured dense bf16 matmul rate.

    python bench/moe.py [--tokens 4096 16384 32768] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import fusedops  # noqa: E402
from fusedops.core.program import Program  # noqa: E402

MODELS = {"nano": dict(H=2688, E=128, k=6, I=1856, shared=3712),
          "super": dict(H=1024, E=512, k=22, I=2688, shared=0)}


def inputs(model, t, device, dtype, seed=0):
    m = MODELS[model] if isinstance(model, str) else model
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, device=device, generator=gen) * scale).to(dtype)  # noqa: E731
    H, E, I, S = m["H"], m["E"], m["I"], m["shared"]
    case = dict(x=r(t, H), w_up=r(E, I, H, scale=H ** -0.5), w_down=r(E, H, I, scale=I ** -0.5),
                d_out=r(t, H))
    if S:
        case.update(shared_w_up=r(S, H, scale=H ** -0.5), shared_w_down=r(H, S, scale=S ** -0.5))
    logits = torch.randn(t, E, device=device, generator=gen)
    case["topk_weights"], case["topk_ids"] = fusedops.moe_router(logits, m["k"], routed_scaling_factor=2.5)
    return case


def flops(m, t) -> float:
    """Forward multiply-adds ×2 of the routed and shared experts (the backward does twice this)."""
    return 2 * 2 * t * (m["k"] * m["H"] * m["I"] + m["H"] * m["shared"])


def fusedops_runner(case, backend):
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    fwd = fusedops.ReLU2MoEForward(*(case[n] for n in names), **shared, backend=backend).compile()
    bwd = fusedops.ReLU2MoEBackward(*(case[n] for n in names), case["d_out"], **shared,
                                    backend=backend).compile()
    out, saved = torch.empty_like(case["x"]), fwd.allocate_saved()
    ws_f, ws_b = fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = {n: torch.empty(bwd.desc(n).shape, dtype=bwd.desc(n).dtype, device=out.device)
             for n in bwd.gradient_names}
    args = [case[n] for n in names]
    run_f = lambda: fwd.execute(*args, out, saved, **shared, workspace=ws_f)  # noqa: E731
    run_f()
    return run_f, lambda: bwd.execute(*args, case["d_out"], saved, **grads, **shared, workspace=ws_b), fwd


def grouped_mm_runner(case):
    """The torch pipeline a framework writes around ``grouped_mm`` (bf16 on SM90+)."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    leaves = {n: case[n].detach().requires_grad_() for n in
              ("x", "w_up", "w_down", "topk_weights", "shared_w_up", "shared_w_down") if n in case}
    ids = case["topk_ids"]
    t, k = ids.shape
    E = case["w_up"].shape[0]
    state = {}

    def fwd():
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        token = order // k
        u = grouped_mm(leaves["x"][token], leaves["w_up"].transpose(1, 2), offs=offs)
        y = grouped_mm(F.relu(u).square(), leaves["w_down"].transpose(1, 2), offs=offs)
        y = y.float() * leaves["topk_weights"].reshape(-1)[order, None]
        out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device).index_add(0, token, y)
        if "shared_w_up" in leaves:
            out = out + F.linear(F.relu(F.linear(leaves["x"], leaves["shared_w_up"])).square(),
                                 leaves["shared_w_down"])
        state["out"] = out.to(case["x"].dtype)

    def bwd():
        torch.autograd.grad(state["out"], list(leaves.values()), case["d_out"])
    fwd()
    return fwd, bwd


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--models", nargs="+", default=["nano", "super"], choices=list(MODELS))
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype, reps = torch.bfloat16, 10
    models = {n: MODELS[n] for n in args.models}
    if device.type == "cpu" or args.quick:
        models = {"tiny": dict(H=64, E=8, k=2, I=96, shared=64)}
        args.tokens, dtype, reps = [64], torch.float32, 2
    ceilings = {"bf16 matmul TFLOP/s": harness.matmul_tflops(device)}
    report = harness.Report("Routed ReLU2 MoE experts (router excluded)", harness.device_name(device),
                            ceilings, versions=harness.versions())
    for model, m in models.items():
        for t in args.tokens:
            if model == "super" and t > 16384:
                continue
            case = inputs(m, t, device, dtype, seed=t)
            f = flops(m, t)
            impls = {"fusedops": lambda: fusedops_runner(case, "auto")[:2]}
            if device.type == "cuda":
                impls["torch grouped_mm"] = lambda: grouped_mm_runner(case)
                if t == args.tokens[0]:
                    impls["fusedops torch backend"] = lambda: fusedops_runner(case, "torch")[:2]
            for name, make in impls.items():
                label = f"{model} t={t}"
                try:
                    run_f, run_b = make()
                    f_ms = harness.time_ms(run_f, device, reps=reps)
                    both = harness.time_ms(lambda: (run_f(), run_b()), device, reps=reps)
                except Exception as error:  # a peer that does not serve this case: say so
                    report.add(case=label, impl=name, error=str(error).splitlines()[0][:70])
                    continue
                b_ms = both - f_ms
                report.add(case=label, impl=name, fwd_ms=f_ms, bwd_ms=b_ms,
                           fwd_TFLOPs=f / f_ms / 1e9, bwd_TFLOPs=2 * f / max(b_ms, 1e-9) / 1e9,
                           **{"% matmul": 100 * f / f_ms / 1e9 / ceilings["bf16 matmul TFLOP/s"]})
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    gemm_rows(report, models, args.tokens[-1] if device.type == "cuda" else 64, device, dtype, reps)
    report.finish(args, "fwd_TFLOPs")


def gemm_rows(report, models, t, device, dtype, reps):
    """The routed up GEMM alone (x gathered in its prologue, relu² and u in its epilogue) against
    grouped_mm on pre-gathered rows and against the dense matmul rate."""
    model, m = next(iter(models.items()))
    case = inputs(m, t, device, dtype, seed=1)
    _, _, fwd = fusedops_runner(case, "auto")
    if fwd.selected_backend != "triton":
        return
    pr = fwd.problem
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    binding = dict({n: case[n] for n in names}, **{n: v for n, v in shared.items() if v is not None},
                   out=torch.empty_like(case["x"]), saved=fwd.allocate_saved(),
                   workspace=fwd.allocate_workspace())
    fwd.execute(**binding)                  # the dispatch the up GEMM reads
    program = fwd.program
    up = next(s for s in program.stages if s.bind.get("b_ptr") == "w_up")
    launch_up = Program(workspace=program.workspace, saved=program.saved,
                        stages=(up,)).build(device, frozenset(binding))
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    launch = lambda: launch_up(binding, stream)  # noqa: E731
    f = 2 * pr.assignments * pr.hidden * pr.intermediate
    ms = harness.time_ms(launch, device, reps=reps)
    label = f"{model} t={t} up GEMM alone"
    report.add(case=label, impl="fusedops grouped GEMM", fwd_ms=ms, fwd_TFLOPs=f / ms / 1e9,
               **{"% matmul": 100 * f / ms / 1e9 / report.ceilings["bf16 matmul TFLOP/s"]})
    if device.type == "cuda":
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        flat = case["topk_ids"].reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=pr.experts).cumsum(0).to(torch.int32)
        xs = case["x"][order // pr.top_k]
        wt = case["w_up"].transpose(1, 2)
        ms = harness.time_ms(lambda: grouped_mm(xs, wt, offs=offs), device, reps=reps)
        report.add(case=label, impl="torch grouped_mm (rows pre-gathered)", fwd_ms=ms,
                   fwd_TFLOPs=f / ms / 1e9,
                   **{"% matmul": 100 * f / ms / 1e9 / report.ceilings["bf16 matmul TFLOP/s"]})


if __name__ == "__main__":
    main()
