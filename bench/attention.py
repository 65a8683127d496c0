"""GQA attention benchmark: training forward and backward TFLOP/s at d=128, h_q=32, h_kv 8 and 2,
s = 1K..16K (16K tokens per batch), causal and not, against torch SDPA's flash and cuDNN backends
in the same run, with the dense bf16 matmul rate measured as the ceiling; and decode latency
against context length (µs per step, GB/s of cache read against the copy bandwidth).

    python bench/attention.py [--lengths 1024 4096 16384] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import fusedops  # noqa: E402


def sdpa_runner(backend_name, q, k, v, do, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    state = {}

    def fwd():
        with sdpa_kernel([chosen]):
            state["o"] = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)

    def bwd():
        torch.autograd.grad(state["o"], leaves, do.transpose(1, 2))
    return fwd, bwd


def fusedops_runner(q, k, v, do, causal):
    fwd = fusedops.GQAAttentionForward(q, k, v, causal=causal).compile()
    o, lse = fwd.allocate_outputs().values()
    bwd = fusedops.GQAAttentionBackward(q, k, v, o, lse, do, causal=causal).compile()
    grads, ws = bwd.allocate_outputs(), bwd.allocate_workspace()
    run_f = lambda: fwd.execute(q, k, v, o, lse)  # noqa: E731
    run_f()
    return run_f, lambda: bwd.execute(q, k, v, o, lse, do, **grads, workspace=ws)


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (b = tokens / s)")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype, d, hq, reps = torch.bfloat16, 128, 32, 10
    if device.type == "cpu" or args.quick:
        args.lengths, args.tokens, hq, reps, dtype = [128], 256, 8, 2, torch.float32
    ceilings = {"copy GB/s": harness.copy_bandwidth_gbs(device), "bf16 matmul TFLOP/s": harness.matmul_tflops(device)}
    report = harness.Report(f"GQA attention (h_q={hq}, d={d})", harness.device_name(device), ceilings,
                            versions=harness.versions())
    for s in args.lengths:
        b = max(1, args.tokens // s)
        for hkv in (8, 2):
            for causal in (False, True):
                gen = torch.Generator(device=device).manual_seed(s)
                q = torch.randn(b, s, hq, d, device=device, generator=gen).to(dtype)
                k = torch.randn(b, s, hkv, d, device=device, generator=gen).to(dtype)
                v = torch.randn(b, s, hkv, d, device=device, generator=gen).to(dtype)
                do = torch.randn_like(q)
                flops = 4 * b * hq * s * s * d / (2 if causal else 1)
                impls = {"fusedops": lambda: fusedops_runner(q, k, v, do, causal)}
                if device.type == "cuda":
                    impls["sdpa flash"] = lambda: sdpa_runner("flash", q, k, v, do, causal)
                    impls["sdpa cudnn"] = lambda: sdpa_runner("cudnn", q, k, v, do, causal)
                for name, make in impls.items():
                    try:
                        run_f, run_b = make()
                        f_ms = harness.time_ms(run_f, device, reps=reps)
                        both = harness.time_ms(lambda: (run_f(), run_b()), device, reps=reps)
                    except Exception as error:  # a peer that does not serve this case: say so
                        report.add(case=f"s={s} hkv={hkv}{' causal' if causal else ''}", impl=name,
                                   error=str(error).splitlines()[0][:70])
                        continue
                    report.add(case=f"s={s} hkv={hkv}{' causal' if causal else ''}", impl=name,
                               fwd_ms=f_ms, bwd_ms=both - f_ms, fwd_TFLOPs=flops / f_ms / 1e9,
                               bwd_TFLOPs=2.5 * flops / max(both - f_ms, 1e-9) / 1e9)
    decode_rows(report, device, dtype, hq, d, args.quick)
    report.finish(args, "fwd_TFLOPs")


def decode_rows(report, device, dtype, hq, d, quick):
    """One-token decode steps against context length, batch 8, h_kv 8 (contiguous cache)."""
    b, hkv = 8, 8
    contexts = [256] if quick or device.type == "cpu" else [1024, 4096, 16384, 65536]
    copy_gbs = report.ceilings["copy GB/s"]
    for ctx in contexts:
        gen = torch.Generator(device=device).manual_seed(ctx)
        rnd = lambda *sh: torch.randn(*sh, device=device, generator=gen).to(dtype)  # noqa: E731
        t = dict(q=rnd(b, 1, hq, d), k_new=rnd(b, 1, hkv, d), v_new=rnd(b, 1, hkv, d),
                 k_cache=rnd(b, ctx + 1, hkv, d), v_cache=rnd(b, ctx + 1, hkv, d),
                 cache_seqlens=torch.full((b,), ctx, dtype=torch.int32, device=device))
        plan = fusedops.GQAAttentionDecode(**t).compile()
        out, ws = plan.allocate_outputs(), plan.allocate_workspace()
        ms = harness.time_ms(lambda: plan.execute(**t, **out, workspace=ws), device, reps=20)
        moved = 2 * b * (ctx + 1) * hkv * d * t["k_cache"].element_size()
        gbs = moved / ms / 1e6
        report.add(case=f"decode ctx={ctx} b={b}", impl=f"fusedops ({plan.problem.num_splits} splits)",
                   fwd_ms=ms, **{"GB/s": gbs, "% copy": 100 * gbs / copy_gbs})


if __name__ == "__main__":
    main()
