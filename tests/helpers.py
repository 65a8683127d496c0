"""Test-session facts and the checks every family's tests share (built on fusedops.testing)."""

from __future__ import annotations

import pytest
import torch

from fusedops.testing import assert_close, default_device, runnable_backends

HAS_CUDA = torch.cuda.is_available()
DEVICE = default_device()
BACKENDS = runnable_backends(DEVICE)
GPU_BACKENDS = [b for b in BACKENDS if b != "torch"] if HAS_CUDA else []
KERNEL_BACKENDS = [b for b in BACKENDS if b != "torch"]

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def dtype_id(dtype: torch.dtype) -> str:
    """Readable parametrize id of a dtype."""
    return str(dtype).removeprefix("torch.")


def check_against_oracle(info, case, results: dict, names=None) -> None:
    """Every result (or those in ``names``) within the family's tolerance of its float64 oracle."""
    expected = info.oracle(case)
    for name in names or results:
        assert_close(results[name], expected[name], info.tolerance(name, case.dtype), name)
