"""Per-architecture tile tables and the opt-in autotune: the table entry follows the target
architecture, candidates are timed in compile() only, the winner is remembered on disk under a
key of device, toolchain and problem, and a remembered winner is reused without timing."""

from __future__ import annotations

import json

import pytest
import torch

import fusedops
from fusedops.core.target import compiling_for, target_arch
from fusedops.engram_gate.samples import make
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.plan.autotune import tune

from helpers import BACKENDS, DEVICE, HAS_CUDA, requires_cuda


def _backward_plan(backend):
    t = make(40, 4, 64, torch.float32, seed=3, device=DEVICE).tensors
    fwd = fusedops.engram_gate_saved_forward(t["x"], t["kv"], t["weight"], t["mask"], backend=backend)
    plan = fusedops.EngramGateSavedBackward(t["x"], t["kv"], t["weight"], fwd["saved"], t["grad_out"],
                                            backend=backend)
    return plan, t, fwd["saved"]


def test_tile_table_follows_the_target_arch(monkeypatch):
    from fusedops.backends.triton.engram_gate import tiles
    plan, _, _ = _backward_plan("torch")
    assert target_arch(torch.device("cpu")) == "sm_90"
    for arch, (entry, why) in tiles.TILES.items():
        assert why
        with compiling_for(arch + "a"):
            assert tiles.tiles_for(plan.problem) == entry
    monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", "sm_100a")
    assert tiles.tiles_for(plan.problem) == tiles.TILES["sm_100"][0]
    monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", "sm_75")
    with pytest.raises(ValidationError, match=r"arch: expected one of sm_80, sm_90, sm_100"):
        tiles.tiles_for(plan.problem)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs the triton backend")
def test_autotune_picks_the_fastest_candidate_and_remembers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDOPS_CACHE_DIR", str(tmp_path))
    from fusedops.backends.triton.engram_gate import program as kernels
    plan, t, saved = _backward_plan("triton")
    candidates = kernels.backward_candidates(plan.problem)
    assert len(candidates) >= 3 and candidates[0] == kernels.tiles_for(plan.problem)
    fake_ms = [5.0, 1.0, 3.0, 4.0][:len(candidates)]
    timed = []

    def timer(launch):
        timed.append(1)
        return fake_ms[len(timed) - 1]

    def build(config):
        return kernels.backward_program(plan.problem, config=config)

    index, program = tune(plan, candidates, build, device_name="fake GPU", timer=timer)
    assert index == 1 and len(timed) == len(candidates)
    (key, entry), = json.loads((tmp_path / "autotune.json").read_text()).items()
    assert "fake GPU" in key and "triton=" in key and entry["times_ms"] == fake_ms
    assert entry["candidates"] == [repr(c) for c in candidates]
    assert entry["config"] == entry["candidates"][1]
    again, _ = tune(plan, candidates, build, device_name="fake GPU",
                    timer=lambda launch: pytest.fail("a remembered winner is not timed again"))
    assert again == 1
    other, _ = tune(plan, candidates, build, device_name="other GPU", timer=lambda launch: 2.0)
    assert other == 0                                     # another device: timed afresh
    plan._program = program                               # the winner computes the same gradients
    grads = plan.compile().execute(t["x"], t["kv"], t["weight"], saved, t["grad_out"],
                                   **plan.allocate_outputs(), workspace=plan.allocate_workspace())
    reference = fusedops.engram_gate_saved_backward(t["x"], t["kv"], t["weight"], saved,
                                                    t["grad_out"], backend="torch")
    for name in grads.keys():
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-4, atol=1e-5)


def test_autotune_needs_a_gpu_and_a_bool():
    plan, _, _ = _backward_plan("torch")
    if not HAS_CUDA:
        with pytest.raises(UnsupportedError, match=r"autotune: candidates are timed on a CUDA device"):
            plan.compile(autotune=True)
    with pytest.raises(ValidationError, match=r"autotune: expected a bool or None, got 1"):
        plan.compile(autotune=1)


@requires_cuda
@pytest.mark.gpu
def test_gpu_autotuned_plan_is_correct_and_capturable(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSEDOPS_CACHE_DIR", str(tmp_path))
    plan, t, saved = _backward_plan("triton")
    plan.compile(autotune=True)
    assert (tmp_path / "autotune.json").exists()
    outs = plan.allocate_outputs()
    workspace = plan.allocate_workspace()
    graph = torch.cuda.CUDAGraph()
    args = (t["x"], t["kv"], t["weight"], saved, t["grad_out"])
    plan.execute(*args, **outs, workspace=workspace)
    with torch.cuda.graph(graph):
        plan.execute(*args, **outs, workspace=workspace)
    graph.replay()
    torch.cuda.synchronize()
    reference = fusedops.engram_gate_saved_backward(*args, backend="torch")
    for name, value in outs.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5)
