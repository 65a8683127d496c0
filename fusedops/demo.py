"""The demonstration and environment report behind ``python -m fusedops``."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass

import torch

from . import __version__
from ._backend import BACKENDS, toolchain_unavailable_reason, triton_interpreter_active
from .attention import GQAAttentionBackward, GQAAttentionForward
from .engram import EngramGateSavedBackward, EngramGateSavedForward
from .errors import UnsupportedError
from .mamba2 import Mamba2ChunkScanBackward, Mamba2ChunkScanForward
from .moe import MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward

# relative L2 error allowed against the float64 reference, by what the backend's numerics are
ONE_BF16_ROUNDING = 8e-3      # fp32 math, each bf16 output rounded once
BF16_OPERANDS = 2.5e-2        # tensor-core products with bf16 operands (the scan kernels)
FP32 = 1e-4


@dataclass
class Row:
    op: str
    backend: str
    shape: str
    fwd_err: float
    bwd_err: float
    fwd_ms: float
    bwd_ms: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.fwd_err <= self.limit and self.bwd_err <= self.limit


def _rel_l2(actual, expected) -> float:
    a, e = actual.double().cpu(), expected.double().cpu()
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def _label(backend: str, device: torch.device) -> str:
    if device.type != "cpu":
        return backend
    return backend + {"triton": " (interpreter)", "cute": " (PTX emulator)"}.get(backend, "")


def _as_reference(tensors: dict) -> dict:
    return {k: (v.detach().cpu().double() if v is not None and v.is_floating_point() else
                (v.cpu() if v is not None else None)) for k, v in tensors.items()}


# -- Engram gate -------------------------------------------------------------------------------
def _gate(t, backend):
    fwd = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"], backend=backend).compile()
    dev = t["x"].device
    out = torch.empty_like(t["x"])
    saved = torch.empty(fwd.saved_desc.shape, dtype=fwd.saved_desc.dtype, device=dev)
    bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], saved, t["grad_out"], backend=backend).compile()
    grads = [torch.empty_like(t["x"]), torch.empty_like(t["kv"]), torch.empty_like(t["weight"])]
    ws = bwd.allocate_workspace()
    run_f = lambda: fwd.execute(t["x"], t["kv"], t["weight"], t["mask"], out, saved)  # noqa: E731
    run_b = lambda: bwd.execute(t["x"], t["kv"], t["weight"], saved, t["grad_out"], *grads, ws)  # noqa: E731
    run_f()
    run_b()
    return run_f, run_b, [out, saved], grads


def gate_rows(device, backends) -> list[Row]:
    shapes = ({"torch": (256, 4, 1024), "triton": (8, 4, 256), "cute": (8, 4, 5120)}
              if device.type == "cpu" else {})
    rows = []
    for backend in backends:
        n, s, d = shapes.get(backend, (8192, 4, 5120))
        gen = torch.Generator().manual_seed(0)
        t = dict(x=torch.randn(n, s, d, generator=gen), kv=torch.randn(n, (s + 1) * d, generator=gen),
                 weight=1 + 0.2 * torch.randn(s, d, generator=gen), mask=torch.rand(n, generator=gen) > 0.2,
                 grad_out=torch.randn(n, s, d, generator=gen))
        low = {k: v.to(device, torch.bfloat16 if k in ("x", "kv", "grad_out") else v.dtype) for k, v in t.items()}
        try:
            run_f, run_b, outs, grads = _gate(low, backend)
        except UnsupportedError as error:
            print(f"  engram gate on {backend}: not run ({error})")
            continue
        _, _, ref_outs, ref_grads = _gate(_as_reference(low), "torch")
        rows.append(Row("engram gate", _label(backend, device), f"N={n} S={s} D={d} bf16",
                        max(_rel_l2(a, b) for a, b in zip(outs, ref_outs)),
                        max(_rel_l2(a, b) for a, b in zip(grads, ref_grads)),
                        _timed(run_f, device), _timed(run_b, device), ONE_BF16_ROUNDING))
    return rows


# -- Mamba2 chunked scan -----------------------------------------------------------------------
def _scan(t, opts, dy, chunk, backend):
    core = [t[k] for k in ("x", "dt", "A", "B", "C")]
    options = dict(chunk_size=chunk, dt_softplus=True, backend=backend)
    fwd = Mamba2ChunkScanForward(*core, **opts, **options).compile()
    dev = t["x"].device
    y = torch.empty_like(t["x"])
    fin = torch.empty(fwd.desc("final_states").shape, dtype=fwd.desc("final_states").dtype, device=dev)
    saved, wf = fwd.allocate_saved(), fwd.allocate_workspace()
    bwd = Mamba2ChunkScanBackward(*core, dy, **opts, **options).compile()
    grads = {k: torch.empty(bwd.desc(k).shape, dtype=bwd.desc(k).dtype, device=dev) for k in bwd.gradient_names}
    wb = bwd.allocate_workspace()
    run_f = lambda: fwd.execute(*core, y, fin, saved, **opts, workspace=wf)  # noqa: E731
    run_b = lambda: bwd.execute(*core, dy, saved, **grads, **opts, workspace=wb)  # noqa: E731
    run_f()
    run_b()
    return run_f, run_b, [y, fin], list(grads.values())


def scan_rows(device, backends) -> list[Row]:
    shapes = ({"torch": (1, 512, 8, 32, 2, 32, 64), "triton": (1, 40, 2, 16, 1, 16, 16)}
              if device.type == "cpu" else {})
    rows = []
    for backend in backends:
        b, l, h, p, g, n, chunk = shapes.get(backend, (2, 4096, 128, 64, 8, 128, 256))
        gen = torch.Generator().manual_seed(1)
        rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        dtype = torch.bfloat16
        t = {k: v.to(device) for k, v in dict(
            x=rnd(b, l, h, p).to(dtype), dt=rnd(b, l, h).to(dtype), A=-0.5 - torch.rand(h, generator=gen),
            B=rnd(b, l, g, n).to(dtype), C=rnd(b, l, g, n).to(dtype)).items()}
        opts = {k: v.to(device) for k, v in dict(D=rnd(h), z=rnd(b, l, h, p).to(dtype), dt_bias=rnd(h),
                                                 initial_states=rnd(b, h, p, n)).items()}
        dy = rnd(b, l, h, p).to(dtype).to(device)
        try:
            run_f, run_b, outs, grads = _scan(t, opts, dy, chunk, backend)
        except UnsupportedError as error:
            print(f"  mamba2 scan on {backend}: not run ({error})")
            continue
        ref = _as_reference({**t, **opts, "dy": dy})
        _, _, ref_outs, ref_grads = _scan({k: ref[k] for k in t}, {k: ref[k] for k in opts}, ref["dy"],
                                          chunk, "torch")
        rows.append(Row("mamba2 scan", _label(backend, device),
                        f"b={b} l={l} h={h} p={p} n={n} Q={chunk} bf16",
                        max(_rel_l2(a, r) for a, r in zip(outs, ref_outs)),
                        max(_rel_l2(a, r) for a, r in zip(grads, ref_grads)),
                        _timed(run_f, device), _timed(run_b, device),
                        ONE_BF16_ROUNDING if backend == "torch" else BF16_OPERANDS))
    return rows


# -- GQA attention -----------------------------------------------------------------------------
def _attention(t, backend):
    fwd = GQAAttentionForward(t["q"], t["k"], t["v"], causal=True, backend=backend).compile()
    o = torch.empty_like(t["q"])
    lse = torch.empty(fwd.desc("lse").shape, dtype=fwd.desc("lse").dtype, device=t["q"].device)
    bwd = GQAAttentionBackward(t["q"], t["k"], t["v"], o, lse, t["do"], causal=True, backend=backend).compile()
    grads = [torch.empty_like(t[n]) for n in ("q", "k", "v")]
    ws = bwd.allocate_workspace()
    run_f = lambda: fwd.execute(t["q"], t["k"], t["v"], o, lse)  # noqa: E731
    run_b = lambda: bwd.execute(t["q"], t["k"], t["v"], o, lse, t["do"], *grads, workspace=ws)  # noqa: E731
    run_f()
    run_b()
    return run_f, run_b, [o], grads


def attention_rows(device, backends) -> list[Row]:
    shapes = {"torch": (2, 512, 8, 2, 64), "triton": (1, 64, 4, 2, 64)} if device.type == "cpu" else {}
    rows = []
    for backend in backends:
        b, s, hq, hkv, d = shapes.get(backend, (4, 4096, 32, 8, 128))
        gen = torch.Generator().manual_seed(2)
        t = {k: torch.randn(*shape, generator=gen).to(device, torch.bfloat16) for k, shape in
             dict(q=(b, s, hq, d), k=(b, s, hkv, d), v=(b, s, hkv, d), do=(b, s, hq, d)).items()}
        try:
            run_f, run_b, outs, grads = _attention(t, backend)
        except UnsupportedError as error:
            print(f"  gqa attention on {backend}: not run ({error})")
            continue
        _, _, ref_outs, ref_grads = _attention(_as_reference(t), "torch")
        rows.append(Row("gqa attention", _label(backend, device), f"b={b} s={s} hq={hq} hkv={hkv} d={d} causal",
                        _rel_l2(outs[0], ref_outs[0]), max(_rel_l2(a, r) for a, r in zip(grads, ref_grads)),
                        _timed(run_f, device), _timed(run_b, device),
                        ONE_BF16_ROUNDING if backend == "torch" else BF16_OPERANDS))
    return rows


# -- routed ReLU2 MoE ---------------------------------------------------------------------------
_EXPERT_INPUTS = ("x", "w_up", "w_down", "topk_ids", "topk_weights")


def _moe(t, backend):
    """Router forward, experts forward and backward, router backward with the experts' d_w."""
    router = MoERouter(t["logits"], top_k=t["k"], routed_scaling_factor=2.5, backend=backend).compile()
    dev, wdt = t["x"].device, router.desc("topk_weights").dtype
    weights = torch.empty(router.desc("topk_weights").shape, dtype=wdt, device=dev)
    ids = t.get("ids")
    ids = torch.empty(weights.shape, dtype=torch.int32, device=dev) if ids is None else ids
    shared = dict(shared_w_up=t["shared_w_up"], shared_w_down=t["shared_w_down"])
    e = dict(t, topk_ids=ids, topk_weights=weights)
    fwd = ReLU2MoEForward(*(e[n] for n in _EXPERT_INPUTS), **shared, backend=backend).compile()
    bwd = ReLU2MoEBackward(*(e[n] for n in _EXPERT_INPUTS), t["d_out"], **shared, backend=backend).compile()
    r_bwd = MoERouterBackward(t["logits"], ids, weights, routed_scaling_factor=2.5, backend=backend).compile()
    out, saved, wf, wb = torch.empty_like(t["x"]), fwd.allocate_saved(), fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = {n: torch.empty(bwd.desc(n).shape, dtype=bwd.desc(n).dtype, device=dev) for n in bwd.gradient_names}
    d_logits = torch.empty_like(t["logits"])

    def run_f():
        if "ids" not in t:
            router.execute(t["logits"], weights, ids)
        else:      # the reference keeps the kernels' selection (scores equal in fp32 may tie)
            from fusedops.backends.torch.moe_router import weights_of
            weights.copy_(weights_of(torch.sigmoid(t["logits"]).gather(1, ids.long()), True, 2.5))
        fwd.execute(*(e[n] for n in _EXPERT_INPUTS), out, saved, **shared, workspace=wf)

    def run_b():
        bwd.execute(*(e[n] for n in _EXPERT_INPUTS), t["d_out"], saved, **grads, **shared, workspace=wb)
        r_bwd.execute(t["logits"], ids, grads["d_topk_weights"], d_logits)
    run_f()
    run_b()
    return run_f, run_b, [out, weights], list(grads.values()) + [d_logits], ids


