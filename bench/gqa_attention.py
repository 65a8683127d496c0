"""GQA attention benchmark: the training forward and backward at h_q=32, h_kv=8, d=128, s=8192
(16K tokens), causal and not, and a decode step at batch 64 with 8192 cached positions; fusedops
eager and under CUDA Graph replay against the implementations users would otherwise pick, in the
same run: torch SDPA with each of its backends (flash, cuDNN, memory-efficient; K and V expanded
to h_q heads inside the timed step only where that backend refuses GQA, and the row says so), and
for decode flash-attn's ``flash_attn_with_kvcache`` (or, where flash-attn is not importable,
SDPA over the cache's filled positions). Every row states its time in µs (``us``), TFLOP/s (the
operator's FLOPs: 4·b·h_q·s²·d, about half causal; the backward 2.5x) and its % of the roofline
floor (``plan.floor()`` at the copy bandwidth and matmul rate measured in the same run). Then the
cost of the index-data guards (docs/plans.md, "Index data"): packed training and a paged decode
step with and without a status word.

    python bench/gqa_attention.py [--lengths 8192] [--hkv 8] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

import fusedops  # noqa: E402

SDPA_BACKENDS = ("flash", "cudnn", "efficient")


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend
    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def sdpa_runner(name, q, k, v, do, causal, expand: bool):
    """(forward, forward + backward) through torch SDPA restricted to backend ``name``; q, k, v
    in fusedops' [b, s, h, d] layout (SDPA gets [b, h, s, d] views). ``expand``: K and V are
    repeated to h_q heads inside the step (autograd sums their gradients back), for backends
    without GQA; else SDPA's enable_gqa."""
    from torch.nn.attention import sdpa_kernel
    chosen = _sdpa_backend(name)
    leaves = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
    groups = q.shape[2] // k.shape[2]
    grad = do.transpose(1, 2)

    def forward():
        qq, kk, vv = leaves
        if expand:
            kk, vv = kk.repeat_interleave(groups, 1), vv.repeat_interleave(groups, 1)
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                  enable_gqa=not expand and groups > 1)

    def both():
        torch.autograd.grad(forward(), leaves, grad)
    return (lambda: forward()), both


def fusedops_runner(q, k, v, do, causal, **packing):
    """(forward, backward, forward plan, backward plan) over compiled plans and their buffers;
    ``packing``: cu_seqlens_q/k, max_seqlen_q/k and optionally a status word."""
    index = {n: packing[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "status") if n in packing}
    maxima = {n: packing[n] for n in ("max_seqlen_q", "max_seqlen_k") if n in packing}
    fwd = fusedops.GQAAttentionForward(q, k, v, causal=causal, **index, **maxima).compile()
    o, lse = fwd.allocate_outputs().values()
    ws_f = fwd.allocate_workspace()
    bwd = fusedops.GQAAttentionBackward(q, k, v, o, lse, do, causal=causal, **index, **maxima).compile()
    grads, ws = bwd.allocate_outputs(), bwd.allocate_workspace()
    run_f = lambda: fwd.execute(q, k, v, o, lse, workspace=ws_f, **index)  # noqa: E731
    run_f()
    run_b = lambda: bwd.execute(q, k, v, o, lse, do, **grads, workspace=ws, **index)  # noqa: E731
    return run_f, run_b, fwd, bwd


def add_timed(report, device, ceilings, case, impl, fn, floor, reps, *, graph=False, flops=None,
              **extra):
    """Rows of ``fn``: eager and (``graph``) under CUDA Graph replay, with TFLOP/s and % floor."""
    timings = [(impl, harness.time_ms(fn, device, reps=reps))]
    if graph:
        ms = harness.graph_time_ms(fn, device, reps=reps)
        if ms is not None:
            timings.append((f"{impl} (graph)", ms))
    for name, ms in timings:
        row = dict(case=case, impl=name, us=ms * 1e3, **extra)
        if flops:
            row["TFLOP/s"] = flops / ms / 1e9
        report.add(**row, floor_ms=harness.roofline_ms(floor, ceilings))


