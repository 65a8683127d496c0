"""Engram saved-state gate: the kernels. Tile tables per architecture, autotune candidates, compile-time
specialisation and compiled-out operands, determinism, GPU-only shapes.
"""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops.engram_gate import GateProblem
from fusedops.opinfo import FP32_REDUCTION, ROUNDED_ONCE
from fusedops.testing import assert_close

from helpers import BACKENDS, DEVICE, GPU_BACKENDS, HAS_CUDA, requires_cuda

from .support import DTYPES, EPS, _compiled_pair, check_against_oracle, make_inputs, run_plans


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_shape_s4_d5120(backend):
    t = make_inputs(3, 4, 5120, torch.bfloat16, seed=11)
    check_against_oracle(t, run_plans(t, backend), torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,held", [(12288, True), (24580, False)], ids=["held", "streamed"])
def test_rows_wider_than_one_block(backend, d, held):
    """fp32 rows of several chunks: D = 12288 is held in registers by the Triton forward and
    backward (6 chunks of 2048); D = 24580 is wider than either holds, so both stream it (the
    backward over D-chunk programs)."""
    if backend == "triton":
        from fusedops.backends.triton.engram_gate.tiles import row_layout, tiles_for
        problem = GateProblem(torch.float32, 2, 2, d, EPS, True, False, DEVICE)
        layouts = [row_layout(problem, tiles_for(problem), k) for k in ("fwd", "bwd")]
        assert [lay.held for lay in layouts] == [held, held] and layouts[0].chunks > 1, layouts
    t = make_inputs(2, 2, d, torch.float32, seed=12)
    check_against_oracle(t, run_plans(t, backend), torch.float32)


@pytest.mark.skipif(HAS_CUDA or "cute" not in BACKENDS, reason="runs the CuTe PTX in the emulator")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("s,d,held", [(4, 5120, False), (5, 5120, False), (4, 2048, True)],
                         ids=["production row", "S=5", "x held"])
def test_cute_ptx_of_each_architecture(monkeypatch, arch, s, d, held):
    """The PTX compiled for each target: the production row (4 warps of 5 vectors per thread,
    x re-read for the output), five streams, and a row narrow enough for the forward to hold
    every stream's x in registers (S * vectors per thread <= 8)."""
    from fusedops.backends.cute.engram_gate.tiles import MAX_HELD_VECTORS, row_geometry
    geo = row_geometry(d, torch.bfloat16)
    assert (s * geo.iters <= MAX_HELD_VECTORS) == held, geo
    monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", arch)
    t = make_inputs(3, s, d, torch.bfloat16, seed=13)
    check_against_oracle(t, run_plans(t, "cute"), torch.bfloat16)


@pytest.mark.skipif("cute" not in BACKENDS, reason="the cute backend does not run here")
@pytest.mark.parametrize("d,dtype,warps,vectors", [
    (5120, torch.bfloat16, 4, 5), (12288, torch.bfloat16, 6, 8), (5120, torch.float32, 5, 8),
    (2048, torch.bfloat16, 4, 2), (256, torch.float32, 1, 2), (372, torch.float32, 1, 3)])
def test_cute_row_geometry_divides_the_row(d, dtype, warps, vectors):
    """The CTA covers the row's 16-byte vectors with the least padding (no power of two), at
    most MAX_VECTORS per thread, and, on a tie, in MIN_WARPS warps or more, then the fewest."""
    from fusedops.backends.cute.engram_gate.tiles import MAX_VECTORS, row_geometry
    geo = row_geometry(d, dtype)
    assert (geo.warps, geo.iters) == (warps, vectors) and geo.iters <= MAX_VECTORS


@pytest.mark.skipif("cute" not in BACKENDS, reason="the cute backend does not run here")
def test_cute_backward_rows_too_wide_for_shared_memory():
    """A row whose weight and partial rows do not fit a CTA's shared memory keeps them in
    registers (32 warps of 9 vectors here, the last pass mostly clamped)."""
    from fusedops.backends.cute.engram_gate.tiles import private_rows_shared, row_geometry
    d = 4 * 8193
    geo = row_geometry(d, torch.float32)
    assert (geo.warps, geo.iters) == (32, 9) and not private_rows_shared(geo)
    t = make_inputs(2, 1, d, torch.float32, seed=14)
    check_against_oracle(t, run_plans(t, "cute"), torch.float32)


def _row_geometries(count: int, seed: int = 2026):
    """(n, s, d, dtype) drawn with a fixed seed: row widths that are and are not multiples of
    the CTA's vectors, one to five streams, every dtype."""
    gen = torch.Generator().manual_seed(seed)
    draws = []
    for i in range(count):
        dtype = DTYPES[i % len(DTYPES)]
        vec = 16 // torch.empty((), dtype=dtype).element_size()
        n, s, vectors = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((1, 10), (1, 6), (1, 400)))
        draws.append((n, s, vec * vectors, dtype))
    return draws


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
@pytest.mark.parametrize("n,s,d,dtype", _row_geometries(6), ids=lambda v: str(v).removeprefix("torch."))
def test_drawn_row_geometries(backend, n, s, d, dtype):
    t = make_inputs(n, s, d, dtype, seed=n * s + d)
    check_against_oracle(t, run_plans(t, backend), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [16, 65])
