"""Opt-in autotuning: time a backend's candidate configurations of a plan's program during
compile(), keep the fastest, and remember it on disk.

A backend family module that offers candidates exposes ``<program>_candidates(problem)`` (a list
of configurations, the tile table's entry first) and accepts ``config=`` in
``<program>_program(problem, config=None)``. ``plan.compile(autotune=True)`` (or
``FUSEDOPS_AUTOTUNE=1`` for every CUDA plan) times each candidate on the plan's device with
random inputs of the plan's shapes (index tensors from the plan's ``_tuning_tensors``), never in
execute(), and records the winner in ``$FUSEDOPS_CACHE_DIR/autotune.json`` (default
``~/.cache/fusedops``) under a key of the device name, the toolchain versions, the plan's
program and its problem. Later plans with the same key use the recorded winner without timing,
so runs are reproducible bit for bit; a CUDA Graph captures whatever compile() chose.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedError

AUTOTUNE_ENV = "FUSEDOPS_AUTOTUNE"
CACHE_ENV = "FUSEDOPS_CACHE_DIR"
_LOCK = threading.Lock()


def autotune_requested(autotune: bool | None, device: torch.device) -> bool:
    """``autotune`` when given (True on a non-CUDA plan is refused), else FUSEDOPS_AUTOTUNE for
    CUDA plans."""
    if autotune is None:
        return device.type == "cuda" and os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0")
    if not isinstance(autotune, bool):
        from ..errors import ValidationError
        raise ValidationError(f"autotune: expected a bool or None, got {autotune!r}")
    if autotune and device.type != "cuda":
        raise UnsupportedError(f"autotune: candidates are timed on a CUDA device; this plan is on "
                               f"{device}")
    return autotune


def cache_path() -> pathlib.Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fusedops")
    return pathlib.Path(root) / "autotune.json"


def _versions() -> str:
    names = ("torch", "triton", "nvidia-cutlass-dsl")
    out = []
    for name in names:
        try:
            out.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ",".join(out)


def tuning_key(plan, device_name: str) -> str:
    """The disk-cache key: device name, toolchain versions, backend, program and problem (its
    fields without the device)."""
    fields = {f.name: getattr(plan.problem, f.name) for f in dataclasses.fields(plan.problem)
              if f.name != "device"}
    return " | ".join((device_name, _versions(), plan.selected_backend, plan.op_name,
                       plan.program_name, repr(sorted(fields.items()))))


def _load() -> dict:
    path = cache_path()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store(key: str, index: int, candidates: list, times_ms: list[float]) -> None:
    """Record the winner ``index`` of ``candidates`` under ``key``, with every candidate's repr
    and time (in candidate order: the table's entry first), so a record says what won by how
    much."""
    with _LOCK:
        data = _load()
        data[key] = dict(index=index, config=repr(candidates[index]), times_ms=times_ms,
                         candidates=[repr(c) for c in candidates])
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)


def cuda_timer(launch: Callable[[], None], device: torch.device, reps: int = 10) -> float:
    """Median milliseconds of ``launch()`` on ``device`` (CUDA events, after a warm-up)."""
    for _ in range(2):
        launch()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def tune(plan, candidates: list, build: Callable[[Any], Any], *, device_name: str,
         timer: Callable[[Callable[[], None]], float] | None = None) -> tuple[int, Any]:
    """(index, program) of the fastest candidate for ``plan``: from the disk cache when its key
    is there, else by timing each candidate's program with ``timer`` (default: CUDA events on
    the plan's device) and recording the winner."""
    key = tuning_key(plan, device_name)
    recorded = _load().get(key)
    if recorded is not None and 0 <= recorded.get("index", -1) < len(candidates) \
            and recorded.get("config") == repr(candidates[recorded["index"]]):
        index = recorded["index"]
        return index, build(candidates[index])
    timer = timer or (lambda launch: cuda_timer(launch, plan.device))
    binding = plan._tuning_binding()
    names = frozenset(binding) | {"workspace"}
    times, programs = [], []
    for config in candidates:
        program = build(config)
        workspace = torch.empty(program.workspace.size, dtype=torch.uint8, device=plan.device)
        saved = binding.get("saved")
        if saved is not None and saved.numel() < program.saved.size:
            binding["saved"] = torch.empty(program.saved.size, dtype=torch.uint8, device=plan.device)
        launch = program.build(plan.device, names)
        times.append(timer(lambda: launch({**binding, "workspace": workspace}, None)))
        programs.append(program)
    index = min(range(len(times)), key=times.__getitem__)
    _store(key, index, candidates, times)
    return index, programs[index]

