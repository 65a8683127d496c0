"""Helpers for testing fusedops and code built on it.

- ``assert_close``/``errors``/``Tolerance``: relative-L2 and max-abs error against a float64
  oracle, with per-dtype tolerances that state their reason (``fusedops.opinfo``);
- ``NoTorchOps``: a dispatch mode that fails on any torch op (proves execute() allocates,
  converts and reads nothing);
- ``runnable_backends(device)``: the backends this process can run there;
- ``fusedops.registry.FAMILIES``: each family's sample inputs (``cases``), forward + backward
  runner (``run``) and float64 oracle (``oracle``);
- ``ptx_emulator``: runs compiled kernels' PTX (Triton and CuTe DSL, sm_80/sm_90a/sm_100a) on
  CPU tensors, with bounds, convergence, asynchrony and race checks.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..backends import ptx_emulator
from ..opinfo import FP32_REDUCTION, ROUNDED_ONCE, Tolerance
from ..plan.selection import BACKENDS, backend_unavailable_reason

__all__ = ["FP32_REDUCTION", "HostReads", "NoTorchOps", "ROUNDED_ONCE", "Tolerance", "assert_close",
           "default_device", "errors", "ptx_emulator", "runnable_backends"]


def default_device() -> torch.device:
    """The current CUDA device, or the CPU without one."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def runnable_backends(device: torch.device | None = None) -> list[str]:
    """The backends that can run on ``device`` in this process: torch everywhere; triton on
    CUDA, or on CPU under the interpreter; cute on sm_90/sm_100, or on CPU under the PTX
    emulator."""
    device = default_device() if device is None else device
    return [b for b in BACKENDS if backend_unavailable_reason(b, device) is None]


def errors(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max-abs over max-abs) of ``actual`` against ``expected``, in float64."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    diff = a - e
    scale_l2 = e.norm().item() or 1.0
    scale_max = e.abs().max().item() if e.numel() else 1.0
    max_abs = diff.abs().max().item() if e.numel() else 0.0
    return diff.norm().item() / scale_l2, max_abs / (scale_max or 1.0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor,
                 tolerance: Tolerance | torch.dtype, name: str = "") -> None:
    """Fails (AssertionError) unless shapes match, ``actual`` is finite and both errors are
    within ``tolerance`` (a Tolerance, or a dtype: one rounding to it after fp32 math)."""
    tol = ROUNDED_ONCE[tolerance] if isinstance(tolerance, torch.dtype) else tolerance
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.isfinite(actual.detach().to(torch.float64)).all():
        raise AssertionError(f"{name}: non-finite values")
    rel_l2, max_rel = errors(actual, expected)
    if rel_l2 > tol.rel_l2 or max_rel > tol.max_rel:
        raise AssertionError(
            f"{name}: rel L2 {rel_l2:.3e} (limit {tol.rel_l2:.1e}), max rel {max_rel:.3e} "
            f"(limit {tol.max_rel:.1e}); tolerance: {tol.reason}")


class NoTorchOps(TorchDispatchMode):
    """Raises on any torch operator dispatched inside the ``with`` block."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise AssertionError(f"dispatched {func}")


class HostReads(TorchDispatchMode):
    """Records in ``reads`` the operators inside the ``with`` block that read a device value on
    the host (.item(), bool(), tolist()): a synchronisation, and not capturable."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))
