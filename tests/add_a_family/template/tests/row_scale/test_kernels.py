"""Row scale: the kernel's tile table and grid."""

from __future__ import annotations

import pytest
import torch

from fusedops.row_scale import RowScaleForward


def test_every_architecture_has_a_tile_with_its_reason():
    pytest.importorskip("triton")
    from fusedops.backends.triton.row_scale import tiles
    assert set(tiles.TILES) == {"sm_80", "sm_90", "sm_100"}
    assert all(why for _, why in tiles.TILES.values())
    plan = RowScaleForward(torch.zeros(3, 2000), torch.zeros(2000), backend="triton")
    (spec,) = plan.kernel_program("triton").kernels
    assert spec.grid == (3, 2, 1)
