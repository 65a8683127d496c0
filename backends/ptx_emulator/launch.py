"""A kernel launch on the emulator: parameters into memory, CTAs in batches, each batch run to
completion on its own machine."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import numpy as np

from .collector import collector_paused
from .decode import decode_program
from .faults import MAX_LANES_PER_BATCH, PtxFault
from .machine import Machine, Options
from .races import RaceCheck
from .memory import PARAMETER_PREFIX, Memory
from .parser import PtxProgram

_OPTIONS: contextvars.ContextVar[Options | None] = contextvars.ContextVar(
    "ptx_emulator_options", default=None
)


@contextlib.contextmanager
def using(options: Options) -> Iterator[None]:
    """Launches in the block that pass no options of their own run with ``options``."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def options_for(schedule: str) -> Options:
    """The options of ``using`` if a block set them, else ``schedule`` ("lockstep" or
    "skewed") with the shared-memory race check."""
    return _OPTIONS.get() or Options(schedule=schedule, race_check=True)


def _param_bytes(param, value) -> np.ndarray:
    if isinstance(value, (bytes, bytearray, np.ndarray)):
        raw = np.frombuffer(bytes(value), dtype=np.uint8)
        if len(raw) != param.size:
            raise PtxFault(f"parameter {param.name}: {len(raw)} bytes given, {param.size} declared")
        return raw.copy()
    if param.type in ("f32", "f64"):
        return np.asarray([value], dtype=np.float32 if param.type == "f32" else np.float64).view(
            np.uint8
        )
    if isinstance(value, float):
        raise PtxFault(f"parameter {param.name} (.{param.type}) given the float {value}")
    bits = 8 * param.size
    return np.asarray(
        [int(value) & ((1 << bits) - 1)],
        dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[param.size],
    ).view(np.uint8)


def launch(
    program: PtxProgram,
    grid: Sequence[int],
    params: Sequence,
    memory: Memory,
    dynamic_shared_bytes: int = 0,
    block: Sequence[int] | None = None,
    options: Options | None = None,
) -> None:
    """Runs ``program`` over ``grid`` CTAs of ``block`` threads (default: its ``.reqntid``).

    ``params`` are the kernel's parameters in order: ints (pointers, integers), floats, or
    bytes for byte-array parameters. Every global address the kernel touches must lie in a
    buffer registered in ``memory``. ``options``: the schedule and checks (default: those a
    ``using`` block set, else ``Options()``)."""
    options = options or _OPTIONS.get() or Options()
    if block is None:
        block = program.reqntid or program.maxntid
        if block is None:
            raise PtxFault(f"{program.name} declares no .reqntid; pass block=")
    block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    if len(params) != len(program.params):
        raise PtxFault(f"{program.name} takes {len(program.params)} parameters, got {len(params)}")
    buffers = {}
    for param, value in zip(program.params, params):
        raw = _param_bytes(param, value)
        buffers[param.name] = (
            memory.add_array(raw, PARAMETER_PREFIX + param.name, writable=False),
            len(raw),
        )
    with collector_paused():
        table = decode_program(program)
    threads = block[0] * block[1] * block[2]
    ctas = grid[0] * grid[1] * grid[2]
    shared = program.static_shared_bytes + int(dynamic_shared_bytes)
    per_batch = max(1, MAX_LANES_PER_BATCH // threads)
    old = np.seterr(all="ignore")
    try:
        with collector_paused():
            for first in range(0, ctas, per_batch):
                machine = Machine(
                    program,
                    table,
                    grid,
                    block,
                    buffers,
                    memory,
                    shared,
                    range(first, min(ctas, first + per_batch)),
                    options,
                )
                if options.race_check:
                    machine.race = RaceCheck(machine)
                machine.run()
    finally:
        np.seterr(**old)
