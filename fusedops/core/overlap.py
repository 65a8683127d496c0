"""Whether two strided tensors share a byte: exact, so slices of one fused buffer (q, k and v of
a fused projection, dq/dk/dv written into one gradient buffer) are not refused for overlapping
extents while their elements never meet.

The question is whether some element of A and some element of B occupy a common byte:
``-size_a < (addr_a + sum_k i_k sa_k) - (addr_b + sum_k j_k sb_k) < size_b`` for indices in
range. The search walks the dimensions of both tensors by decreasing stride, keeping only index
values the remaining dimensions can still compensate; for the layouts tensors have (each stride
at least the extent of the smaller ones) it visits a handful of nodes. Past a node budget it
answers True: refusing a rare exotic layout is safe, writing over an input is not.
"""

from __future__ import annotations

import torch

NODE_BUDGET = 100_000


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor may touch (its strided extent)."""
    if tensor.numel() == 0:
        return (0, 0)
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def _terms(tensor: torch.Tensor, sign: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(base offset, [(stride in bytes > 0, least, most index multiplier)]) of a tensor, with
    negative strides folded into the base and ``sign`` applied."""
    e = tensor.element_size()
    base, terms = 0, []
    for size, stride in zip(tensor.shape, tensor.stride()):
        if size <= 1 or stride == 0:
            continue
        s = stride * e
        if s < 0:
            base += (size - 1) * s
            s = -s
        terms.append((s, 0, size - 1) if sign > 0 else (s, -(size - 1), 0))
    return sign * base, terms


def shares_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when some byte belongs to an element of both tensors (same device assumed)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (alo, ahi), (blo, bhi) = byte_range(a), byte_range(b)
    if not (alo < bhi and blo < ahi):
        return False
    base_a, terms_a = _terms(a, +1)
    base_b, terms_b = _terms(b, -1)
    terms = sorted(terms_a + terms_b, key=lambda t: -t[0])
    start = a.data_ptr() - b.data_ptr() + base_a + base_b
    lo, hi = -a.element_size(), b.element_size()         # exclusive bounds of the difference
    # the least and most the remaining terms can add, from each position on
    rest_min = [0] * (len(terms) + 1)
    rest_max = [0] * (len(terms) + 1)
    for k in range(len(terms) - 1, -1, -1):
        s, least, most = terms[k]
        rest_min[k] = rest_min[k + 1] + least * s
        rest_max[k] = rest_max[k + 1] + most * s
    budget = [NODE_BUDGET]

    def search(k: int, value: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return True
        if k == len(terms):
            return lo < value < hi
        if value + rest_max[k] <= lo or value + rest_min[k] >= hi:
            return False
        s, least, most = terms[k]
        # this term's multiplier c must leave lo < value + c s + rest < hi reachable
        c_lo = max(least, (lo - value - rest_max[k + 1]) // s + 1)
        c_hi = min(most, -((value + rest_min[k + 1] - hi) // s) - 1)
        for c in range(c_lo, c_hi + 1):
            if search(k + 1, value + c * s):
                return True
        return False

    return search(0, start)