def training_rows(report, device, dtype, ceilings, s, b, hq, hkv, d, causal, reps):
    gen = torch.Generator(device=device).manual_seed(s + hkv)
    q = torch.randn(b, s, hq, d, device=device, generator=gen).to(dtype)
    k = torch.randn(b, s, hkv, d, device=device, generator=gen).to(dtype)
    v = torch.randn(b, s, hkv, d, device=device, generator=gen).to(dtype)
    do = torch.randn_like(q)
    case = f"s={s} b={b} hkv={hkv}{' causal' if causal else ''}"
    run_f, run_b, fwd, bwd = fusedops_runner(q, k, v, do, causal)
    floors = dict(fwd=fwd.floor(), bwd=bwd.floor())
    for direction, fn in (("fwd", run_f), ("bwd", run_b)):
        add_timed(report, device, ceilings, f"{case} {direction}", f"fusedops {fwd.selected_backend}",
                  fn, floors[direction], reps, graph=True, flops=floors[direction].flops)
    if device.type != "cuda":
        report.add(case=f"{case} fwd", impl="sdpa", error="the SDPA peers run on CUDA only")
        return
    for name in SDPA_BACKENDS:
        ran = False
        for expand in (False, True) if hkv < hq else (False,):
            label = f"sdpa {name}" + (" (K/V expanded to h_q heads in the step)" if expand else "")
            try:
                f_fn, both = sdpa_runner(name, q, k, v, do, causal, expand)
                f_ms = harness.time_ms(f_fn, device, reps=reps)
                b_ms = harness.time_ms(both, device, reps=reps) - f_ms
            except Exception as error:  # a backend that does not serve this case: say why
                reason = str(error).strip().splitlines()[0][:90] if str(error).strip() else type(error).__name__
                last = (f"{case} fwd", label, reason)
                continue
            for direction, ms in (("fwd", f_ms), ("bwd", b_ms)):
                floor = floors[direction]
                report.add(case=f"{case} {direction}", impl=label, us=ms * 1e3,
                           **{"TFLOP/s": floor.flops / ms / 1e9},
                           floor_ms=harness.roofline_ms(floor, ceilings))
            ran = True
            break
        if not ran:
            report.add(case=last[0], impl=last[1], error=last[2])


COMPARED_SPLITS = 16     # decode: a fixed split count timed beside the default rule's


def decode_rows(report, device, dtype, ceilings, b, ctx, hq, hkv, d, reps):
    """One-token decode at batch ``b`` attending to ``ctx`` positions (ctx - 1 cached, the new
    one appended): fusedops (its plan's floor: the cache read once at that context) against
    flash_attn_with_kvcache, or SDPA over the cache's first ctx positions (every row has the same
    length) with the append as an indexed copy."""
    gen = torch.Generator(device=device).manual_seed(ctx)
    rnd = lambda *sh: torch.randn(*sh, device=device, generator=gen).to(dtype)  # noqa: E731
    t = dict(q=rnd(b, 1, hq, d), k_new=rnd(b, 1, hkv, d), v_new=rnd(b, 1, hkv, d),
             k_cache=rnd(b, ctx, hkv, d), v_cache=rnd(b, ctx, hkv, d),
             cache_seqlens=torch.full((b,), ctx - 1, dtype=torch.int32, device=device))
    plan = fusedops.GQAAttentionDecode(**t).compile()
    out, ws = plan.allocate_outputs(), plan.allocate_workspace()
    floor = plan.floor()
    case = f"decode b={b} ctx={ctx} hkv={hkv}"
    gbs = {"cache GB": 2 * b * ctx * hkv * d * t["k_cache"].element_size() / 1e9}
    add_timed(report, device, ceilings, case,
              f"fusedops {plan.selected_backend} ({plan.problem.num_splits} splits)",
              lambda: plan.execute(**t, **out, workspace=ws), floor, reps, graph=True,
              flops=floor.flops, **gbs)
    if plan.problem.num_splits != COMPARED_SPLITS:      # what the default split rule leaves
        fixed = fusedops.GQAAttentionDecode(**t, num_splits=COMPARED_SPLITS).compile()
        f_out, f_ws = fixed.allocate_outputs(), fixed.allocate_workspace()
        add_timed(report, device, ceilings, case,
                  f"fusedops {fixed.selected_backend} ({COMPARED_SPLITS} splits)",
                  lambda: fixed.execute(**t, **f_out, workspace=f_ws), floor, reps, graph=True,
                  flops=floor.flops, **gbs)
    if device.type != "cuda":
        report.add(case=case, impl="flash_attn_with_kvcache", error="runs on CUDA only")
        return
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception as error:  # noqa: BLE001
        report.add(case=case, impl="flash_attn_with_kvcache",
                   error=f"flash-attn not importable ({type(error).__name__}); SDPA stands in")
        flash_attn_with_kvcache = None
    if flash_attn_with_kvcache is not None:
        run = lambda: flash_attn_with_kvcache(  # noqa: E731
            t["q"], t["k_cache"], t["v_cache"], k=t["k_new"], v=t["v_new"],
            cache_seqlens=t["cache_seqlens"], causal=True)
        try:
            add_timed(report, device, ceilings, case, "flash_attn_with_kvcache", run, floor, reps,
                      graph=True, flops=floor.flops, **gbs)
        except Exception as error:  # noqa: BLE001
            report.add(case=case, impl="flash_attn_with_kvcache",
                       error=str(error).strip().splitlines()[0][:90])
        return
    from torch.nn.attention import sdpa_kernel
    pos = ctx - 1
    qt = t["q"].transpose(1, 2)
    keys, values = t["k_cache"][:, :ctx].transpose(1, 2), t["v_cache"][:, :ctx].transpose(1, 2)
    for name in SDPA_BACKENDS:
        def run(chosen=_sdpa_backend(name)):
            t["k_cache"][:, pos] = t["k_new"][:, 0]
            t["v_cache"][:, pos] = t["v_new"][:, 0]
            with sdpa_kernel([chosen]):
                return F.scaled_dot_product_attention(qt, keys, values, enable_gqa=True)
        label = f"sdpa {name} over the cache's first ctx positions"
        try:
            add_timed(report, device, ceilings, case, label, run, floor, reps, graph=True,
                      flops=floor.flops, **gbs)
        except Exception as error:  # noqa: BLE001
            report.add(case=case, impl=label, error=str(error).strip().splitlines()[0][:90])


