"""Row scale: the Triton kernel's specialisation and program (the math:
fusedops.row_scale.contract; the kernel: kernels.py; its tiles: tiles.py; its traffic: cost.py)."""

from __future__ import annotations

import triton

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage

from ..runtime import KernelSpec, pointer_type
from .cost import forward_cost
from .kernels import row_scale_fwd_kernel
from .tiles import tiles_for


def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton row-scale kernel", problem.dtype)


def forward_program(problem) -> Program:
    t, block = pointer_type(problem.dtype), tiles_for(problem).BLOCK
    spec = KernelSpec.make(row_scale_fwd_kernel, (("x", t), ("weight", "*fp32"), ("y", t)),
                           dict(D=problem.width, BLOCK=block),
                           (problem.rows, triton.cdiv(problem.width, block)),
                           cost=forward_cost(problem))
    return Program(stages=(Stage(spec, dict(N=problem.rows)),))
