"""The passed states' dtype (``state_dtype``): x's dtype by default, fp32 on request. Every
backend carries a sequence's state in fp32 and rounds only the copies the output and the backward
read, so the rounding does not compound along the sequence: y's error against the float64 scan
stays one bf16 rounding at 8K and 64K tokens (the table in docs/mamba2_scan.md, Numerics, comes from
``accuracy``)."""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops.errors import ValidationError

from helpers import BACKENDS, DEVICE

SCAN_BACKENDS = [b for b in BACKENDS if b in ("torch", "triton")]


def _inputs(length: int, h: int = 2, p: int = 16, n: int = 16, dtype=torch.bfloat16, seed=0):
    """One sequence with decays near 1 (a long memory: the passed state dominates y late in the
    sequence), rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    return dict(x=rnd(1, length, h, p).to(dtype), dt=(rnd(1, length, h) * 0.5 - 4).to(dtype),
                A=-torch.rand(h, generator=gen) * 0.05 - 0.01,
                B=rnd(1, length, 1, n).to(dtype), C=rnd(1, length, 1, n).to(dtype))


def _relative(value, ref) -> float:
    return ((value.double() - ref).norm() / ref.norm()).item()


def accuracy(length: int, backend: str = "torch", state_dtype=None, **shape) -> dict[str, float]:
    """Relative L2 errors of y and final_states against the float64 scan of the same (rounded)
    inputs, chunk 256."""
    t = _inputs(length, **shape)
    opts = dict(chunk_size=256, dt_softplus=True)
    ref = fusedops.mamba2_chunk_scan_forward(**{k: v.double().to(DEVICE) for k, v in t.items()},
                                             backend="torch", **opts)
    got = fusedops.mamba2_chunk_scan_forward(**{k: v.to(DEVICE) for k, v in t.items()},
                                             backend=backend, state_dtype=state_dtype, **opts)
    return dict(y=_relative(got["y"], ref["y"]),
                final_states=_relative(got["final_states"], ref["final_states"]))


@pytest.mark.parametrize("length", [8192, 65536])
def test_passed_states_in_bf16_keep_y_within_one_rounding(length):
    """bf16 passed states add about 40% to y's error (2.3e-3 against 1.7e-3, the output's own
    bf16 rounding), the same at 8K and 64K tokens: the rounding does not compound. final_states,
    carried in fp32, is exact to fp32 either way."""
    bf16 = accuracy(length)
    fp32 = accuracy(length, state_dtype=torch.float32)
    assert fp32["y"] < 1.8e-3 and bf16["y"] < 2.5e-3, (bf16, fp32)
    assert bf16["y"] <= 1.5 * fp32["y"], (bf16, fp32)
    assert bf16["final_states"] < 1e-6 and fp32["final_states"] < 1e-6


def test_passed_states_are_rounded_where_the_output_reads_them():
    """The option is honoured, not ignored: bf16 and fp32 passed states give different y (the
    state term of every segment but the first), the same final_states."""
    t = {k: v.to(DEVICE) for k, v in _inputs(1024).items()}
    a = fusedops.mamba2_chunk_scan_forward(**t, chunk_size=256, dt_softplus=True, backend="torch")
    b = fusedops.mamba2_chunk_scan_forward(**t, chunk_size=256, dt_softplus=True, backend="torch",
                                           state_dtype=torch.float32)
    assert torch.equal(a["y"][:, :256], b["y"][:, :256])         # no entering state yet
    assert not torch.equal(a["y"][:, 256:], b["y"][:, 256:])
    assert torch.equal(a["final_states"], b["final_states"])


@pytest.mark.parametrize("backend", [b for b in SCAN_BACKENDS if b != "torch"])
@pytest.mark.parametrize("state_dtype", [None, torch.float32], ids=["x-dtype", "fp32"])
def test_kernels_pass_states_like_the_reference(backend, state_dtype):
    """The kernels' y and gradients with either state dtype match the torch backend's with the
    same option (bf16 inputs, 3 segments, initial and final states)."""
    from fusedops.mamba2_scan import samples
    from .support import KERNEL_TOLERANCE, compare, run, with_options
    case = with_options(samples.small("all-options", torch.bfloat16, seed=9, device=DEVICE),
                        state_dtype=state_dtype)
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.bfloat16])


def test_saved_states_take_the_state_dtype():
    """Triton plans save the entering states in state_dtype: half the bytes in bf16."""
    from fusedops.core.desc import TensorDesc
    from fusedops.mamba2_scan import Mamba2ChunkScanForward
    def desc(*shape, dtype=torch.bfloat16):
        return TensorDesc(shape, dtype, device="cpu")
    d = dict(x=desc(1, 512, 4, 16), dt=desc(1, 512, 4), A=desc(4, dtype=torch.float32),
             B=desc(1, 512, 1, 16), C=desc(1, 512, 1, 16))
    plans = {sd: Mamba2ChunkScanForward(**d, chunk_size=128, state_dtype=sd, backend="torch")
             for sd in (None, torch.bfloat16, torch.float32)}
    assert plans[None].saved_states_bytes == plans[torch.bfloat16].saved_states_bytes == 4 * 4 * 16 * 16 * 2
    assert plans[torch.float32].saved_states_bytes == 4 * 4 * 16 * 16 * 4
    saved = {sd: plans[sd].kernel_program("triton").saved.offsets["states"] for sd in plans}
    assert saved[None][1] == torch.bfloat16 and saved[torch.float32][1] == torch.float32


def test_state_dtype_is_validated():
    t = {k: v.to(DEVICE) for k, v in _inputs(64).items()}
    with pytest.raises(ValidationError, match=r"^state_dtype: expected None, bfloat16 or float32 for x "
                                              r"of dtype bfloat16, got torch.float16"):
        fusedops.mamba2_chunk_scan_forward(**t, chunk_size=64, state_dtype=torch.float16)
    with pytest.raises(ValidationError, match=r"^state_dtype: expected "):
        fusedops.mamba2_chunk_scan_forward(**t, chunk_size=64, state_dtype="bf16")
    x32 = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in t.items()}
    with pytest.raises(ValidationError, match=r"^state_dtype: expected None, float32 for x of dtype "
                                              r"float32, got torch.bfloat16"):
        fusedops.mamba2_chunk_scan_forward(**x32, chunk_size=64, state_dtype=torch.bfloat16)
