"""Backend availability and selection.

A backend is a package under ``fusedops.backends``; an operator names, per backend, the module
that implements it. Every backend module exposes ``unsupported_reason(problem) -> str | None`` plus
the launcher builders its operator needs. ``auto`` picks, for the plan's device, the first backend
of the operator's preference order that can serve the problem.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Mapping, Sequence
from types import ModuleType

import torch

from .errors import UnsupportedError, ValidationError

BACKENDS = ("torch", "triton", "cute")
MIN_TRITON_CAPABILITY = (8, 0)


def triton_interpreter_active() -> bool:
    """True when Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _missing(module: str, distribution: str, extra: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"the {distribution} package is not installed (pip install 'fusedops[{extra}]')"
    return None


def _gpu_reason(kernels: str, device: torch.device, minimum: tuple[int, int]) -> str | None:
    if device.type != "cuda":
        return f"{kernels} kernels run on CUDA devices, not on {device.type}"
    cap = device_capability(device.index)
    if cap < minimum:
        return (f"{kernels} kernels need compute capability >= {minimum[0]}.{minimum[1]}; "
                f"{device} has {cap[0]}.{cap[1]}")
    return None


def toolchain_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run anything on ``device`` in this process, or None if it can."""
    if backend == "torch":
        return None
    if backend == "triton":
        missing = _missing("triton", "triton", "triton")
        if missing or device.type != "cpu":
            return missing or _gpu_reason("Triton", device, MIN_TRITON_CAPABILITY)
        if triton_interpreter_active():
            return None
        return ("Triton kernels run on CUDA devices; on cpu only under the Triton interpreter "
                "(TRITON_INTERPRET=1 set before triton is imported)")
    if backend == "cute":
        from fusedops.backends.cute.compiler import unsupported_reason
        return _missing("cuda.bindings", "cuda-python", "cute") or unsupported_reason(device)
    raise ValidationError(f"backend: expected one of auto, {', '.join(BACKENDS)}, got {backend!r}")


def auto_order(device: torch.device, preference: Sequence[str]) -> Sequence[str]:
    """Backends ``auto`` tries on ``device``: the operator's preference on CUDA, torch on CPU."""
    return preference if device.type == "cuda" else ("torch",)


def select_backend(op: str, requested: str, device: torch.device, problem,
                   implementations: Mapping[str, str],
                   preference: Sequence[str]) -> tuple[str, ModuleType]:
    """Returns (name, module) of the backend that will serve ``problem``.

    ``implementations`` maps backend name to the module implementing ``op``. A forced backend
    that cannot serve raises UnsupportedError saying why; ``auto`` takes the first of
    ``auto_order(device, preference)`` that can.
    """
    if requested != "auto" and requested not in BACKENDS:
        raise ValidationError(f"backend: expected one of auto, {', '.join(BACKENDS)}, got {requested!r}")
    candidates = auto_order(device, preference) if requested == "auto" else (requested,)
    reasons = []
    for name in candidates:
        reason = _unavailable(op, name, device, problem, implementations)
        if reason is None:
            return name, importlib.import_module(implementations[name])
        reasons.append(f"{name}: {reason}")
    raise UnsupportedError(f"backend={requested!r} cannot serve {op} on {device}: " + "; ".join(reasons))


def _unavailable(op, name, device, problem, implementations) -> str | None:
    if name not in implementations:
        return (f"{op} has no {name} implementation (implemented by: "
                f"{', '.join(implementations)})")
    reason = toolchain_unavailable_reason(name, device)
    if reason is None:
        reason = importlib.import_module(implementations[name]).unsupported_reason(problem)
    return reason
