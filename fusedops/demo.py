"""The demonstration and environment report behind ``python -m fusedops``."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

from . import __version__
from ._backend import BACKENDS, toolchain_unavailable_reason, triton_interpreter_active
from .engram import EngramGateSavedBackward, EngramGateSavedForward
from .errors import UnsupportedError

# max|error| / max|reference| allowed for a bf16 result (one rounding, u = 2^-9, with slack)
BF16_LIMIT = 1.6e-2
FP32_LIMIT = 1e-4


@dataclass
class Row:
    op: str
    backend: str
    device: str
    shape: str
    fwd_err: float
    bwd_err: float
    fwd_ms: float
    bwd_ms: float
    ok: bool


def _max_rel(actual, expected) -> float:
    a, e = actual.double().cpu(), expected.double().cpu()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-300)).item()


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _gate_plans(t, backend):
    fwd = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"], backend=backend).compile()
    out, saved = torch.empty_like(t["x"]), torch.empty(fwd.saved_desc.shape, dtype=fwd.saved_desc.dtype,
                                                        device=t["x"].device)
    bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], saved, t["grad_out"], backend=backend).compile()
    grads = [torch.empty_like(t["x"]), torch.empty_like(t["kv"]), torch.empty_like(t["weight"])]
    ws = bwd.allocate_workspace()
    run_f = lambda: fwd.execute(t["x"], t["kv"], t["weight"], t["mask"], out, saved)  # noqa: E731
    run_b = lambda: bwd.execute(t["x"], t["kv"], t["weight"], saved, t["grad_out"], *grads, ws)  # noqa: E731
    run_f()
    run_b()
    return run_f, run_b, out, saved, grads


def gate_rows(device: torch.device, backends) -> list[Row]:
    if device.type == "cuda":
        shapes = {"any": (8192, 4, 5120)}
    else:
        shapes = {"torch": (256, 4, 1024), "triton": (8, 4, 256)}
    rows = []
    for backend in backends:
        n, s, d = shapes.get(backend, shapes.get("any"))
        gen = torch.Generator().manual_seed(0)
        t = dict(x=torch.randn(n, s, d, generator=gen), kv=torch.randn(n, (s + 1) * d, generator=gen),
                 weight=1 + 0.2 * torch.randn(s, d, generator=gen), mask=torch.rand(n, generator=gen) > 0.2,
                 grad_out=torch.randn(n, s, d, generator=gen))
        low = {k: v.to(device, torch.bfloat16 if k in ("x", "kv", "grad_out") else v.dtype) for k, v in t.items()}
        ref = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in low.items()}
        ref = {k: v.cpu() for k, v in ref.items()}
        try:
            run_f, run_b, out, saved, grads = _gate_plans(low, backend)
        except UnsupportedError as error:
            print(f"  engram gate on {backend}: not run ({error})")
            continue
        _, _, ref_out, ref_saved, ref_grads = _gate_plans(ref, "torch")
        fwd_ms, bwd_ms = _timed(run_f, device), _timed(run_b, device)
        fwd_err = _max_rel(out, ref_out)
        bwd_err = max(_max_rel(a, b) for a, b in zip(grads[:2], ref_grads[:2]))
        fp32_err = max(_max_rel(saved, ref_saved), _max_rel(grads[2], ref_grads[2]))
        ok = fwd_err <= BF16_LIMIT and bwd_err <= BF16_LIMIT and fp32_err <= FP32_LIMIT
        rows.append(Row("engram gate", backend + (" (interpreter)" if device.type == "cpu" and backend == "triton" else ""),
                        str(device), f"N={n} S={s} D={d} bf16", fwd_err, max(bwd_err, fp32_err), fwd_ms, bwd_ms, ok))
    return rows


def runnable(device: torch.device) -> list[str]:
    return [b for b in ("torch", "triton") if toolchain_unavailable_reason(b, device) is None]


def run_demo() -> int:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    print(f"fusedops {__version__} demo on {device} ({_device_label(device)})")
    print("each operator forward + backward against the float64 torch reference; errors are "
          "max|error| / max|reference|\n")
    rows = gate_rows(device, runnable(device))
    header = f"{'operator':<12} {'backend':<22} {'shape':<24} {'fwd err':>9} {'bwd err':>9} {'fwd ms':>9} {'bwd ms':>9}  result"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.op:<12} {r.backend:<22} {r.shape:<24} {r.fwd_err:>9.2e} {r.bwd_err:>9.2e} "
              f"{r.fwd_ms:>9.2f} {r.bwd_ms:>9.2f}  {'PASS' if r.ok else 'FAIL'}")
    print(f"\nlimits: {BF16_LIMIT:g} for bf16 outputs (one rounding after fp32 math), {FP32_LIMIT:g} "
          "for fp32 outputs (saved, grad_weight). Timings are one warm call, not a benchmark "
          "(see bench/).")
    return 0 if rows and all(r.ok for r in rows) else 1


def _device_label(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def run_check() -> int:
    import importlib.metadata as md
    print(f"fusedops {__version__}, python {platform.python_version()}, torch {torch.__version__}")
    for dist in ("triton", "nvidia-cutlass-dsl", "cuda-python"):
        try:
            print(f"  {dist}: {md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"  {dist}: not installed")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
            devices.append(torch.device("cuda", i))
    else:
        print("  CUDA: not available" + (" (Triton interpreter active)" if triton_interpreter_active() else ""))
    ops = {"engram gate": EngramGateSavedForward.implementations}
    for device in devices:
        print(f"\nbackends on {device}:")
        for backend in BACKENDS:
            reason = toolchain_unavailable_reason(backend, device)
            served = [op for op, impls in ops.items() if backend in impls]
            if reason is None and served:
                print(f"  {backend:<7} serves: {', '.join(served)}")
            else:
                why = reason or "no operator implemented on this backend yet"
                print(f"  {backend:<7} unavailable: {why}")
    return 0