def moe_rows(device, backends) -> list[Row]:
    shapes = ({"torch": (256, 256, 16, 4, 384, 256), "triton": (48, 64, 6, 2, 96, 64)}
              if device.type == "cpu" else {})
    rows = []
    for backend in backends:
        tokens, H, E, k, I, S = shapes.get(backend, (4096, 2688, 128, 6, 1856, 3712))
        gen = torch.Generator().manual_seed(3)
        rnd = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale  # noqa: E731
        dtype = torch.bfloat16
        t = {n: v.to(device, dtype) for n, v in dict(
            x=rnd(tokens, H), w_up=rnd(E, I, H, scale=H ** -0.5), w_down=rnd(E, H, I, scale=I ** -0.5),
            shared_w_up=rnd(S, H, scale=H ** -0.5), shared_w_down=rnd(H, S, scale=S ** -0.5),
            d_out=rnd(tokens, H)).items()}
        t.update(logits=rnd(tokens, E).to(device), k=k)
        try:
            run_f, run_b, outs, grads, ids = _moe(t, backend)
        except UnsupportedError as error:
            print(f"  routed moe on {backend}: not run ({error})")
            continue
        ref = dict(_as_reference({n: v for n, v in t.items() if n != "k"}), k=k, ids=ids.cpu())
        _, _, ref_outs, ref_grads, _ = _moe(ref, "torch")
        rows.append(Row("routed moe", _label(backend, device), f"t={tokens} H={H} E={E} k={k} I={I} +shared",
                        max(_rel_l2(a, r) for a, r in zip(outs, ref_outs)),
                        max(_rel_l2(a, r) for a, r in zip(grads, ref_grads)),
                        _timed(run_f, device), _timed(run_b, device), ONE_BF16_ROUNDING))
    return rows


