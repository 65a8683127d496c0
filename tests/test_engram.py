"""Engram saved-state gate (docs/engram_gate.md): reference, kernels, edge cases and GPU checks,
parametrised over the backends this machine can run. The plan contract (execute checks, no torch
op in execute, descs, repr, graph capture) is tested for every plan in test_plan_contract.py."""

from __future__ import annotations

import math

import pytest
import torch

import fusedops
from fusedops import EngramGateSavedBackward, EngramGateSavedForward, TensorDesc
from fusedops.engram_gate import DOT_CLAMP, GateProblem
from fusedops.engram_gate.info import INFO
from fusedops.engram_gate.samples import make
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.opinfo import FP32_REDUCTION, ROUNDED_ONCE, Case
from fusedops.testing import assert_close

from helpers import BACKENDS, DEVICE, GPU_BACKENDS, HAS_CUDA, requires_cuda

EPS = 1e-20


def make_inputs(n, s, d, dtype=torch.float32, *, mask="some", seed=0, device=DEVICE) -> dict:
    """x, kv, weight, mask, grad_out (the family's sample generator), as a mutable dict."""
    return dict(make(n, s, d, dtype, mask=mask, seed=seed, device=device).tensors)


def run_plans(t, backend, eps=EPS, **kwargs):
    """Forward + backward through the plan API with caller-allocated buffers."""
    return INFO.run(Case("", t, dict(eps=eps)), backend, **kwargs)


def check_against_oracle(t, r, dtype, eps=EPS):
    expected = INFO.oracle(Case("", t, dict(eps=eps)))
    for name, value in r.items():
        assert_close(value, expected[name], INFO.tolerance(name, dtype), name)


# -- 1. the reference against independent float64 math -----------------------------------------
@pytest.mark.parametrize("n,s,d", [(1, 1, 8), (7, 4, 16), (5, 3, 40)])
def test_reference_float64_matches_oracle(n, s, d):
    t = make_inputs(n, s, d, torch.float64, device=torch.device("cpu"))
    check_against_oracle(t, run_plans(t, "torch"), torch.float64)

