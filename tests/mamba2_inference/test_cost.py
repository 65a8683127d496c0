"""Mamba2 inference: the kernels' cost models (modelled bytes and FLOPs against their floors and the
reuse-distance rule).
"""

from __future__ import annotations

import pytest

from .support import _production


def test_update_model_against_its_floor():
    """The update's model (backends/triton/mamba2_inference/cost.py) on sm_90 is its floor plus
    what reuse distance re-reads. The grid (b, h, p/BP) runs the row fastest: a (row, group)'s
    B and C rows are re-read by the group's next head b = 256 programs later, a (row, head)'s dt
    and B, C by the next head-dim block h·b = 32768 programs later, a row's slot index and seeds
    by every program of the row, b apart. A program moves its dt (T·2 bytes), B and C
    (2·T·n·2), the slot (4) and seeds (16, stochastic), its state tile (BP·n·s read, written,
    and once per snapshot) and x, z, y rows (BP·T·2 each): 16,998 bytes at T = 1 fp32 (BP = 16),
    16,604 at T = 4 fp16 stochastic with snapshots (BP = 8); G = 0.5 · 50 MB over that, about
    1,500: b <= G < h·b, so dt, B and C count once per head-dim block (the floor's once, p/BP
    times), the slot and seeds once. The rollback (grid (b, 256 tiles), the row fastest): a
    row's accepted count and slot are re-read b programs apart, and a program moves 2 x 4096
    fp16 values and 8 bytes: G = 1,525 >= b, so its read is the floor's."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_inference import cost as model
    from fusedops.core.target import compiling_for
    h, p, g, n, e = 128, 64, 8, 128, 2
    for label, b, T, bp, s in (("decode T=1 float32", 256, 1, 16, 4),
                               ("decode T=4 float16 stochastic snapshots", 256, 4, 8, 2)):
        plan = _production(label)
        stochastic, snaps = plan.problem.stochastic, plan.problem.has_snapshots
        moved = (T * e + 2 * T * n * e + 4 + 16 * stochastic
                 + bp * n * s * (2 + (T + 1) * snaps) + 3 * bp * T * e)
        assert b <= 0.5 * 50e6 / moved < h * b, label
        with compiling_for("sm_90"):
            cost = model.update_cost.__wrapped__(plan.problem, bp)
        floor = plan.floor()
        assert cost.bytes_written == floor.bytes_written
        per_block = b * T * (h * e + 2 * g * n * e)         # dt, B and C read once
        assert cost.bytes_read == floor.bytes_read + (p // bp - 1) * per_block, label
    rollback = _production("rollback fp16")
    with compiling_for("sm_90"):
        cost = model.rollback_cost.__wrapped__(rollback.problem, 4096)
    floor = rollback.floor()
    assert 0.5 * 50e6 / (2 * 4096 * 2 + 8) >= 256
    assert cost.bytes_written == floor.bytes_written == 256 * 128 * 64 * 128 * 2
    assert cost.bytes_read == floor.bytes_read


def test_update_kernels_carry_the_model():
    """The update's and the rollback's kernels carry mamba2_inference.cost's cost."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_inference import cost as model, tiles
    plan = _production("decode T=1 float16")
    (kernel,) = plan.kernel_program("triton").kernels
    assert kernel.cost == model.update_cost(plan.problem, tiles.head_dim_rows(plan.problem))
    rollback = _production("rollback fp16")
    (kernel,) = rollback.kernel_program("triton").kernels
    assert kernel.cost == model.rollback_cost(rollback.problem, 4096)
