"""How the Mamba2 scan's Triton kernels address their strided operands (kernels_forward.py,
kernels_backward.py): the stride arguments of each activation and where their values come from.

An activation is addressed as row·stride_b + position·stride_l + head·stride_h + column (dt-like
[b, l, h] operands have no head stride), each stride in units of its operand group's vector
(``ScanProblem.vector`` for x, z, y, dy, dx, dz; ``bc_vector`` for B, C, dB, dC; ``dt_vector``
for dt, ddt), multiplied back by a constexpr inside the kernel. The plan tensors' strides come
from the tensors execute() is handed (``Stride`` binds); the workspace and saved pieces (y and dy
before the gate) are contiguous, their strides plan-time numbers.
"""

from __future__ import annotations

from fusedops.core.program import Stride

__all__ = ["KINDS", "contiguous_x", "per_token_shape", "stride_args", "stride_names", "strides"]

_ROW_DIM = {"x": "h", "B": "g", "dt": None}


def stride_names(prefix: str, kind: str) -> tuple[str, ...]:
    """The stride arguments of one operand: b, l and the head or group dim (none for dt-like
    [b, l, h] operands). ``kind``: "x" ([b, l, h, p]), "B" ([b, l, g, n]) or "dt"."""
    dims = ("b", "l") + ((_ROW_DIM[kind],) if _ROW_DIM[kind] else ())
    return tuple(f"stride_{prefix}_{d}" for d in dims)


def stride_args(prefix: str, kind: str, present: bool = True) -> tuple[tuple[str, str | None], ...]:
    """What a kernel spec says of the operand's stride arguments beyond their default i32: the
    batch stride is i64; an absent operand's strides are all compiled out (None)."""
    if not present:
        return tuple((name, None) for name in stride_names(prefix, kind))
    return ((f"stride_{prefix}_b", "i64"),)


def strides(prefix: str, kind: str, source, unit: int, present: bool = True) -> dict:
    """Binds of ``prefix``'s stride arguments: the strides of the plan tensor ``source`` in
    units of ``unit`` elements, or (``source`` a tuple) the plan-time strides of a contiguous
    workspace or saved piece; 0 for an absent operand."""
    names = stride_names(prefix, kind)
    if not present:
        return dict.fromkeys(names, 0)
    if isinstance(source, tuple):
        return {name: value // unit for name, value in zip(names, source)}
    return {name: Stride(source, dim, unit) for dim, name in enumerate(names)}


def contiguous_x(problem) -> tuple[int, int, int]:
    """The strides (elements) of a contiguous [b, l, h, p] piece (y or dy before the gate)."""
    h, p = problem.heads, problem.head_dim
    return (problem.length * h * p, h * p, p)


KINDS = dict(y="x", ypre="x", dx="x", dz="x", ddt="dt", dB="B", dC="B")


def per_token_shape(problem, name) -> tuple[int, int, int]:
    """(rows per token, elements per row, stride unit) of a per-token output."""
    kind = KINDS[name]
    if kind == "x":
        return problem.heads, problem.head_dim, problem.vector
    if kind == "B":
        return problem.groups, problem.state, problem.bc_vector
    return 1, problem.heads, problem.dt_vector