def runnable(device: torch.device) -> list[str]:
    return [b for b in BACKENDS if toolchain_unavailable_reason(b, device) is None]


def run_demo() -> int:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    print(f"fusedops {__version__} demo on {device} ({_device_label(device)})")
    print("each operator forward + backward against the float64 torch reference; errors are the "
          "largest relative L2 error over the outputs (fwd) and the gradients (bwd)\n")
    backends = runnable(device)
    families = (("engram gate", gate_rows, EngramGateSavedForward),
                ("mamba2 scan", scan_rows, Mamba2ChunkScanForward),
                ("gqa attention", attention_rows, GQAAttentionForward),
                ("routed moe", moe_rows, ReLU2MoEForward))
    rows = []
    for i, (name, family_rows, op) in enumerate(families, 1):
        print(f"  [{i}/{len(families)}] {name} ...", file=sys.stderr, flush=True)
        rows += family_rows(device, [b for b in backends if b in op.implementations])
    header = (f"{'operator':<13} {'backend':<21} {'shape':<36} {'fwd err':>9} {'bwd err':>9} "
              f"{'limit':>8} {'fwd ms':>8} {'bwd ms':>8}  result")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.op:<13} {r.backend:<21} {r.shape:<36} {r.fwd_err:>9.2e} {r.bwd_err:>9.2e} "
              f"{r.limit:>8.1e} {r.fwd_ms:>8.2f} {r.bwd_ms:>8.2f}  {'PASS' if r.ok else 'FAIL'}")
    print("\nlimits: one bf16 rounding after fp32 math (8e-3), bf16 operands of tensor-core "
          "products (2.5e-2). Timings are one warm call, not a benchmark (see bench/).")
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
    from .mamba2_inference import Mamba2StateUpdate
    ops = {"engram gate": EngramGateSavedForward.implementations,
           "mamba2 scan": Mamba2ChunkScanForward.implementations,
           "mamba2 state update": Mamba2StateUpdate.implementations,
           "gqa attention": GQAAttentionForward.implementations,
           "moe router": MoERouter.implementations,
           "relu2 moe": ReLU2MoEForward.implementations}
    for device in devices:
        print(f"\nbackends on {device}:")
        for backend in BACKENDS:
            reason = toolchain_unavailable_reason(backend, device)
            served = [op for op, impls in ops.items() if backend in impls]
            if reason is None and served:
                print(f"  {backend:<7} serves: {', '.join(served)}")
            else:
                print(f"  {backend:<7} unavailable: {reason or 'no operator implemented on this backend yet'}")
    return 0
