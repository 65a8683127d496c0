"""Test-session facts and the checks every family's tests share (built on fusedops.testing)."""

from __future__ import annotations

import os

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


def compile_env(**extra: str) -> dict[str, str]:
    """The environment of the tests' compiling subprocesses (the kernel report, the sample
    compiles, the emulated kernels): the test session's without Triton's interpreter, with
    ``extra``. One environment for all, so that Triton's on-disk cache (keyed by a kernel's
    source hash, its options, the target and the cache-invalidating environment variables)
    serves a specialisation one of them compiled to the others."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env.update(extra)
    return env