def guard_rows(report, device, dtype, hq, d, quick):
    """The index-data guards' cost: packed causal training (sequences of s tokens, h_kv 8) and
    a paged T=1 decode step, each without and with a status word (the sanitising pass and the
    clamping run in both; the word adds the reporting)."""
    small = quick or device.type == "cpu"
    total, s, reps = (256, 128, 2) if small else (16384, 2048, 10)
    gen = torch.Generator(device=device).manual_seed(13)
    rnd = lambda *sh: torch.randn(*sh, device=device, generator=gen).to(dtype)  # noqa: E731
    q, k, v = rnd(total, hq, d), rnd(total, 8, d), rnd(total, 8, d)
    do = torch.randn_like(q)
    cu = torch.arange(0, total + 1, s, dtype=torch.int32, device=device)
    packing = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s)
    for label, extra in (("no status", {}),
                         ("status", dict(status=torch.zeros(1, dtype=torch.int32, device=device)))):
        run_f, run_b, _, _ = fusedops_runner(q, k, v, do, True, **packing, **extra)
        for direction, fn in (("fwd", run_f), ("bwd", run_b)):
            report.add(case=f"packed {total // s}x{s} hkv=8 causal {direction} ({label})",
                       impl="fusedops", us=1e3 * harness.time_ms(fn, device, reps=reps))
    b, hkv, page, ctx = 8, 8, 64, (256 if small else 16384)
    pages = b * ctx // page
    t = dict(q=rnd(b, 1, hq, d), k_new=rnd(b, 1, hkv, d), v_new=rnd(b, 1, hkv, d),
             k_cache=rnd(pages, page, hkv, d), v_cache=rnd(pages, page, hkv, d),
             cache_seqlens=torch.full((b,), ctx - 1, dtype=torch.int32, device=device),
             block_table=torch.randperm(pages, device=device, generator=gen).int().view(b, -1))
    for label, extra in (("no status", {}),
                         ("status", dict(status=torch.zeros(1, dtype=torch.int32, device=device)))):
        plan = fusedops.GQAAttentionDecode(**t, **extra).compile()
        out, ws = plan.allocate_outputs(), plan.allocate_workspace()
        ms = harness.time_ms(lambda: plan.execute(**t, **out, workspace=ws, **extra), device, reps=20)
        report.add(case=f"decode paged ctx={ctx} b={b} ({label})", impl="fusedops", us=ms * 1e3)


def main(argv=None):
    p = harness.parser(__doc__)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192])
    p.add_argument("--hkv", type=int, nargs="+", default=[8])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (b = tokens / s)")
    args = p.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype, d, hq, reps = torch.bfloat16, 128, 32, 10
    decode = dict(b=64, ctx=8192)
    if device.type == "cpu" or args.quick:
        args.lengths, args.tokens, hq, reps, dtype = [128], 256, 8, 2, torch.float32
        args.hkv = [2]
        decode = dict(b=2, ctx=256)
    ceilings = harness.measured_ceilings(device)
    report = harness.Report(f"GQA attention (h_q={hq}, d={d})", harness.device_name(device),
                            ceilings, versions=harness.versions())
    for s in args.lengths:
        for hkv in args.hkv:
            for causal in (True, False):
                training_rows(report, device, dtype, ceilings, s, max(1, args.tokens // s), hq,
                              hkv, d, causal, reps)
    decode_rows(report, device, dtype, ceilings, decode["b"], decode["ctx"], hq,
                args.hkv[0] if device.type == "cpu" or args.quick else 8, d, 20)
    guard_rows(report, device, dtype, hq, d, args.quick)
    report.finish(args, "TFLOP/s")


if __name__ == "__main__":
    main()
