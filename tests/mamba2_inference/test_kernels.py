"""Mamba2 inference: the kernels. Tile tables per architecture, autotune candidates, compile-time
specialisation and compiled-out operands, determinism, GPU-only shapes.
"""

from __future__ import annotations

import pytest
import torch

from fusedops import Mamba2StateRollback, Mamba2StateUpdate
from fusedops.mamba2_inference import samples

from helpers import DEVICE

from .support import BACKENDS, _production, decode_inputs


def test_triton_programs_compile_absent_operands_out():
    """Without D, z, dt_bias, slot indices, seeds or snapshots the update kernel takes no
    pointer for them (constexpr None, never another tensor); likewise the rollback's indices."""
    pytest.importorskip("triton")
    core, _, state = decode_inputs(2, 1, 2, 8, 1, 8)
    update = Mamba2StateUpdate(state, *core.values(), backend="torch").kernel_program("triton")
    (kernel,) = update.kernels
    names = [a for a in kernel.runtime_arg_names() if not a.startswith("stride_")]
    assert names == ["state_ptr", "x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr", "y_ptr", "SLOTS",
                     "T", "dt_min", "dt_max"]
    snapshots = torch.zeros(2, 2, 2, 8, 8, device=DEVICE)
    rollback = Mamba2StateRollback(state, snapshots, torch.zeros(2, dtype=torch.int32, device=DEVICE),
                                   backend="torch").kernel_program("triton")
    assert rollback.kernels[0].runtime_arg_names() == ("state_ptr", "snapshots_ptr", "accepted_ptr",
                                                       "SLOTS")


def test_block_table_follows_the_target_arch():
    """One entry per architecture, each with its reason; the programs take the target's entry
    (or ``config=``); the candidates start with it."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_inference import program as kernels, tiles
    from fusedops.core.target import compiling_for
    plan = _production("decode T=4 float16 stochastic snapshots")
    assert set(tiles.TILES) == {"sm_80", "sm_90", "sm_100"}
    for arch, (entry, why) in tiles.TILES.items():
        assert why
        with compiling_for(arch):
            assert tiles.tiles_for(plan.problem) == entry
            assert kernels.update_candidates(plan.problem)[0] == entry
    other = tiles.DecodeTiles(BP=32, BP_STOCHASTIC=4, MAX_WARPS=2)
    (spec,) = kernels.update_program(plan.problem, config=other).kernels
    assert spec.grid == (256, 128, 16) and spec.num_warps == 2     # 64 / 4 rows, 4·128/256 warps


def test_tuning_tensors_are_valid_index_data():
    """Candidates are timed with distinct valid slots and accepted counts in [0, T]."""
    update = _production("decode T=1 float16")
    slots = update._tuning_tensors()["state_batch_indices"]
    assert slots.dtype == torch.int32 and slots.shape == (256,)
    assert len(set(slots.tolist())) == 256 and 0 <= int(slots.min()) and int(slots.max()) < 512
    rollback = _production("rollback fp16")
    tensors = rollback._tuning_tensors()
    assert int(tensors["accepted"].min()) == 0 and int(tensors["accepted"].max()) == 4
    core, _, state = decode_inputs(3, 1, 2, 8, 1, 8)
    small = Mamba2StateUpdate(state[:2], *core.values(),
                              state_batch_indices=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                              backend="torch")
    assert sorted(small._tuning_tensors()["state_batch_indices"].tolist()) == [-1, 0, 1]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "triton"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_autotune_candidate_gives_the_same_bits(backend, rounding):
    """Each candidate's update (another head-dim block) and rollback (another tile) write the
    same bits as the table's entry: the blocks change no reduction or random draw."""
    from fusedops.backends.triton.mamba2_inference import program as kernels
    case = samples.make(3, 3, 2, 32, 1, 16, torch.float32, state_dtype=torch.bfloat16, slots=5,
                        indices=[4, -1, 1], D="h", z=True, dt_bias=True, rounding=rounding,
                        accepted=[2, 0, 3], seed=4, device=DEVICE)
    t = case.tensors
    args = {k: t[k] for k in samples.UPDATE_TENSORS}
    probe = Mamba2StateUpdate(**args, snapshots=t["snapshots"], **case.options, backend=backend)
    configs = kernels.update_candidates(probe.problem)
    results = []
    for config in configs:
        state, snapshots = t["state"].clone(), torch.zeros_like(t["snapshots"])
        y = torch.zeros_like(t["x"])
        update = Mamba2StateUpdate(**dict(args, state=state), snapshots=snapshots, **case.options,
                                   backend=backend)
        update._program = kernels.update_program(update.problem, config=config)
        update.compile().execute(**dict(args, state=state), y=y, snapshots=snapshots,
                                 rng_seed=t["rng_seed"], rng_offset=t["rng_offset"])
        rollback = Mamba2StateRollback(state, snapshots, t["accepted"], backend=backend,
                                       state_batch_indices=t["state_batch_indices"])
        rollback._program = kernels.rollback_program(rollback.problem, config=config)
        rollback.compile().execute(state, snapshots, t["accepted"],
                                   state_batch_indices=t["state_batch_indices"])
        results.append((y, snapshots, state))
    for y, snapshots, state in results[1:]:
        for got, want in zip((y, snapshots, state), results[0]):
            assert torch.equal(got, want)
