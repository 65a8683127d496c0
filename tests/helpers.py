"""Shared test utilities: tolerances, error measures, backend/device parametrisation."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def runnable_backends() -> list:
    """torch everywhere; triton on CUDA, or on CPU under the interpreter; cute on sm_90/sm_100,
    or on CPU under the PTX emulator."""
    from fusedops._backend import toolchain_unavailable_reason
    return ["torch"] + [b for b in ("triton", "cute") if toolchain_unavailable_reason(b, DEVICE) is None]


def gpu_backends() -> list:
    """The kernel backends the GPU tests run: those of runnable_backends() that are not torch."""
    return [b for b in runnable_backends() if b != "torch"] if HAS_CUDA else []


@dataclass(frozen=True)
class Tolerance:
    rel_l2: float      # ||a - b|| / ||b||
    max_rel: float     # max|a - b| / max|b|
    reason: str


# fp32 results that are sums over N tokens of products that cancel, and that carry the fp32
# rounding of the saved gate/dot into every coefficient (grad_weight, saved vs another order).
FP32_REDUCTION = Tolerance(2e-5, 1e-4, "fp32 sums over tokens of cancelling products, "
                           "in another order than the reference's")

# A result rounded once to a format with unit roundoff u differs from the exact value by at most
# u relative per element; fp32 accumulation over D <= 16K terms adds well under 1e-5.
TOLERANCES = {
    torch.float64: Tolerance(1e-12, 1e-12, "float64 reference math vs float64 oracle"),
    torch.float32: Tolerance(1e-5, 5e-5, "fp32 arithmetic (u = 6e-8), reductions of up to 16K terms, "
                             "gradients that subtract terms of similar size"),
    torch.float16: Tolerance(6e-4, 1.5e-3, "one fp16 rounding (u = 4.9e-4) after fp32 math"),
    torch.bfloat16: Tolerance(4e-3, 1.2e-2, "one bf16 rounding (u = 3.9e-3) after fp32 math"),
}


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max-abs over max-abs), computed in float64."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    diff = a - e
    scale_l2 = e.norm().item() or 1.0
    scale_max = e.abs().max().item() if e.numel() else 1.0
    return diff.norm().item() / scale_l2, (diff.abs().max().item() if e.numel() else 0.0) / (scale_max or 1.0)


def assert_close(actual, expected, tolerance: Tolerance | torch.dtype, name: str = "") -> None:
    tol = TOLERANCES[tolerance] if isinstance(tolerance, torch.dtype) else tolerance
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual.to(torch.float64)).all(), f"{name}: non-finite values"
    rel_l2, max_rel = errors(actual, expected)
    assert rel_l2 <= tol.rel_l2 and max_rel <= tol.max_rel, (
        f"{name}: rel L2 {rel_l2:.3e} (limit {tol.rel_l2:.1e}), max rel {max_rel:.3e} "
        f"(limit {tol.max_rel:.1e}); tolerance: {tol.reason}")
