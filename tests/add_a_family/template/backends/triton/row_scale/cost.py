"""Row scale: the kernel's bytes and FLOPs from its grid."""

from __future__ import annotations

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size


def forward_cost(problem) -> Cost:
    """x read and y written once; the weight, which every row's programs read, once (L2)."""
    n, d, e = problem.rows, problem.width, element_size(problem.dtype)
    return Cost(n * d, n * d * e + d * 4, n * d * e)
