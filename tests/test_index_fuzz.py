"""Memory safety for any index data: every plan that reads index tensors runs on drawn index data,
in range and out of range, with guard bands around every caller buffer. Nothing outside the
buffers may change, invalid data must be reported in the status word (valid data must not), and
every backend's outputs must equal the torch backend's (the rows with invalid metadata included:
their outputs are defined). Each (family, backend) runs in a forked child process, so an access
far outside the buffers fails the test rather than the test run."""

from __future__ import annotations

import multiprocessing
import traceback

import pytest
import torch

from fusedops.core.status import Status
from fusedops.registry import FAMILIES
from fusedops.testing import errors
from fusedops.testing.fuzz import run_guarded

from helpers import BACKENDS, DEVICE

SEED = 2026
FAMILIES_WITH_INDEX_DATA = [info for info in FAMILIES if info.index_fuzz is not None]


def _child(info, backend, pipe) -> None:
    rows = []
    try:
        for case in info.index_fuzz(SEED, backend, DEVICE):
            pipe.send(("running", case.label))
            result = run_guarded(case, backend)
            reference = run_guarded(case, "torch") if backend != "torch" else result
            worst = {}
            for name, value in result.outputs.items():
                ref = reference.outputs[name]
                if value.is_floating_point():
                    finite = torch.isfinite(ref)
                    same_nonfinite = torch.equal(finite, torch.isfinite(value))
                    rel, _ = errors(value[finite], ref[finite]) if finite.any() else (0.0, 0.0)
                    worst[name] = (rel, same_nonfinite)
                else:
                    worst[name] = (0.0 if torch.equal(value, ref) else 1.0, True)
            rows.append((case.label, int(case.expected), int(result.status), result.damaged,
                         int(reference.status), worst))
        pipe.send(("done", rows))
    except BaseException:  # noqa: BLE001  (report everything to the parent)
        pipe.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("info,backend", [pytest.param(info, b, id=f"{info.name}-{b}")
                                          for info in FAMILIES_WITH_INDEX_DATA for b in BACKENDS
                                          if b in info.backends])
def test_index_fuzz(info, backend):
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_child, args=(info, backend, child))
    process.start()
    last, rows = None, None
    while True:
        if not parent.poll(300):
            process.kill()
            pytest.fail(f"{info.name} on {backend}: no progress for 300 s after {last!r}")
        try:
            kind, payload = parent.recv()
        except EOFError:
            break
        if kind == "running":
            last = payload
        elif kind == "error":
            pytest.fail(f"{info.name} on {backend}, case {last!r}:\n{payload}")
        else:
            rows = payload
            break
    process.join(60)
    assert rows is not None, (f"{info.name} on {backend}: the child died (exit code "
                              f"{process.exitcode}) in case {last!r}: an access outside the buffers")
    assert rows, "no fuzz case was drawn"
    problems = []
    for label, expected, status, damaged, reference_status, worst in rows:
        if damaged:
            problems.append(f"{label}: wrote outside {damaged}")
        if Status(expected) and not Status(status) & Status(expected):
            problems.append(f"{label}: expected {Status(expected).describe()} reported, got "
                            f"{Status(status).describe()}")
        if not Status(expected) and Status(status):
            problems.append(f"{label}: valid index data reported as {Status(status).describe()}")
        if status != reference_status:
            problems.append(f"{label}: status {Status(status).describe()} but the torch backend "
                            f"reports {Status(reference_status).describe()}")
        for name, (rel, same_nonfinite) in worst.items():
            tolerance = info.tolerance(name, torch.float32).rel_l2 * 10 if backend != "torch" else 0.0
            if rel > max(tolerance, 1e-4 if backend != "torch" else 0.0) or not same_nonfinite:
                problems.append(f"{label}: {name} differs from the torch backend (rel L2 {rel:.2e}"
                                f"{'' if same_nonfinite else ', other non-finite entries'})")
    assert not problems, "\n".join(problems)
