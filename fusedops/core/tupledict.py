"""TupleDict: the result type of every eager wrapper and ``execute()``."""

from collections.abc import Iterator
from typing import Any


class TupleDict:
    """An ordered, immutable set of named results that behaves like a tuple and like a dict.

    Iterating yields the values (so ``out, saved = result`` unpacks), integers and slices index by
    position, strings index by name; ``keys()``, ``values()`` and ``items()`` work as on a dict.
    """

    __slots__ = ("_keys", "_values")

    def __init__(self, **named: Any) -> None:
        self._keys = tuple(named)
        self._values = tuple(named.values())

    def __getitem__(self, key):
        if isinstance(key, str):
            try:
                return self._values[self._keys.index(key)]
            except ValueError:
                raise KeyError(f"{key!r}: this result has keys {self._keys}") from None
        return self._values[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key) -> bool:
        return key in self._keys

    def keys(self) -> tuple[str, ...]:
        return self._keys

    def values(self) -> tuple[Any, ...]:
        return self._values

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple(zip(self._keys, self._values))

    def get(self, key: str, default=None):
        return self[key] if key in self._keys else default

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.items())
        return f"TupleDict({inner})"


def _short(value) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        return f"Tensor{list(shape)}:{str(value.dtype).removeprefix('torch.')}"
    return repr(value)
