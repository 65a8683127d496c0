"""Host-side checks of index data, for eager users and debugging (``check_inputs=True`` or
``FUSEDOPS_CHECK_INPUTS=1``). They copy the index tensor to the host (a synchronisation), so
plans never run them in execute(); there the kernels clamp or mask and report through the
status word instead (``fusedops.core.status``). Each raises ValidationError naming the argument
and the first bad entry."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from ..errors import ValidationError

CHECK_INPUTS_ENV = "FUSEDOPS_CHECK_INPUTS"


def check_inputs_requested(check_inputs: bool | None) -> bool:
    """``check_inputs`` if given (a bool), else whether FUSEDOPS_CHECK_INPUTS is set (not "0")."""
    if check_inputs is None:
        return os.environ.get(CHECK_INPUTS_ENV, "0") not in ("", "0")
    if not isinstance(check_inputs, bool):
        raise ValidationError(f"check_inputs: expected a bool or None, got {check_inputs!r}")
    return check_inputs


def _host(t: torch.Tensor) -> list[int]:
    return t.detach().reshape(-1).to("cpu", torch.int64).tolist()


def _index(shape, flat: int) -> str:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size if size else 0)
        flat //= size if size else 1
    return ", ".join(map(str, reversed(idx)))


def check_cu_seqlens(name: str, cu: torch.Tensor, total: int) -> None:
    """cu[0] == 0, non-decreasing, cu[-1] <= total (the packed tokens)."""
    values = _host(cu)
    if values[0] != 0:
        raise ValidationError(f"{name}: expected offsets starting at 0, got {name}[0] = {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValidationError(f"{name}: expected non-decreasing offsets, got {name}[{i}] = "
                                  f"{values[i]} < {name}[{i - 1}] = {values[i - 1]}")
    if values[-1] > total:
        raise ValidationError(f"{name}: expected offsets up to the {total} packed tokens, got "
                              f"{name}[{len(values) - 1}] = {values[-1]}")


def check_range(name: str, t: torch.Tensor, lo: int, hi: int, *, allowed: Iterable[int] = (),
                meaning: str = "") -> None:
    """Every entry in [lo, hi) or one of ``allowed`` (sentinels such as -1 for padding)."""
    allowed = tuple(allowed)
    for flat, value in enumerate(_host(t)):
        if not lo <= value < hi and value not in allowed:
            extra = f" or {' / '.join(map(str, allowed))}" if allowed else ""
            raise ValidationError(f"{name}: expected entries in [{lo}, {hi}){extra}{meaning}, got "
                                  f"{name}[{_index(tuple(t.shape), flat)}] = {value}")


def check_each_at_most(name: str, t: torch.Tensor, limits: list[int], what: str) -> None:
    """Entry i of ``t`` in [0, limits[i]] (e.g. cache lengths against each row's capacity)."""
    for i, (value, limit) in enumerate(zip(_host(t), limits)):
        if not 0 <= value <= limit:
            raise ValidationError(f"{name}: expected {name}[{i}] in [0, {limit}] ({what}), got {value}")
