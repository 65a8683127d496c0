"""Row scale: construction errors name the argument."""

from __future__ import annotations

import pytest
import torch

from fusedops.errors import ValidationError
from fusedops.row_scale import RowScaleForward


def test_weight_must_match_the_rows():
    with pytest.raises(ValidationError, match=r"weight: expected shape \[D\]"):
        RowScaleForward(torch.zeros(2, 8), torch.zeros(4))
