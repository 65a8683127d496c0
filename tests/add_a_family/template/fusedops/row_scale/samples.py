"""Sample inputs of the row scale, and forward + backward through its plans."""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype
from ..opinfo import Case, PlanCall
from .plans import RowScaleBackward, RowScaleForward


def make(n: int, d: int, dtype=torch.float32, *, seed: int = 0, device="cpu") -> Case:
    """Random x, weight and grad_y."""
    gen = torch.Generator().manual_seed(seed)
    x, w, g = torch.randn(n, d, generator=gen), torch.randn(d, generator=gen), torch.randn(
        n, d, generator=gen)
    return Case(f"N={n} D={d} {str(dtype).removeprefix('torch.')}",
                dict(x=x.to(device, dtype), weight=w.to(device, accumulator_dtype(dtype)),
                     grad_y=g.to(device, dtype)))


def cases(kind: str, *, dtype=torch.float32, device="cpu", backend: str = "torch") -> list[Case]:
    """small and edge: shapes around the kernel's block; tiles: the production block; demo."""
    shapes = {"small": [(3, 16), (5, 40)], "edge": [(1, 8), (2, 1030)], "tiles": [(3, 1024)],
              "demo": [(8, 256)]}
    if kind not in shapes:
        raise ValueError(f"kind: expected small, edge, tiles or demo, got {kind!r}")
    return [make(n, d, dtype, seed=i, device=device) for i, (n, d) in enumerate(shapes[kind])]


def production() -> list[tuple[str, list[PlanCall]]]:
    """N = 8192 rows of D = 4096, bf16."""
    x = TensorDesc((8192, 4096), torch.bfloat16, device="cpu")
    w = TensorDesc((4096,), torch.float32, device="cpu")
    return [("row_scale N8192 D4096", [PlanCall(RowScaleForward, dict(x=x, weight=w))])]


def plan_calls(case: Case, backend: str) -> list[PlanCall]:
    """The forward and the backward plan of ``case``."""
    t = case.tensors
    return [PlanCall(RowScaleForward, dict(x=t["x"], weight=t["weight"])),
            PlanCall(RowScaleBackward, dict(x=t["x"], weight=t["weight"], grad_y=t["grad_y"]))]


def run(case: Case, backend: str) -> dict[str, torch.Tensor]:
    """Forward on ``backend`` and backward (torch) through the plans; y, grad_x, grad_weight."""
    t = case.tensors
    fwd = RowScaleForward(t["x"], t["weight"], backend=backend).compile()
    y = fwd.execute(t["x"], t["weight"], **fwd.allocate_outputs())["y"]
    bwd = RowScaleBackward(t["x"], t["weight"], t["grad_y"],
                           backend="torch" if backend == "triton" else backend).compile()
    grads = bwd.execute(t["x"], t["weight"], t["grad_y"], **bwd.allocate_outputs())
    return dict(y=y, grad_x=grads["grad_x"], grad_weight=grads["grad_weight"])
