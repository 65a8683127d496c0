"""Whether two strided tensors share a byte: exact, so slices of one fused buffer (q, k and v of
a fused projection, dq/dk/dv written into one gradient buffer) are not refused for overlapping
extents while their elements never meet.

The question is whether some element of A and some element of B occupy a common byte:
``-size_a < (addr_a + sum_k i_k sa_k) - (addr_b + sum_k j_k sb_k) < size_b`` for indices in
range. The search walks the dimensions of both tensors by decreasing stride, keeping only index
values the remaining dimensions can still compensate; for the layouts tensors have (each stride
at least the extent of the smaller ones) it visits a handful of nodes. Past a node budget it
answers True: refusing a rare exotic layout is safe, writing over an input is not. The answer
depends only on the two layouts and the distance between their data pointers, so it is
remembered per (distance, layouts): views of one fused buffer are searched once.

``extents_meet`` answers the cheaper question first, for many tensors at once: whether any
written tensor's byte extent intersects another tensor's (a sort and one sweep); only when one
does must pairs be searched.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

NODE_BUDGET = 100_000
LAYOUT_PAIRS_REMEMBERED = 4096   # (distance, layouts) answers kept by ``shares_bytes``


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the bytes a tensor may touch (its strided extent)."""
    if tensor.numel() == 0:
        return (0, 0)
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def extents_meet(spans: Iterable[tuple[int, int, bool]]) -> bool:
    """True when some span marked written intersects another span: ``spans`` are non-empty
    [start, end) byte extents, each with whether its tensor is written. Spans that are only read
    may intersect each other (views of one fused input)."""
    end_all = end_written = -1
    for start, end, written in sorted(spans):
        if start < (end_all if written else end_written):
            return True
        if end > end_all:
            end_all = end
        if written and end > end_written:
            end_written = end
    return False


def _terms(shape, stride, e: int, sign: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(base offset, [(stride in bytes > 0, least, most index multiplier)]) of a layout, with
    negative strides folded into the base and ``sign`` applied."""
    base, terms = 0, []
    for size, stride in zip(shape, stride):
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
    return layouts_share_bytes(a.data_ptr() - b.data_ptr(), tuple(a.shape), tuple(a.stride()),
                               a.element_size(), tuple(b.shape), tuple(b.stride()),
                               b.element_size())


@functools.lru_cache(maxsize=LAYOUT_PAIRS_REMEMBERED)
def layouts_share_bytes(distance: int, shape_a: tuple[int, ...], stride_a: tuple[int, ...],
                        size_a: int, shape_b: tuple[int, ...], stride_b: tuple[int, ...],
                        size_b: int) -> bool:
    """Whether non-empty layouts A and B (shapes, strides in elements, element sizes in bytes)
    share a byte when A's data pointer lies ``distance`` bytes after B's."""
    def extent(shape, stride, e):
        return (1 + sum((n - 1) * abs(s) for n, s in zip(shape, stride))) * e
    if not (distance < extent(shape_b, stride_b, size_b)
            and 0 < distance + extent(shape_a, stride_a, size_a)):
        return False
    base_a, terms_a = _terms(shape_a, stride_a, size_a, +1)
    base_b, terms_b = _terms(shape_b, stride_b, size_b, -1)
    terms = sorted(terms_a + terms_b, key=lambda t: -t[0])
    start = distance + base_a + base_b
    lo, hi = -size_a, size_b                            # exclusive bounds of the difference
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
