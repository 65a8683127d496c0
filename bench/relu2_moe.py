"""Routed ReLU2 MoE benchmark: the expert path (the router excluded), forward and forward +
backward, at Nemotron 3 Nano shapes (H=2688, E=128, k=6, I=1856, shared expert 3712) and Super's
expert shapes (latent 1024, E=512, k=22, I=2688), t = 8K (the production shape) and 32K tokens
(Super at 8K only), router-chosen ids.

Rows (``case`` = "<model> t=<t> fwd" or "... fwd+bwd", ``us``): fusedops eager and under CUDA
Graph replay ("(graph)"), with and without a status word (the index-data guard's reporting
compiled in, docs/relu2_moe.md "Index data"), the fusedops torch backend (at the first t), and the
peers in the same run: a torch ``grouped_mm`` pipeline (sort, gather, grouped_mm, relu²,
grouped_mm, weight, index_add; autograd backward) and vLLM's fused MoE (``fused_experts``,
relu² without a gate, forward only, the shared expert added with torch), or a row saying why it
is missing. "% floor" sets the roofline floor of the plans (``plan.floor()``: inputs read once,
outputs written once, the products on tensor cores, at the copy bandwidth and bf16 matmul rate
measured in the same run) against the time; "% matmul" the achieved TFLOP/s against the dense
bf16 matmul rate. Then the routed up GEMM alone (dispatch already done) against grouped_mm
alone: the expert GEMMs' share of the dense rate.

    python bench/relu2_moe.py [--tokens 8192 32768] [--models nano super] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402
import peers  # noqa: E402

import fusedops  # noqa: E402
from fusedops.core.program import Program  # noqa: E402

MODELS = {"nano": dict(H=2688, E=128, k=6, I=1856, shared=3712),
          "super": dict(H=1024, E=512, k=22, I=2688, shared=0)}
NAMES = ("x", "w_up", "w_down", "topk_ids", "topk_weights")


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


def fusedops_runner(case, backend, status: bool = False):
    """(forward, backward, forward plan, backward plan) over compiled plans and their buffers;
    ``status``: with a status word (zeroed once: the kernels only OR into it)."""
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    if status:
        shared["status"] = torch.zeros(1, dtype=torch.int32, device=case["x"].device)
    fwd = fusedops.ReLU2MoEForward(*(case[n] for n in NAMES), **shared, backend=backend).compile()
    bwd = fusedops.ReLU2MoEBackward(*(case[n] for n in NAMES), case["d_out"], **shared,
                                    backend=backend).compile()
    out, saved = torch.empty_like(case["x"]), fwd.allocate_saved()
    ws_f, ws_b = fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = {n: torch.empty(bwd.desc(n).shape, dtype=bwd.desc(n).dtype, device=out.device)
             for n in bwd.gradient_names}
    args = [case[n] for n in NAMES]
    run_f = lambda: fwd.execute(*args, out, saved, **shared, workspace=ws_f)  # noqa: E731
    run_f()
    run_b = lambda: bwd.execute(*args, case["d_out"], saved, **grads, **shared, workspace=ws_b)  # noqa: E731
    return run_f, run_b, fwd, bwd


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


def vllm_runner(case):
    """vLLM's fused_experts with relu² and no gate (w1 [E, I, H], w2 [E, H, I]: our layouts),
    the shared expert added with torch; forward only (an inference kernel). Raises with the
    reason where vLLM is missing or refuses the case."""
    fused_experts, reason = peers.find_vllm_fused_moe()
    if fused_experts is None:
        raise RuntimeError(reason)
    x, ids, w = case["x"], case["topk_ids"], case["topk_weights"]
    try:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        activations = (MoEActivation.RELU2_NO_MUL, "relu2_no_mul")
    except Exception:  # noqa: BLE001  (older vLLM: activations are strings)
        activations = ("relu2_no_mul",)

    def routed(activation):
        return fused_experts(x, case["w_up"], case["w_down"], w, ids, activation=activation)
    errors = []
    for activation in activations:
        try:
            routed(activation)
            break
        except Exception as error:  # noqa: BLE001
            errors.append(f"{type(error).__name__}: {error}")
    else:
        raise RuntimeError("vllm fused_experts refused relu2_no_mul: " + "; ".join(errors))

    def fwd():
        out = routed(activation)
        if "shared_w_up" in case:
            out = out + F.linear(F.relu(F.linear(x, case["shared_w_up"])).square(),
                                 case["shared_w_down"])
        return out
    return fwd, None


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--models", nargs="+", default=["nano", "super"], choices=list(MODELS))
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype, reps = torch.bfloat16, 10
    models = {n: MODELS[n] for n in args.models}
    if device.type == "cpu" or args.quick:
        models = {"tiny": dict(H=64, E=8, k=2, I=96, shared=64)}
        args.tokens, dtype, reps = [64], torch.float32, 2
    ceilings = harness.measured_ceilings(device)
    report = harness.Report("Routed ReLU2 MoE experts (router excluded)", harness.device_name(device),
                            ceilings, versions=harness.versions())
    for model, m in models.items():
        for t in args.tokens:
            if model == "super" and t > 8192:
                continue
            case = inputs(m, t, device, dtype, seed=t)
            bench_case(report, f"{model} t={t}", case, flops(m, t), device, reps,
                       first=t == args.tokens[0])
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    gemm_rows(report, models, args.tokens[-1] if device.type == "cuda" else 64, device, dtype, reps)
    report.finish(args, "TFLOP/s")


def bench_case(report, label, case, f, device, reps, first: bool):
    """fusedops (eager and graph, with and without a status word), its torch backend, and the
    peers, forward and forward + backward, on one case."""
    plans = fusedops_runner(case, "auto")
    floors = dict(fwd=plans[2].floor(), bwd=plans[3].floor())
    floors["fwd+bwd"] = floors["fwd"] + floors["bwd"]
    impls = [("fusedops", lambda: plans[:2], True),
             ("fusedops + status word", lambda: fusedops_runner(case, "auto", True)[:2], True)]
    if device.type == "cuda":
        if first:
            impls.append(("fusedops torch backend", lambda: fusedops_runner(case, "torch")[:2],
                          False))
        impls += [("torch grouped_mm", lambda: grouped_mm_runner(case), False),
                  ("vllm fused_experts", lambda: vllm_runner(case), False)]
    ceilings = report.ceilings
    for name, make, graph in impls:
        try:
            run_f, run_b = make()
        except Exception as error:  # a peer that is missing or refuses the case: say so
            report.add(case=f"{label} fwd", impl=name, error=str(error).splitlines()[0][:90])
            continue
        directions = [("fwd", run_f, f)]
        if run_b is not None:
            directions.append(("fwd+bwd", lambda: (run_f(), run_b()), 3 * f))
        else:
            report.add(case=f"{label} fwd+bwd", impl=name,
                       error="forward only (an inference kernel)")
        for direction, fn, work in directions:
            timings = [(name, lambda: harness.time_ms(fn, device, reps=reps))]
            if graph and device.type == "cuda":
                timings.append((f"{name} (graph)",
                                lambda: harness.graph_time_ms(fn, device, reps=reps)))
            for impl, timer in timings:
                try:
                    ms = timer()
                except Exception as error:  # noqa: BLE001
                    report.add(case=f"{label} {direction}", impl=impl,
                               error=str(error).splitlines()[0][:90])
                    continue
                tflops = work / ms / 1e9
                report.add(case=f"{label} {direction}", impl=impl, us=ms * 1e3,
                           **{"TFLOP/s": tflops,
                              "% matmul": 100 * tflops / ceilings["bf16 matmul TFLOP/s"]},
                           floor_ms=harness.roofline_ms(floors[direction], ceilings))


def gemm_rows(report, models, t, device, dtype, reps):
    """The routed up GEMM alone (x gathered in its prologue, u written by its epilogue) against
    grouped_mm on pre-gathered rows and against the dense matmul rate."""
    model, m = next(iter(models.items()))
    case = inputs(m, t, device, dtype, seed=1)
    _, _, fwd, _ = fusedops_runner(case, "auto")
    if fwd.selected_backend != "triton":
        return
    pr = fwd.problem
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    binding = dict({n: case[n] for n in NAMES}, **{n: v for n, v in shared.items() if v is not None},
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
    label = f"{model} t={t} up GEMM alone"
    dense = report.ceilings["bf16 matmul TFLOP/s"]
    ms = harness.time_ms(launch, device, reps=reps)
    report.add(case=label, impl="fusedops grouped GEMM", us=ms * 1e3, **{
        "TFLOP/s": f / ms / 1e9, "% matmul": 100 * f / ms / 1e9 / dense})
    if device.type == "cuda":
        graph = harness.graph_time_ms(launch, device, reps=reps)
        report.add(case=label, impl="fusedops grouped GEMM (graph)", us=graph * 1e3, **{
            "TFLOP/s": f / graph / 1e9, "% matmul": 100 * f / graph / 1e9 / dense})
        grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
        flat = case["topk_ids"].reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        offs = torch.bincount(flat, minlength=pr.experts).cumsum(0).to(torch.int32)
        xs = case["x"][order // pr.top_k]
        wt = case["w_up"].transpose(1, 2)
        ms = harness.time_ms(lambda: grouped_mm(xs, wt, offs=offs), device, reps=reps)
        report.add(case=label, impl="torch grouped_mm (rows pre-gathered)", us=ms * 1e3, **{
            "TFLOP/s": f / ms / 1e9, "% matmul": 100 * f / ms / 1e9 / dense})


if __name__ == "__main__":
    main()
