"""The eager wrappers' plan cache."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any


class PlanCache:
    """LRU of compiled plans, keyed by the plan class, the TensorDescs of its tensors and its
    validated, normalised options (a call whose options are refused never reaches the cache, and
    a plan that fails to build is never stored)."""

    def __init__(self, capacity: int = 128) -> None:
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def lookup(self, key: Hashable) -> Any:
        """The plan stored under ``key`` (now the most recent), or None."""
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
            return plan

    def put(self, key: Hashable, plan: Any) -> None:
        """Stores ``plan`` under ``key`` too (the least recent entries go past the capacity)."""
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._capacity:
                self._plans.popitem(last=False)

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build()
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._capacity:
                self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def plans(self) -> list[Any]:
        """The cached plans, least recently used first."""
        with self._lock:
            return list(self._plans.values())

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


EAGER_PLANS = PlanCache()
