"""The process-wide compile cache: compiled artifacts keyed only by plan-time values."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int


class CompileCache:
    """Maps a hashable key (a frozen dataclass of dtypes, static sizes, flags and the target)
    to what compiling it produced. Token counts and other runtime sizes are never in a key."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._entries:
                self._hits += 1
                return self._entries[key]
        value = build()
        with self._lock:
            self._misses += 1
            return self._entries.setdefault(key, value)

    def info(self) -> CacheInfo:
        return CacheInfo(self._hits, self._misses, len(self._entries))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = 0


COMPILE_CACHE = CompileCache()


def cache_info() -> CacheInfo:
    """Hits, misses and size of the process-wide compile cache."""
    return COMPILE_CACHE.info()


def cache_clear() -> None:
    """Drops every compiled artifact (plans already compiled keep theirs)."""
    COMPILE_CACHE.clear()