class _GateThroughPlans(torch.autograd.Function):
    """Forward and backward through the public plans (torch backend, float64) for gradcheck."""

    @staticmethod
    def forward(ctx, x, kv, weight, mask):
        out, saved = fusedops.engram_gate_saved_forward(x, kv, weight, mask, backend="torch")
        ctx.save_for_backward(x, kv, weight, saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, kv, weight, saved = ctx.saved_tensors
        grads = fusedops.engram_gate_saved_backward(x, kv, weight, saved, grad_out.contiguous(),
                                                    backend="torch")
        return grads["grad_x"], grads["grad_kv"], grads["grad_weight"], None


@pytest.mark.parametrize("mask", ["none", "some"])
def test_gradcheck_float64(mask):
    t = make_inputs(4, 2, 8, torch.float64, mask=mask, seed=3, device=torch.device("cpu"))
    args = [t["x"].requires_grad_(), t["kv"].requires_grad_(), t["weight"].requires_grad_(), t["mask"]]
    assert torch.autograd.gradcheck(_GateThroughPlans.apply, args, eps=1e-6, atol=1e-8, rtol=1e-6)


# -- 2. every backend against the oracle ---------------------------------------------------------
SHAPES = [(1, 1, 64), (37, 4, 256)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,s,d", SHAPES, ids=lambda v: str(v))
def test_backend_matches_oracle(backend, dtype, n, s, d):
    t = make_inputs(n, s, d, dtype, seed=n + s + d)
    check_against_oracle(t, run_plans(t, backend), dtype)


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


# -- 3. edge cases of the spec -------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's discarded inf*0
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_masked_tokens_output_x_bit_for_bit(backend, dtype):
    t = make_inputs(9, 2, 64, dtype, mask="some", seed=5)
    kv = t["kv"].view(9, 3, 64)
    kv[~t["mask"], 2] = float("inf")  # a masked token's value must not leak, not even as NaN
    r = run_plans(t, backend)
    masked = ~t["mask"]
    assert torch.equal(r["out"][masked], t["x"][masked])
    assert torch.all(r["saved"][masked][..., 0] == 0)
    assert torch.equal(r["grad_x"][masked], t["grad_out"][masked])
    assert torch.all(r["grad_kv"].view(9, 3, 64)[masked, :2] == 0)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the poisoned tokens' statistics
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_masked_tokens_are_isolated_even_when_not_finite(backend, poison):
    """Nothing of a masked token's x or kv reaches an output or a gradient, bit for bit: the
    results equal those of the same tokens holding zeros."""
    t = make_inputs(12, 3, 64, torch.float32, mask="some", seed=31)
    masked, live = ~t["mask"], t["mask"]
    clean = {k: (v.clone() if v is not None else None) for k, v in t.items()}
    clean["x"][masked] = 0
    clean["kv"][masked] = 0
    t["x"][masked] = poison
    t["kv"][masked] = poison
    r, ref = run_plans(t, backend), run_plans(clean, backend)
    assert torch.equal(r["out"][masked].view(torch.int32), t["x"][masked].view(torch.int32))
    assert torch.equal(r["grad_x"][masked], t["grad_out"][masked])
    assert torch.all(r["grad_kv"].view(12, 4, 64)[masked, :3] == 0)
    assert torch.all(r["saved"][masked][..., 0] == 0)
    assert torch.equal(r["grad_weight"], ref["grad_weight"])
    for name in ("out", "grad_x", "grad_kv", "saved"):
        assert torch.equal(r[name][live], ref[name][live]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked(backend):
    t = make_inputs(5, 4, 64, torch.bfloat16, mask="nothing", seed=6)
    r = run_plans(t, backend)
    assert torch.equal(r["out"], t["x"])
    assert torch.equal(r["grad_x"], t["grad_out"])
    assert torch.all(r["grad_kv"] == 0) and torch.all(r["grad_weight"] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_zero_rows_stay_finite(backend):
    t = make_inputs(4, 2, 64, torch.float32, mask="none", seed=7)
    t["x"][1] = 0          # rstd_x = 1/sqrt(eps) = 1e10
    t["kv"][2, :64] = 0    # a zero key
    t["kv"][3] = 0         # zero keys and value
    r = run_plans(t, backend)
    for name, value in r.items():
        assert torch.isfinite(value).all(), name
    assert r["saved"][1, 0, 2].item() == pytest.approx(1e10, rel=1e-6)
    check_against_oracle(t, r, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-4, 1e4])
def test_scaled_rows(backend, scale):
    t = make_inputs(6, 2, 128, torch.bfloat16, seed=8)
    t["x"][::2] *= scale
    t["kv"][1::2] *= scale
    check_against_oracle(t, run_plans(t, backend), torch.bfloat16)


def _point_inputs(d, dot_target, sign=1.0):
    """x = e0, key = e0 and weight = c*e0 give dot = c*sqrt(D) (up to rounding)."""
    x = torch.zeros(1, 1, d)
    kv = torch.zeros(1, 2 * d)
    weight = torch.ones(1, d)
    x[0, 0, 0] = 1.0
    kv[0, 0] = sign
    kv[0, d:] = 1.0
    weight[0, 0] = dot_target / math.sqrt(d)
    return dict(x=x.to(DEVICE), kv=kv.to(DEVICE), weight=weight.to(DEVICE), mask=None,
                grad_out=torch.ones(1, 1, d, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target,sign", [(0.0, 1.0), (1e-7, 1.0), (1e-7, -1.0), (4e-6, 1.0)])
def test_signed_sqrt_clamp_forward(backend, target, sign):
    r = run_plans(_point_inputs(64, target, sign), backend)
    gate, dot = r["saved"][0, 0, 0].item(), r["saved"][0, 0, 1].item()
    if target == 0.0:
        assert dot == 0.0 and gate == 0.5          # sign(0) = 0
    elif abs(dot) < DOT_CLAMP:
        assert gate == pytest.approx(1 / (1 + math.exp(-math.copysign(1e-3, dot))), rel=1e-6)
    else:
        assert gate == pytest.approx(1 / (1 + math.exp(-math.copysign(math.sqrt(abs(dot)), dot))),
                                     rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_signed_sqrt_clamp_backward_boundary(backend):
    """ddot is 0 just below the clamp and passes at it and above (torch.clamp_min's rule)."""
    d = 64
    t = make_inputs(5, 1, d, torch.float32, mask="none", seed=9)
    clamp = torch.tensor(DOT_CLAMP, dtype=torch.float32)
    below = torch.nextafter(clamp, torch.tensor(0.0)).item()
    above = torch.nextafter(clamp, torch.tensor(1.0)).item()
    dots = torch.tensor([below, DOT_CLAMP, above, -DOT_CLAMP, -below])
    saved = torch.stack((torch.full((5,), 0.3), dots, torch.full((5,), 2.0), torch.full((5,), 0.5)),
                        -1).view(5, 1, 4).to(DEVICE)
    bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], saved, t["grad_out"],
                                  backend=backend).compile()
    gx, gkv, gw = torch.empty_like(t["x"]), torch.empty_like(t["kv"]), torch.empty_like(t["weight"])
    bwd.execute(t["x"], t["kv"], t["weight"], saved, t["grad_out"], gx, gkv, gw, bwd.allocate_workspace())
    live = (gx - t["grad_out"]).abs().amax(-1).flatten() > 0
    assert live.tolist() == [False, True, True, True, False]
    v = t["kv"][:, d:].double()
    dgate = (t["grad_out"][:, 0].double() * v).sum(-1)
    for i in (1, 2, 3):
        ddot = dgate[i] * 0.3 * 0.7 * 0.5 / math.sqrt(abs(dots[i].item()))
        coef = ddot * 2.0 * 0.5 / math.sqrt(d)
        expected = (t["grad_out"][i, 0].double() + coef * t["weight"][0].double() * t["kv"][i, :d].double()
                    - ddot * dots[i].item() * 4.0 / d * t["x"][i, 0].double())
        assert_close(gx[i, 0], expected, torch.float32, f"grad_x at dot={dots[i].item():.9g}")


# -- 4. validation errors ------------------------------------------------------------------------
def _fwd_args(**overrides):
    t = make_inputs(8, 4, 64, torch.bfloat16, seed=1)
    args = dict(x=t["x"], kv=t["kv"], weight=t["weight"], mask=t["mask"])
    args.update(overrides)
    return args


def _aligned_offset_view(like: torch.Tensor, offset_elems: int) -> torch.Tensor:
    buffer = torch.empty(like.numel() + offset_elems, dtype=like.dtype, device=like.device)
    return buffer[offset_elems:].view(like.shape)


@pytest.mark.parametrize("overrides,match", [
    (dict(x=torch.zeros(8, 4, 64, dtype=torch.int32)), r"x: expected dtype bfloat16.*got int32"),
    (dict(kv=torch.zeros(8, 320, dtype=torch.float16)), r"kv: expected dtype bfloat16, got float16"),
    (dict(weight=torch.zeros(4, 64, dtype=torch.bfloat16)), r"weight: expected dtype float32"),
    (dict(mask=torch.ones(8, dtype=torch.uint8)), r"mask: expected dtype bool, got uint8"),
    (dict(x=torch.zeros(8, 256, dtype=torch.bfloat16)), r"x: expected a 3-d tensor \[N, S, D\]"),
    (dict(kv=torch.zeros(8, 256, dtype=torch.bfloat16)), r"kv: expected shape \[N, \(S\+1\)\*D\] = \[8, 320\], got \[8, 256\]"),
    (dict(weight=torch.zeros(4, 32)), r"weight: expected shape \[S, D\] = \[4, 64\]"),
    (dict(mask=torch.ones(7, dtype=torch.bool)), r"mask: expected shape \[N\] = \[8\], got \[7\]"),
    (dict(x=torch.zeros(0, 4, 64, dtype=torch.bfloat16), kv=torch.zeros(0, 320, dtype=torch.bfloat16),
          mask=None), r"x: expected N, S and D >= 1"),
    (dict(x=torch.zeros(8, 4, 4, dtype=torch.bfloat16), kv=torch.zeros(8, 20, dtype=torch.bfloat16),
          weight=torch.zeros(4, 4)), r"x: expected rows of a multiple of 16 bytes.*D = 4"),
    (dict(x=torch.zeros(8, 64, 4, dtype=torch.bfloat16).transpose(1, 2)), r"x: expected the last dimension contiguous"),
    (dict(kv=torch.zeros(8, 640, dtype=torch.bfloat16)[:, ::2]), r"kv: expected the last dimension contiguous"),
    (dict(x=_aligned_offset_view(torch.zeros(8, 4, 64, dtype=torch.bfloat16), 1)),
     r"x: expected a data pointer aligned to 16 bytes"),
    (dict(kv=TensorDesc((8, 320), torch.bfloat16, device="meta")), r"kv: expected device cpu"),
    (dict(x=[1, 2]), r"x: expected a torch.Tensor or fusedops.TensorDesc, got list"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_forward_construction_errors(overrides, match):
    args = _fwd_args(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in overrides.items()})
    with pytest.raises(ValidationError, match=match.replace("cpu", str(DEVICE))):
        EngramGateSavedForward(**args, backend="torch")


@pytest.mark.parametrize("eps", [float("nan"), 0.0, -1e-6, float("inf"), 1e-45, "tiny"])
def test_eps_must_be_finite_positive_normal_fp32(eps):
    with pytest.raises(ValidationError, match=r"eps: expected a finite float"):
        EngramGateSavedForward(**_fwd_args(), eps=eps)


def test_backend_errors(monkeypatch):
    with pytest.raises(ValidationError, match=r"backend: expected one of auto, torch, triton, cute, got 'cudnn'"):
        EngramGateSavedForward(**_fwd_args(), backend="cudnn")
    if not HAS_CUDA:
        monkeypatch.setenv("FUSEDOPS_EMULATE", "0")
        with pytest.raises(UnsupportedError, match=r"cute: (CuTe DSL kernels run on CUDA devices, not on cpu; "
                                                   r"on cpu only under the PTX emulator \(FUSEDOPS_EMULATE=1\)"
                                                   r"|nvidia-cutlass-dsl is not installed)"):
            EngramGateSavedForward(**_fwd_args(), backend="cute")
        monkeypatch.setenv("FUSEDOPS_EMULATE", "1")
        monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", "sm_80")
        with pytest.raises(UnsupportedError, match=r"the cute kernels are built for sm_90a and sm_100a; the "
                                                   r"emulated target is sm_80|nvidia-cutlass-dsl is not installed"):
            EngramGateSavedForward(**_fwd_args(), backend="cute")
        monkeypatch.delenv("FUSEDOPS_TARGET_ARCH")
    t = make_inputs(2, 1, 8, torch.float64)
    with pytest.raises(UnsupportedError, match=r"triton: the Triton gate kernels take bf16/fp16/fp32"):
        EngramGateSavedForward(t["x"], t["kv"], t["weight"], None, backend="triton")
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setenv("FUSEDOPS_EMULATE", "0")
        with pytest.raises(UnsupportedError, match=r"Triton kernels run on CUDA devices; on cpu only "
                                                   r"under the Triton interpreter .* or the PTX "
                                                   r"emulator \(FUSEDOPS_EMULATE=1\)"):
            EngramGateSavedForward(**_fwd_args(), backend="triton")
        assert EngramGateSavedForward(**_fwd_args()).selected_backend == "torch"


def test_cuda_declaration_without_cuda():
    if HAS_CUDA:
        pytest.skip("CUDA is available here")
    with pytest.raises(UnsupportedError, match=r"x: declared on cuda, but CUDA is not available"):
        EngramGateSavedForward(TensorDesc((8, 4, 64), torch.bfloat16), TensorDesc((8, 320), torch.bfloat16),
                               TensorDesc((4, 64), torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bitwise_reproducible(backend):
    t = make_inputs(70, 4, 128, torch.bfloat16, seed=10)
    first, second = run_plans(t, backend), run_plans(t, backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_adds_into_grad_weight(backend):
    t = make_inputs(19, 2, 64, torch.float32, seed=13)
    base = run_plans(t, backend)
    start = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    acc = run_plans(t, backend, accumulate=True, grad_weight=start.clone())
    assert_close(acc["grad_weight"], start + base["grad_weight"], torch.float32, "accumulated grad_weight")
    assert torch.equal(acc["grad_x"], base["grad_x"])


def test_kernel_specialisation_ignores_token_count():
    """Compile-cache keys hold plan-time values only: a new N reuses the compiled kernels."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.engram_gate import program as kernels
    a = GateProblem(torch.bfloat16, 8, 4, 5120, EPS, True, False, DEVICE)
    b = GateProblem(torch.bfloat16, 8193, 4, 5120, EPS, True, False, DEVICE)
    assert kernels.forward_spec(a) == kernels.forward_spec(b)
    assert kernels.backward_spec(a) == kernels.backward_spec(b)
    assert kernels.reduce_spec(a) == kernels.reduce_spec(b)


def test_workspace_formula():
    """Backward workspace = 4 * S * D * blocks bytes, blocks = ceil(N / tokens_per_block) with
    at least 4 tokens per block and at most 640 // ((S + 1) * chunks) blocks."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.engram_gate.program import backward_workspace
    from fusedops.backends.triton.engram_gate.tiles import backward_blocks
    for n, expected_blocks in ((1, 1), (64, 16), (512, 128), (8192, 128), (100_000, 128)):
        problem = GateProblem(torch.bfloat16, n, 4, 5120, EPS, False, False, DEVICE)
        per_block, blocks = backward_blocks(problem)
        assert blocks == expected_blocks == math.ceil(n / per_block) and per_block >= 4
        assert backward_workspace(problem).size == 4 * 4 * 5120 * blocks
    if "triton" in BACKENDS:
        t = make_inputs(64, 4, 64, torch.bfloat16)
        bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], torch.empty(64, 4, 4, device=DEVICE),
                                      t["grad_out"], backend="triton")
        assert bwd.workspace_size == 4 * 4 * 64 * 16 == bwd.allocate_workspace().numel()


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


def _compiled_pair(backend="torch", n=8):
    t = make_inputs(n, 4, 64, torch.bfloat16, seed=2)
    fwd = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"], backend=backend).compile()
    out, saved = fwd.allocate_outputs().values()
    bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], saved, t["grad_out"], backend=backend).compile()
    grads = dict(bwd.allocate_outputs(), workspace=bwd.allocate_workspace())
    return t, fwd, bwd, out, saved, grads


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_execute_does_not_sync_or_allocate(backend):
    t, fwd, bwd, out, saved, g = _compiled_pair(backend, n=2048)
    args_f = (t["x"], t["kv"], t["weight"], t["mask"], out, saved)
    args_b = (t["x"], t["kv"], t["weight"], saved, t["grad_out"], g["grad_x"], g["grad_kv"], g["grad_weight"], g["workspace"])
    fwd.execute(*args_f)
    bwd.execute(*args_b)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fwd.execute(*args_f)
            bwd.execute(*args_b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "allocated_bytes.all.allocated", "segment.all.allocated"):
        assert after.get(key, 0) == before.get(key, 0), key


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_new_token_count_reuses_compiled_kernels(backend):
    _compiled_pair(backend, n=512)
    misses = fusedops.cache_info().misses
    _compiled_pair(backend, n=777)
    assert fusedops.cache_info().misses == misses


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


def _in_wider(t: torch.Tensor, pad: int, fill=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): ``t`` as a view of the first columns of a buffer ``pad`` columns wider."""
    buffer = torch.full((*t.shape[:-1], t.shape[-1] + pad), fill, dtype=t.dtype, device=t.device)
    view = buffer[..., :t.shape[-1]]
    view.copy_(t)
    return buffer, view


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_go_in_and_out_without_copies(backend):
    """x, kv and grad_out as views of wider buffers, out, grad_x and grad_kv written straight
    into views of wider buffers: the same bits as contiguous tensors, nothing written beside."""
    t = make_inputs(11, 3, 64, torch.bfloat16, seed=17)
    reference = run_plans(t, backend)
    _, x = _in_wider(t["x"], 16)
    _, kv = _in_wider(t["kv"], 8)
    _, g = _in_wider(t["grad_out"], 24)
    fwd = EngramGateSavedForward(x, kv, t["weight"], t["mask"], backend=backend).compile()
    out_buffer, out = _in_wider(torch.empty_like(t["x"]), 8, float("nan"))
    saved = torch.empty(11, 3, 4, device=DEVICE)
    fwd.execute(x, kv, t["weight"], t["mask"], out, saved)
    bwd = EngramGateSavedBackward(x, kv, t["weight"], saved, g, backend=backend).compile()
    gx_buffer, gx = _in_wider(torch.empty_like(t["x"]), 16, float("nan"))
    gkv_buffer, gkv = _in_wider(torch.empty_like(t["kv"]), 8, float("nan"))
    gw = torch.empty_like(t["weight"])
    bwd.execute(x, kv, t["weight"], saved, g, gx, gkv, gw, bwd.allocate_workspace())
    for name, value in dict(out=out, saved=saved, grad_x=gx, grad_kv=gkv, grad_weight=gw).items():
        assert torch.equal(value, reference[name]), name
    for buffer, width in ((out_buffer, 64), (gx_buffer, 64), (gkv_buffer, 256)):
        assert torch.isnan(buffer[..., width:].float()).all()


def test_strides_must_keep_rows_aligned():
    t = make_inputs(4, 2, 64, torch.bfloat16)
    x = torch.zeros(4, 2, 67, dtype=torch.bfloat16)[..., :64]        # rows 134 bytes apart
    with pytest.raises(ValidationError, match=r"x: expected strides of multiples of 16 bytes"):
        EngramGateSavedForward(x, t["kv"], t["weight"], t["mask"])
    with pytest.raises(ValidationError, match=r"x: expected the last dimension contiguous"):
        EngramGateSavedForward(torch.zeros(4, 64, 2, dtype=torch.bfloat16).transpose(1, 2),
                               t["kv"], t["weight"], t["mask"])
    plan = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"]).compile()
    out = torch.zeros(4, 2, 67, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValidationError, match=r"out: expected the last dimension contiguous and the other strides multiples of 16 bytes"):
        plan.execute(t["x"], t["kv"], t["weight"], t["mask"], out, torch.empty(4, 2, 4))