def test_token_counts_across_backward_blocks(backend, n):
    t = make_inputs(n, 2, 64, torch.float32, seed=n)
    check_against_oracle(t, run_plans(t, backend), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bitwise_reproducible(backend):
    t = make_inputs(70, 4, 128, torch.bfloat16, seed=10)
    first, second = run_plans(t, backend), run_plans(t, backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_kernel_specialisation_ignores_token_count():
    """Compile-cache keys hold plan-time values only: a new N reuses the compiled kernels."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.engram_gate import program as kernels
    a = GateProblem(torch.bfloat16, 8, 4, 5120, EPS, True, False, DEVICE)
    b = GateProblem(torch.bfloat16, 8193, 4, 5120, EPS, True, False, DEVICE)
    assert kernels.forward_spec(a) == kernels.forward_spec(b)
    assert kernels.backward_spec(a) == kernels.backward_spec(b)
    assert kernels.reduce_spec(a) == kernels.reduce_spec(b)


# -- 6. GPU checks (production shapes, graphs, no sync, no allocation) -------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("n", [8192, 4099])
def test_gpu_production_shape_bf16(backend, n):
    t = make_inputs(n, 4, 5120, torch.bfloat16, seed=21)
    r = run_plans(t, backend)
    ref = run_plans(t, "torch")
    for name in ("out", "grad_x", "grad_kv"):
        assert_close(r[name], ref[name], torch.bfloat16, name)
    for name in ("saved", "grad_weight"):
        assert_close(r[name], ref[name], FP32_REDUCTION, name)
    sub = {k: (v[:64] if v is not None and v.dim() and v.shape[0] == n else v) for k, v in t.items()}
    check_against_oracle(sub, run_plans(sub, backend), torch.bfloat16)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_offsets_beyond_2_31_elements(backend):
    """kv of N * (S+1) * D > 2^31 elements: the kernels index with 64-bit offsets."""
    s, d = 4, 5120
    n = 2**31 // ((s + 1) * d) + 64
    t = make_inputs(n, s, d, torch.bfloat16, mask="none", seed=24)
    r = run_plans(t, backend)
    tail = {k: (v[-64:] if v is not None and v.dim() and v.shape[0] == n else v) for k, v in t.items()}
    ref_out, ref_saved = fusedops.engram_gate_saved_forward(tail["x"], tail["kv"], tail["weight"], None,
                                                           backend="torch")
    assert_close(r["out"][-64:], ref_out, torch.bfloat16, "out tail")
    assert_close(r["saved"][-64:], ref_saved, FP32_REDUCTION, "saved tail")
    ref_grads = fusedops.engram_gate_saved_backward(tail["x"], tail["kv"], tail["weight"], r["saved"][-64:],
                                                    tail["grad_out"], backend="torch")
    assert_close(r["grad_x"][-64:], ref_grads["grad_x"], torch.bfloat16, "grad_x tail")
    assert_close(r["grad_kv"][-64:], ref_grads["grad_kv"], torch.bfloat16, "grad_kv tail")
    grad_weight = torch.zeros_like(t["weight"])
    for start in range(0, n, 8192):
        part = {k: (v[start:start + 8192] if v is not None and v.dim() and v.shape[0] == n else v)
                for k, v in t.items()}
        grad_weight += fusedops.engram_gate_saved_backward(
            part["x"], part["kv"], part["weight"], r["saved"][start:start + 8192], part["grad_out"],
            backend="torch")["grad_weight"]
    assert_close(r["grad_weight"], grad_weight, FP32_REDUCTION, "grad_weight")


@requires_cuda
@pytest.mark.gpu
def test_gpu_auto_selects_triton():
    """auto takes CuTe only where a GPU benchmark showed it faster (docs/backends.md)."""
    t, fwd, bwd, *_ = _compiled_pair("auto")
    assert fwd.selected_backend == bwd.selected_backend == "triton"


@requires_cuda
@pytest.mark.gpu
@pytest.mark.skipif("cute" not in GPU_BACKENDS, reason="the cute backend does not run on this GPU")
def test_gpu_cute_kernels_agree_with_their_ptx_emulated(monkeypatch):
    """The same PTX on the GPU and in the emulator (tests the emulator the CPU runs rely on):
    equal within one rounding of the outputs (the emulator computes ex2.approx exactly)."""
    from fusedops.backends.cute import compiler
    n, s, d, dtype = 5, 4, 5120, torch.bfloat16
    monkeypatch.setenv("FUSEDOPS_EMULATE", "1")
    monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", compiler.arch_of(DEVICE))
    gpu = run_plans(make_inputs(n, s, d, dtype, seed=21), "cute")
    emulated = run_plans(make_inputs(n, s, d, dtype, seed=21, device=torch.device("cpu")), "cute")
    for name, value in emulated.items():
        tolerance = ROUNDED_ONCE[dtype] if value.dtype == dtype else FP32_REDUCTION
        assert_close(gpu[name].cpu(), value, tolerance, name)
