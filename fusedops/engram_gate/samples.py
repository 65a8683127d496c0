"""Sample inputs of the gate, and forward + backward through its plans (for the tests, the
demo, the AOT compiles and the benchmark)."""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype
from ..opinfo import Case, PlanCall
from .contract import DEFAULT_EPS
from .plans import EngramGateSavedBackward, EngramGateSavedForward


def make(n: int, s: int, d: int, dtype=torch.float32, *, mask="some", seed: int = 0,
         device="cpu", eps: float = DEFAULT_EPS) -> Case:
    """Random x, kv, weight (1 + 0.2 N(0,1)), grad_out and a mask: "some" (about 70% true, the
    first token true), "none" (no mask), "all" or "nothing" (all true / all false)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, s, d, generator=gen)
    kv = torch.randn(n, (s + 1) * d, generator=gen)
    weight = 1.0 + 0.2 * torch.randn(s, d, generator=gen)
    grad_out = torch.randn(n, s, d, generator=gen)
    if mask == "some":
        m = torch.rand(n, generator=gen) > 0.3
        m[0] = True
    elif mask == "none":
        m = None
    else:
        m = torch.full((n,), mask == "all")
    return Case(f"N={n} S={s} D={d} {str(dtype).removeprefix('torch.')}",
                dict(x=x.to(device, dtype), kv=kv.to(device, dtype),
                     weight=weight.to(device, accumulator_dtype(dtype)),
                     mask=None if m is None else m.to(device), grad_out=grad_out.to(device, dtype)),
                dict(eps=eps))


def tiles(dtype=torch.bfloat16, device="cpu") -> list[Case]:
    """The production row layouts (``production()``) on a few tokens. A program holds a whole
    row, so the layout follows D and the dtype alone and the token count only sets the grid:

    - S = 4, D = 5120 with a mask (its first token on, the others drawn): five 1024-element
      chunks on 4 warps held in registers (forward), five on 8 warps (backward);
    - S = 4, D = 12288 without a mask: six 2048-element chunks on 8 warps (forward), three
      4096-element chunks on 16 warps (backward);
    - S = 1, D = 384 with a mask: three 128-element chunks on one warp, and the S = 1
      grad_weight reduce (512 partial rows at most): in bf16 the layout of production's fp32
      S = 1, D = 256 rows (two 128-element chunks; a bf16 row of 256 is one 256-element chunk).

    Three, two and five tokens."""
    return [make(3, 4, 5120, dtype, seed=1, device=device),
            make(2, 4, 12288, dtype, mask="none", seed=2, device=device),
            make(5, 1, 384, dtype, seed=3, device=device)]


def cases(kind: str, *, dtype=torch.float32, device="cpu", backend: str = "torch") -> list[Case]:
    """small: oracle shapes; edge: one token, 16-byte rows, all masked, blocks of the backward;
    tiles: the production row layouts on a few tokens (``tiles``); demo: the demonstration's
    shape for ``backend`` (small ones on the CPU interpreter)."""
    if kind == "small":
        shapes = [(1, 1, 8), (7, 4, 16), (5, 3, 40)]
        return [make(n, s, d, dtype, device=device) for n, s, d in shapes]
    if kind == "edge":
        row = 16 // torch.empty((), dtype=dtype).element_size()
        return [make(1, 1, row, dtype, device=device), make(65, 2, 64, dtype, device=device),
                make(6, 3, 32, dtype, mask="nothing", device=device)]
    if kind == "tiles":
        return tiles(dtype, device)
    if kind == "demo":
        on_cpu = torch.device(device).type == "cpu"
        n, s, d = {"torch": (256, 4, 1024), "triton": (8, 4, 256),
                   "cute": (8, 4, 5120)}[backend] if on_cpu else (8192, 4, 5120)
        return [make(n, s, d, dtype, device=device)]
    raise ValueError(f"kind: expected small, edge, tiles or demo, got {kind!r}")


def production() -> list[tuple[str, list[PlanCall]]]:
    """S=4, D=5120 bf16 (with and without a mask), a chunked D=12288 and fp32 S=1, D=256; 8192
    tokens, as TensorDescs on the CPU."""
    out = []
    for label, dtype, s, d in (("S4 D5120 bf16", torch.bfloat16, 4, 5120),
                               ("S4 D12288 bf16", torch.bfloat16, 4, 12288),
                               ("S1 D256 fp32", torch.float32, 1, 256)):
        n = 8192
        x = TensorDesc((n, s, d), dtype, device="cpu")
        kv = TensorDesc((n, (s + 1) * d), dtype, device="cpu")
        weight = TensorDesc((s, d), torch.float32, device="cpu")
        saved = TensorDesc((n, s, 4), torch.float32, device="cpu")
        for mask in (TensorDesc((n,), torch.bool, device="cpu"), None):
            out.append((f"gate {label}{' mask' if mask is not None else ''}", [
                PlanCall(EngramGateSavedForward, dict(x=x, kv=kv, weight=weight, mask=mask))]))
        out.append((f"gate {label} accumulate", [
            PlanCall(EngramGateSavedBackward, dict(x=x, kv=kv, weight=weight, saved=saved,
                                                   grad_out=x), dict(accumulate=True))]))
    return out


def plan_calls(case: Case, backend: str) -> list[PlanCall]:
    """The forward and the backward plan of ``case`` (the backward's saved from the forward)."""
    t = case.tensors
    forward = PlanCall(EngramGateSavedForward,
                       dict(x=t["x"], kv=t["kv"], weight=t["weight"], mask=t["mask"]),
                       dict(eps=case.options.get("eps", DEFAULT_EPS)))
    saved = forward.build(backend).compile().execute(
        t["x"], t["kv"], t["weight"], t["mask"], torch.empty_like(t["x"]),
        torch.empty(*t["x"].shape[:2], 4, dtype=t["weight"].dtype, device=t["x"].device))["saved"]
    backward = PlanCall(EngramGateSavedBackward, dict(x=t["x"], kv=t["kv"], weight=t["weight"],
                                                      saved=saved, grad_out=t["grad_out"]))
    return [forward, backward]


def run(case: Case, backend: str, *, accumulate: bool = False,
        grad_weight: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Forward then backward through the plans with caller-allocated buffers; returns out,
    saved, grad_x, grad_kv and grad_weight (``grad_weight``: the buffer to write or accumulate
    into)."""
    t = case.tensors
    fwd = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"], backend=backend,
                                 **case.options).compile()
    out, saved = fwd.allocate_outputs().values()
    fwd.execute(t["x"], t["kv"], t["weight"], t["mask"], out, saved)
    bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], saved, t["grad_out"],
                                  accumulate=accumulate, backend=backend).compile()
    grads = bwd.allocate_outputs(exclude=() if grad_weight is None else ("grad_weight",))
    if grad_weight is not None:
        grads["grad_weight"] = grad_weight
    bwd.execute(t["x"], t["kv"], t["weight"], saved, t["grad_out"], **grads,
                workspace=bwd.allocate_workspace())
    return dict(out=out, saved=saved, **grads)
