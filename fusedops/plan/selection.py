"""Backend selection: which backend serves a plan.

A backend is a package ``fusedops.backends.<name>`` that states its own availability
(``unavailable_reason(device)``) and holds one module per operator family, each stating which
problems it serves (``unsupported_reason(problem)``). ``auto`` tries, on a CUDA device, the
plan's ``auto_order``; on any other device, torch. No backend is special-cased here.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

import torch

from ..errors import UnsupportedError, ValidationError

BACKENDS = ("torch", "triton", "cute")


def backend_package(name: str) -> ModuleType:
    """``fusedops.backends.<name>`` (its availability API; imports no toolchain)."""
    return importlib.import_module(f"fusedops.backends.{name}")


def backend_unavailable_reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run anything on ``device`` in this process, or None."""
    if name not in BACKENDS:
        raise ValidationError(f"backend: expected one of auto, {', '.join(BACKENDS)}, got {name!r}")
    return backend_package(name).unavailable_reason(device)


def auto_candidates(device: torch.device, auto_order: Sequence[str]) -> Sequence[str]:
    """Backends ``auto`` tries on ``device``: the plan's order on CUDA, torch elsewhere."""
    return auto_order if device.type == "cuda" else ("torch",)


def select_backend(op: str, requested: str, device: torch.device, problem, module: str,
                   implemented: Sequence[str], auto_order: Sequence[str]) -> tuple[str, ModuleType]:
    """Returns (name, family module) of the backend that will serve ``problem``.

    ``module``: the family's module name in each backend package; ``implemented``: the backends
    that have it. A forced backend that cannot serve raises UnsupportedError saying why;
    ``auto`` takes the first of ``auto_candidates`` that can.
    """
    if not isinstance(requested, str):
        raise ValidationError(f"backend: expected a string, got {type(requested).__name__}")
    if requested != "auto" and requested not in BACKENDS:
        raise ValidationError(f"backend: expected one of auto, {', '.join(BACKENDS)}, got {requested!r}")
    candidates = auto_candidates(device, auto_order) if requested == "auto" else (requested,)
    reasons = []
    for name in candidates:
        if name not in implemented:
            reason = f"{op} has no {name} implementation (implemented by: {', '.join(implemented)})"
        else:
            reason = backend_unavailable_reason(name, device)
        if reason is None:
            family = importlib.import_module(f"fusedops.backends.{name}.{module}")
            reason = family.unsupported_reason(problem)
            if reason is None:
                return name, family
        reasons.append(f"{name}: {reason}")
    raise UnsupportedError(f"backend={requested!r} cannot serve {op} on {device}: " + "; ".join(reasons))
