"""Validation of scalar options, written once for every plan, eager wrapper and torch op.

Each validator takes ``(name, value)`` and returns the normalised value (the canonical, hashable
form the plan and the eager plan cache use) or raises ``ValidationError`` naming the argument,
what was expected and what was given. An int is an int: bool and float are refused; a float is
a real number (bool refused) and finite unless said otherwise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ValidationError
from .dtypes import dtype_name

Validator = Callable[[str, Any], Any]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def expect_bool(name: str, value) -> bool:
    """A bool (not an int or anything truthy)."""
    if not isinstance(value, bool):
        raise ValidationError(f"{name}: expected a bool, got {value!r}")
    return value


def expect_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An int in [minimum, maximum] (either bound optional)."""
    bounds = _bounds(minimum, maximum)
    if not _is_int(value) or (minimum is not None and value < minimum) or \
            (maximum is not None and value > maximum):
        raise ValidationError(f"{name}: expected an int{bounds}, got {value!r}")
    return int(value)


def expect_int_choice(name: str, value, choices: Sequence[int]) -> int:
    """One of ``choices`` as an int (64.0 is not 64)."""
    if not _is_int(value) or int(value) not in choices:
        raise ValidationError(f"{name}: expected an int, one of {tuple(choices)}, got {value!r}")
    return int(value)


def expect_float(name: str, value, *, minimum: float | None = None, positive: bool = False,
                 finite: bool = True) -> float:
    """A real number (int or float; bool refused), finite unless ``finite=False``, > 0 with
    ``positive``, >= ``minimum``."""
    kind = "a finite float" if finite else "a float"
    bounds = [b for b, on in (("> 0", positive), (f">= {minimum:g}" if minimum is not None else "",
                                                   minimum is not None)) if on]
    ok = _is_real(value)
    if ok:
        value = float(value)
        ok = not math.isnan(value) and (not finite or math.isfinite(value)) and \
            (not positive or value > 0) and (minimum is None or value >= minimum)
    if not ok:
        raise ValidationError(f"{name}: expected {' '.join([kind, *bounds])}, got {value!r}")
    return value


def expect_choice(name: str, value, choices: Sequence[str]) -> str:
    """One of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValidationError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def expect_int_pair(name: str, value, minimum: int, meaning: str = "") -> tuple[int, int]:
    """A pair of ints >= minimum (a list or tuple)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(_is_int(v) for v in value) \
            or any(v < minimum for v in value):
        raise ValidationError(f"{name}: expected a pair (left, right) of ints >= {minimum}{meaning}, "
                              f"got {value!r}")
    return int(value[0]), int(value[1])


def expect_float_range(name: str, value) -> tuple[float, float]:
    """A pair (lo, hi) of real numbers, neither NaN, lo <= hi (infinities allowed)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(_is_real(v) for v in value):
        raise ValidationError(f"{name}: expected a pair (lo, hi) of floats, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ValidationError(f"{name}: expected lo <= hi, neither NaN, got {value!r}")
    return lo, hi


def expect_dtype_choice(name: str, value, choices: Sequence[torch.dtype]) -> torch.dtype:
    """One of the torch dtypes ``choices``."""
    if not isinstance(value, torch.dtype) or value not in choices:
        names = " or ".join(dtype_name(d) for d in choices)
        raise ValidationError(f"{name}: expected {names}, got {value!r}")
    return value


def optional(validator: Validator) -> Validator:
    """``validator`` that also takes None (kept as None)."""
    def check(name: str, value):
        return None if value is None else validator(name, value)
    return check


def _bounds(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


@dataclass(frozen=True)
class Option:
    """A plan option: its name, validator and default (``validate(name, value)`` returns the
    normalised value)."""

    name: str
    validate: Validator
    default: Any = None

    def normalise(self, value) -> Any:
        return self.validate(self.name, value)
