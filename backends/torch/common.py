"""What every torch family module shares: it serves every problem, needs no caller buffers
(temporaries come from torch's allocator; its backward recomputes, so nothing is saved) and
runs its math directly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fusedops.core.program import Program


def unsupported_reason(problem) -> str | None:
    """None: the reference math serves every problem its plan accepts."""
    return None


def direct_program(run: Callable[[Mapping[str, Any]], None]) -> Program:
    """A program that runs ``run(binding)``. Outside autograd: the outputs it writes in place
    may be tensors that require grad (a backward that differentiates its forward turns
    recording back on itself)."""
    def launch(binding: Mapping[str, Any], stream) -> None:
        with torch.no_grad():
            run(binding)
    return Program(run=launch)


def report(status: torch.Tensor | None, bit: int, bad: torch.Tensor) -> None:
    """ORs ``bit`` into the status word when any element of ``bad`` is true: device ops only,
    no host read (so the torch backend stays capturable and never synchronises on it)."""
    if status is not None:
        status.bitwise_or_(torch.where(bad.any(), bit, 0).to(status.dtype))
