"""Row scale: every backend against the float64 oracle."""

from __future__ import annotations

import pytest
import torch

from fusedops.row_scale.info import INFO

from helpers import BACKENDS, DEVICE, check_against_oracle


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("torch", "triton")])
@pytest.mark.parametrize("kind", ["small", "edge"])
def test_backend_matches_oracle(backend, kind):
    for case in INFO.cases(kind, dtype=torch.float32, device=DEVICE, backend=backend):
        check_against_oracle(INFO, case, INFO.run(case, backend))
