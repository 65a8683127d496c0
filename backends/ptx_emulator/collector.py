"""Python's cycle collector paused while the emulator parses, decodes and runs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cycle collector off for the block: the emulator allocates many short-lived objects,
    and each collection would walk every parsed program the caches hold (what it allocates
    holds no cycles and is freed by reference counting)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
