"""Row scale in plain torch (the reference math of fusedops.row_scale.contract)."""

from __future__ import annotations

from fusedops.core.dtypes import accumulator_dtype

from ..common import direct_program, unsupported_reason

__all__ = ["backward_program", "forward_program", "unsupported_reason"]


def forward_program(problem):
    def run(b):
        acc = accumulator_dtype(problem.dtype)
        b["y"].copy_(b["x"].to(acc) * b["weight"])
    return direct_program(run)


def backward_program(problem):
    def run(b):
        acc = accumulator_dtype(problem.dtype)
        b["grad_x"].copy_(b["grad_y"].to(acc) * b["weight"])
        b["grad_weight"].copy_((b["grad_y"].to(acc) * b["x"].to(acc)).sum(0))
    return direct_program(run)
