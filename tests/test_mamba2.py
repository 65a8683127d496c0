"""Mamba2 chunked scan (docs/mamba2_scan.md): the reference against the float64 recurrence, gradcheck
and transformers; every backend against the reference and the oracle; conventions at the kinks;
validation; GPU checks. The plan contract (execute checks, no torch op in execute, descs, repr,
graph capture) is tested for every plan in test_plan_contract.py."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedops
import fusedops.ops
from fusedops import Mamba2ChunkScanBackward, Mamba2ChunkScanForward, TensorDesc
from fusedops.core.status import Status
from fusedops.errors import ValidationError
from fusedops.plan import EAGER_PLANS
from fusedops.mamba2_scan import samples
from fusedops.mamba2_scan.info import INFO
from fusedops.mamba2_scan.oracle import mamba2_sequential, scan_with_gradients
from fusedops.opinfo import Case, Tolerance
from fusedops.testing import assert_close

from helpers import BACKENDS, DEVICE, GPU_BACKENDS, KERNEL_BACKENDS, dtype_id, requires_cuda

SCAN_BACKENDS = [b for b in BACKENDS if b in Mamba2ChunkScanForward.backends]
SCAN_KERNEL_BACKENDS = [b for b in KERNEL_BACKENDS if b in Mamba2ChunkScanForward.backends]
CPU = torch.device("cpu")
GRADS = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dinitial_states")
FLOAT64 = INFO.tolerance("y", torch.float64)

# Kernel backends against the fp32 torch reference. The Triton kernels, like mamba_ssm's, round
# the operands of their tensor-core products to the input dtype (decay-weighted C·B, dt-scaled B,
# the fp32 states), so their error is a few units of that dtype's rounding, not one.
KERNEL_TOLERANCE = {
    torch.float32: Tolerance(2e-5, 2e-4, "fp32 products, sums in another order"),
    torch.float16: Tolerance(3e-3, 2e-2, "fp16 operands of the tensor-core products"),
    torch.bfloat16: Tolerance(2.5e-2, 1e-1, "bf16 operands of the tensor-core products"),
}


def with_options(case: Case, **options) -> Case:
    return Case(case.label, case.tensors, {**case.options, **options})


def run(case: Case, backend: str, **kwargs) -> dict:
    """Forward and backward through the plans with caller buffers (the family's runner)."""
    return INFO.run(case, backend, **kwargs)


def compare(result, expected, tolerance, names=None):
    for name in names or expected:
        if name in result:
            assert_close(result[name], expected[name], tolerance, name)


# -- 1. the reference against independent float64 math ------------------------------------------
@pytest.mark.parametrize("name", list(samples.SMALL))
def test_reference_matches_float64_recurrence(name):
    case = samples.small(name, torch.float64, seed=1, device=CPU)
    compare(run(case, "torch"), INFO.oracle(case), FLOAT64)


def test_reference_dt_limit_and_softplus_threshold():
    """dt + bias exactly at 20 (softplus' derivative sigmoid) and above (1), and dt at the clamp
    bounds exactly (the gradient passes) and outside (it does not)."""
    case = samples.make(1, 12, 2, 4, 1, 4, torch.float64, seed=2, device=CPU, dt_bias=True)
    t = case.tensors
    t["dt"][0, :4, 0] = torch.tensor([20.0, 20.5, 19.5, 25.0], dtype=torch.float64) - t["dt_bias"][0]
    compare(run(case, "torch"), INFO.oracle(case), FLOAT64)
    case = samples.make(1, 12, 2, 4, 1, 4, torch.float64, seed=3, device=CPU, dt_softplus=False,
                        dt_limit=(0.25, 1.5))
    case.tensors["dt"][0, :6, 0] = torch.tensor([0.25, 1.5, 0.2, 1.6, 0.25, 1.0], dtype=torch.float64)
    r = run(case, "torch")
    compare(r, INFO.oracle(case), FLOAT64)
    assert [bool(v != 0) for v in r["ddt"][0, :4, 0]] == [True, True, False, False]


class _ScanThroughPlans(torch.autograd.Function):
    """y and final_states through the public plans (torch backend, float64), for gradcheck."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, h0, cu_seqlens):
        opts = dict(D=D, z=z, dt_bias=dt_bias, initial_states=h0, cu_seqlens=cu_seqlens)
        y, final, saved = fusedops.mamba2_chunk_scan_forward(x, dt, A, B, C, 16, dt_softplus=True,
                                                             backend="torch", **opts)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, h0, cu_seqlens, saved)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, h0, cu, saved = ctx.saved_tensors
        g = fusedops.mamba2_chunk_scan_backward(x, dt, A, B, C, dy.contiguous(), saved, 16,
                                                dt_softplus=True, D=D, z=z, dt_bias=dt_bias,
                                                initial_states=h0, cu_seqlens=cu,
                                                dfinal_states=dfinal.contiguous(), backend="torch")
        return tuple(g[k] for k in GRADS) + (None,)


@pytest.mark.parametrize("lengths", [None, [3, 0, 6]])
def test_gradcheck_float64(lengths):
    l = 9 if lengths else 7
    t = samples.make(1, l, 2, 2, 1, 3, torch.float64, seed=4, device=CPU, D="h", z=True,
                     dt_bias=True, initial_states=True, lengths=lengths).tensors
    args = [t[k].requires_grad_() for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                             "initial_states")]
    assert torch.autograd.gradcheck(_ScanThroughPlans.apply, args + [t["cu_seqlens"]], eps=1e-6,
                                    atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_matches_transformers_mamba2_chunk_scan(backend):
    """transformers' pure-torch NemotronH scan (fp32), forward and through autograd backward."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    case = samples.make(2, 45, 4, 8, 2, 16, torch.float32, seed=5, device=DEVICE, D="h",
                        dt_bias=True, initial_states=True, dfinal=True)
    t = case.tensors
    names = dict(x="dx", dt="ddt", A="dA", B="dB", C="dC", D="dD", dt_bias="ddt_bias",
                 initial_states="dinitial_states")
    leaves = {k: t[k].detach().clone().requires_grad_() for k in names}
    y, final = modeling.mamba2_chunk_scan(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], 16, D=leaves["D"],
        dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"], dt_softplus=True,
        return_final_states=True)
    grads = torch.autograd.grad((y * t["dy"]).sum() + (final * t["dfinal_states"]).sum(),
                                list(leaves.values()))
    expected = dict(y=y, final_states=final, **{names[k]: g for k, g in zip(leaves, grads)})
    compare(run(case, backend), expected, KERNEL_TOLERANCE[torch.float32])


# -- 2. every backend against the reference and the oracle ---------------------------------------
KERNEL_CASES = [
    ("all-options", torch.float32, {}), ("varlen", torch.float32, {}),
    ("plain", torch.float32, dict(dt_limit=(0.5, 1.5))), ("D-per-channel", torch.float32, {}),
    ("multi-tile", torch.float32, {}), ("odd-dims", torch.float32, {}),
    ("all-options", torch.float16, {}), ("all-options", torch.bfloat16, {}),
    ("varlen", torch.float32, dict(recompute_states=True)),
]


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
@pytest.mark.parametrize("name,dtype,options", KERNEL_CASES,
                         ids=[f"{n}-{dtype_id(d)}{'-' + '-'.join(o) if o else ''}"
                              for n, d, o in KERNEL_CASES])
def test_kernels_match_reference(backend, name, dtype, options):
    case = samples.small(name, dtype, seed=6, device=DEVICE, **options)
    expected = run(with_options(case, recompute_states=False), "torch")
    compare(run(case, backend), expected, KERNEL_TOLERANCE[dtype])


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("index", range(len(samples.EDGE)),
                         ids=["one-token", "one-chunk", "chunk-plus-one", "empty-sequences",
                              "heads-equal-groups-recompute"])
def test_edge_cases_match_oracle(backend, dtype, index):
    case = INFO.cases("edge", dtype=dtype, device=DEVICE)[index]
    compare(run(case, backend), INFO.oracle(case), INFO.tolerance("y", dtype))


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
def test_kernels_at_dt_limits_and_softplus_threshold(backend):
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=7, device=DEVICE,
                        dt_softplus=False, dt_limit=(0.25, 1.5))
    case.tensors["dt"][0, :6, 0] = torch.tensor([0.25, 1.5, 0.2, 1.6, 0.25, 1.0])
    result = run(case, backend)
    compare(result, run(case, "torch"), KERNEL_TOLERANCE[torch.float32])
    assert [bool(v != 0) for v in result["ddt"][0, :4, 0]] == [True, True, False, False]
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=8, device=DEVICE)
    case.tensors["dt"][0, :4, 1] = torch.tensor([20.0, 20.5, 19.5, -30.0])
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_four_row_blocks_per_segment_match_reference(backend, packed):
    """Chunk 256 (four 64-row blocks per segment) with steps of ~0.01, so the decay over a whole
    segment stays near 1: the decay gradient's straddling pairs across every pair of row blocks
    (the d(C·B) kernel's whole-tile sums for the blocks between) count in ddt and dA."""
    case = samples.make(1, 300, 2, 8, 1, 8, torch.float32, seed=12, device=DEVICE, D="h",
                        initial_states=True, dfinal=True, chunk=256, dt_softplus=False,
                        lengths=[270, 30] if packed else None)
    case.tensors["dt"] = 0.02 * torch.rand(1, 300, 2, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_positive_log_decay_stays_finite(backend):
    """dt·A > 0 (negative dt through dt_limit) grows the state; exponents of decay differences
    are clamped to <= 0, so nothing overflows, and the backends agree."""
    case = samples.make(1, 64, 2, 8, 1, 8, torch.float32, seed=9, device=DEVICE,
                        initial_states=True, dt_softplus=False, dt_limit=(-30.0, 30.0))
    case.tensors["dt"] = (-20.0 * torch.rand(1, 64, 2, generator=torch.Generator().manual_seed(9))).to(DEVICE)
    result = run(case, backend)
    for name, value in result.items():
        assert torch.isfinite(value).all(), name
    if backend != "torch":
        compare(result, run(case, "torch"), KERNEL_TOLERANCE[torch.float32], ("y", "final_states"))


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_backward_bitwise_reproducible(backend):
    case = samples.small("varlen", torch.float32, seed=10, device=DEVICE)
    first, second = run(case, backend), run(case, backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_accumulate_adds_parameter_gradients(backend):
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=11, device=DEVICE, D="hp",
                        dt_bias=True)
    base = run(case, backend)
    ones = {k: torch.ones_like(base[k]) for k in ("dA", "dD", "ddt_bias")}
    accumulated = run(case, backend, accumulate=True, grads=ones)
    for k in ("dA", "dD", "ddt_bias"):
        assert_close(accumulated[k], base[k] + 1, KERNEL_TOLERANCE[torch.float32], k)
    assert torch.equal(accumulated["dx"], base["dx"])


def test_oracle_names_every_result():
    case = samples.small("varlen", torch.float64, device=CPU)
    assert set(run(case, "torch")) == set(INFO.oracle(case))
    assert set(scan_with_gradients(case.tensors)) >= {"y", "final_states", *GRADS}


# -- 3. validation --------------------------------------------------------------------------------
def _base_inputs(**kw):
    t = samples.make(2, 20, 4, 8, 2, 8, torch.bfloat16, seed=12, device=DEVICE, **kw).tensors
    return {k: t[k] for k in ("x", "dt", "A", "B", "C")}, t


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(2, 20, 32, dtype=torch.bfloat16)), r"x: expected a 4-d tensor \[b, l, h, p\]"),
    (dict(dt=torch.zeros(2, 20, 4, dtype=torch.float16)), r"dt: expected dtype bfloat16 or float32, got float16"),
    (dict(A=torch.zeros(4, dtype=torch.bfloat16)), r"A: expected dtype float32, got bfloat16"),
    (dict(B=torch.zeros(2, 20, 3, 8, dtype=torch.bfloat16)), r"B: expected shape \[b, l, g, n\] with .* g >= 1 dividing h = 4"),
    (dict(C=torch.zeros(2, 20, 2, 4, dtype=torch.bfloat16)), r"C: expected shape \[b, l, g, n\] like B = \[2, 20, 2, 8\]"),
    (dict(chunk_size=48), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got 48"),
    (dict(chunk_size=64.0), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got 64.0"),
    (dict(chunk_size=True), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got True"),
    (dict(D=torch.zeros(3)), r"D: expected shape \[h\] = \[4\] or \[h, p\] = \[4, 8\], got \[3\]"),
    (dict(initial_states=torch.zeros(3, 4, 8, 8)), r"initial_states: expected shape \[b, h, p, n\] = \[2, 4, 8, 8\]"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), r"x: expected b == 1 with cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int64)), r"cu_seqlens: expected dtype int32, got int64"),
    (dict(dt_limit=(1.0, 0.5)), r"dt_limit: expected lo <= hi"),
    (dict(dt_softplus=1), r"dt_softplus: expected a bool, got 1"),
    (dict(x=torch.zeros(2, 20, 8, 4, dtype=torch.bfloat16).transpose(2, 3)), r"x: expected the last dimension contiguous"),
    (dict(seq_idx=torch.zeros(2, 20, dtype=torch.int64)), r"^seq_idx: expected dtype int32, got int64"),
    (dict(seq_idx=torch.zeros(2, 21, dtype=torch.int32)), r"^seq_idx: expected shape \[b, l\] like x's first two dims = \[2, 20\]"),
])
def test_construction_errors(change, match):
    core, _ = _base_inputs()
    args = dict(core, chunk_size=16)
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    with pytest.raises(ValidationError, match=match):
        Mamba2ChunkScanForward(**args, backend="torch")


def test_execute_errors_and_properties():
    core, t = _base_inputs(z=True)
    fwd = Mamba2ChunkScanForward(**core, chunk_size=16, z=t["z"], backend="torch").compile()
    y = torch.empty_like(t["x"])
    fin = torch.empty(2, 4, 8, 8, device=DEVICE)
    with pytest.raises(ValidationError, match=r"z: expected a torch.Tensor, got NoneType"):
        fwd.execute(*core.values(), y, fin, fwd.allocate_saved())
    with pytest.raises(ValidationError, match=r"D: this plan was built without D"):
        fwd.execute(*core.values(), y, fin, fwd.allocate_saved(), z=t["z"], D=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValidationError, match=r"y: must not overlap x"):
        fwd.execute(*core.values(), t["x"], fin, fwd.allocate_saved(), z=t["z"])
    assert fwd.problem.max_segments == 4 and fwd.problem.states_bytes == 4 * 4 * 8 * 8 * 2   # bf16
    assert fwd.saved_size == 0 and fwd.saved_states_bytes == fwd.problem.states_bytes


def _descs(b, l, h, p, g, n, *, nseq=None, z=True, dtype=torch.bfloat16):
    d = lambda *shape, dt=dtype: TensorDesc(shape, dt, device="cpu")  # noqa: E731
    return dict(x=d(b, l, h, p), dt=d(b, l, h), A=d(h, dt=torch.float32), B=d(b, l, g, n),
                C=d(b, l, g, n), D=d(h, dt=torch.float32), z=d(b, l, h, p) if z else None,
                dt_bias=d(h, dt=torch.float32),
                cu_seqlens=None if nseq is None else d(nseq + 1, dt=torch.int32))


def test_saved_and_workspace_formulas():
    """The Triton program's saved buffer: the segment-start states in state_dtype (unless
    recomputed) and y before the gate; the forward and backward declare the same layout; the
    backward's dH1 workspace is in the input dtype."""
    pytest.importorskip("triton")
    descs = _descs(2, 8192, 128, 64, 8, 128)
    fwd = Mamba2ChunkScanForward(**descs, chunk_size=256, dt_softplus=True, backend="torch")
    p = fwd.problem
    assert p.max_segments == 64 and p.states_bytes == 64 * 128 * 64 * 128 * 2     # bf16 states
    triton_fwd = fwd.kernel_program("triton")
    assert triton_fwd.saved.size == p.states_bytes + 2 * 8192 * 128 * 64 * 2
    bwd = Mamba2ChunkScanBackward(**descs, dy=descs["x"], chunk_size=256, dt_softplus=True,
                                  backend="torch")
    assert bwd.kernel_program("triton").saved.size == triton_fwd.saved.size
    _, dstates_dtype, dstates_numel = bwd.kernel_program("triton").workspace.offsets["dstates"]
    assert (dstates_dtype, dstates_numel) == (torch.bfloat16, 64 * 128 * 64 * 128)   # dH1, bf16
    fp32_descs = _descs(2, 8192, 128, 64, 8, 128, dtype=torch.float32)
    fp32_bwd = Mamba2ChunkScanBackward(**fp32_descs, dy=fp32_descs["x"], chunk_size=256,
                                       backend="torch")
    assert fp32_bwd.kernel_program("triton").workspace.offsets["dstates"][1] == torch.float32
    recompute = Mamba2ChunkScanForward(**descs, chunk_size=256, recompute_states=True, backend="torch")
    assert recompute.kernel_program("triton").saved.size == 2 * 8192 * 128 * 64 * 2
    assert recompute.saved_states_bytes == 0
    fp32 = Mamba2ChunkScanForward(**descs, chunk_size=256, state_dtype=torch.float32, backend="torch")
    assert fp32.kernel_program("triton").saved.size == 2 * p.states_bytes + 2 * 8192 * 128 * 64 * 2
    varlen = Mamba2ChunkScanForward(**_descs(1, 8192, 128, 64, 8, 128, nseq=10), chunk_size=256,
                                    backend="torch")
    assert varlen.problem.max_segments == 32 + 10


def test_triton_programs_compile_absent_operands_out():
    """Without D, z, dt_bias, initial states or packed sequences no kernel takes a pointer for
    them (they are constexpr None, never another tensor)."""
    pytest.importorskip("triton")
    descs = _descs(1, 64, 4, 16, 2, 16, z=False)
    descs.update(D=None, dt_bias=None)
    plans = (Mamba2ChunkScanForward(**descs, chunk_size=32, backend="torch"),
             Mamba2ChunkScanBackward(**descs, dy=descs["x"], chunk_size=32, backend="torch"))
    optional = {"D_ptr", "z_ptr", "bias_ptr", "h0_ptr", "cu_ptr", "off_ptr", "ypre_ptr",
                "dfinal_ptr", "dh0_ptr", "dD_part_ptr", "dbias_part_ptr", "dbias_ptr", "dD_ptr",
                "cu_out_ptr", "status_ptr", "runs_ptr", "entering_ptr", "seq_idx_ptr",
                "dypre_ptr", "dz_ptr"}
    for plan in plans:
        program = plan.kernel_program("triton")
        for kernel in program.kernels:
            assert not optional & set(kernel.runtime_arg_names()), kernel.name
        assert not any(k.constexpr("GATE") for k in program.kernels
                       if k.name == "ssd_chunk_states_bwd_kernel")


# -- 4. index data: sanitised offsets, the status word, host checks, option types -----------------
def sanitised(cu: list[int], total: int) -> list[int]:
    """docs/plans.md: c'[0] = clamp(c[0], 0, total), c'[i] = clamp(c[i], c'[i-1], total)."""
    out = [min(max(cu[0], 0), total)]
    for value in cu[1:]:
        out.append(min(max(value, out[-1]), total))
    return out


INVALID_CU = {
    "start-not-0": [3, 5, 5, 21, 22, 41],
    "decreasing": [0, 5, 30, 21, 22, 41],
    "past-tokens": [0, 5, 16, 21, 22, 100],
    "negative-and-short": [-4, 5, 2, 21, 22, 30],
    "extreme": [-2**31, 9, 9, 20, 2**31 - 1, 0],
}


def _scan_with_status(case: Case, backend: str, status_value: int = 0):
    """Forward and backward through the eager wrappers with a status word each; returns
    (results by name, forward status, backward status)."""
    t = case.tensors
    fwd_tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", *samples.OPTIONAL)}
    fwd_status = torch.full((1,), status_value, dtype=torch.int32, device=DEVICE)
    bwd_status = torch.full((1,), status_value, dtype=torch.int32, device=DEVICE)
    y, final, saved = fusedops.mamba2_chunk_scan_forward(**fwd_tensors, **case.options,
                                                         status=fwd_status, backend=backend)
    grads = fusedops.mamba2_chunk_scan_backward(**fwd_tensors, dy=t["dy"], saved=saved,
                                                dfinal_states=t["dfinal_states"], **case.options,
                                                status=bwd_status, backend=backend)
    return dict(y=y, final_states=final, **grads), int(fwd_status), int(bwd_status)


def _with_cu(case: Case, cu: list[int]) -> Case:
    tensors = dict(case.tensors, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEVICE))
    return Case(f"{case.label} cu_seqlens={cu}", tensors, case.options)


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("kind", list(INVALID_CU))
def test_invalid_cu_seqlens_compute_the_sanitised_offsets(backend, kind):
    """Whatever cu_seqlens holds, every output is the float64 recurrence over the sanitised
    offsets: tokens no sequence covers get y = 0 and zero gradients (exactly), an empty
    sequence returns its initial state, and both plans report CU_SEQLENS."""
    cu = INVALID_CU[kind]
    case = _with_cu(samples.small("varlen", torch.float32, seed=30, device=DEVICE), cu)
    result, fwd_status, bwd_status = _scan_with_status(case, backend)
    assert fwd_status == bwd_status == Status.CU_SEQLENS
    clean = sanitised(cu, 41)
    compare(result, INFO.oracle(_with_cu(case, clean)), INFO.tolerance("y", torch.float32))
    uncovered = torch.ones(41, dtype=torch.bool, device=DEVICE)
    uncovered[clean[0]:clean[-1]] = False
    for name in ("y", "dx", "ddt", "dB", "dC", "dz"):
        assert not result[name][0, uncovered].any(), name
    for s in range(5):
        if clean[s] == clean[s + 1]:
            assert torch.equal(result["final_states"][s], case.tensors["initial_states"][s])


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_valid_cu_seqlens_report_nothing_and_bits_accumulate(backend):
    """Valid offsets (trailing tokens no sequence covers included) set no bit; the word is
    never cleared: bits already set stay set, and a violation ORs its bit in."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=31, device=DEVICE),
                    [0, 5, 5, 21, 22, 37])
    result, fwd_status, bwd_status = _scan_with_status(case, backend)
    assert fwd_status == bwd_status == 0
    assert not result["y"][0, 37:].any() and not result["dx"][0, 37:].any()
    sticky = int(Status.SLOT_INDEX)
    _, fwd_status, bwd_status = _scan_with_status(case, backend, sticky)
    assert fwd_status == bwd_status == sticky
    _, fwd_status, _ = _scan_with_status(_with_cu(case, [0, 50, 5, 21, 22, 41]), backend, sticky)
    assert fwd_status == sticky | Status.CU_SEQLENS


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
def test_kernels_read_only_the_sanitised_offsets(backend):
    """Without a status word the reporting is compiled out, never the sanitising: the outputs
    equal those with one, and equal the torch backend's."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=32, device=DEVICE),
                    [0, 50, 5, 21, 22, 2**31 - 1])
    with_status, _, _ = _scan_with_status(case, backend)
    without = run(case, backend)
    for name, value in without.items():
        assert torch.equal(value, with_status[name]), name
    compare(without, run(case, "torch"), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("cu,match", [
    ([3, 5, 5, 21, 22, 41], r"^cu_seqlens: expected offsets starting at 0, got cu_seqlens\[0\] = 3$"),
    ([0, 5, 30, 21, 22, 41], r"^cu_seqlens: expected non-decreasing offsets, got cu_seqlens\[3\] = 21 "
                             r"< cu_seqlens\[2\] = 30$"),
    ([0, 5, 5, 21, 22, 42], r"^cu_seqlens: expected offsets up to the 41 packed tokens, got "
                            r"cu_seqlens\[5\] = 42$"),
])
def test_check_inputs_names_the_bad_entry(cu, match, monkeypatch):
    """check_inputs=True (or FUSEDOPS_CHECK_INPUTS=1) checks cu_seqlens on the host before
    anything runs: the eager wrappers, the torch op and plan.check_index_values."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=33, device=DEVICE), cu)
    t = case.tensors
    fwd = {k: t[k] for k in ("x", "dt", "A", "B", "C", *samples.OPTIONAL)}
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_forward(**fwd, **case.options, check_inputs=True, backend="torch")
    saved = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_backward(**fwd, dy=t["dy"], saved=saved, **case.options,
                                            check_inputs=True, backend="torch")
    options = {k: v for k, v in case.options.items() if k != "recompute_states"}
    with pytest.raises(ValidationError, match=match):
        fusedops.ops.mamba2_chunk_scan(**fwd, **options, check_inputs=True, backend="torch")
    plan = Mamba2ChunkScanForward(**fwd, **case.options, backend="torch")
    with pytest.raises(ValidationError, match=match):
        plan.check_index_values(cu_seqlens=t["cu_seqlens"])
    monkeypatch.setenv("FUSEDOPS_CHECK_INPUTS", "1")
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_forward(**fwd, **case.options, backend="torch")
    y, _, _ = fusedops.mamba2_chunk_scan_forward(**fwd, **case.options, check_inputs=False,
                                                 backend="torch")
    assert torch.isfinite(y).all()


def test_status_word_validation():
    core, _ = _base_inputs()
    for status, match in ((torch.zeros(1, dtype=torch.int64), r"^status: expected dtype int32, got int64"),
                          (torch.zeros(2, dtype=torch.int32),
                           r"^status: expected shape \[1\] = \[1\], got \[2\]")):
        with pytest.raises(ValidationError, match=match):
            Mamba2ChunkScanForward(**core, chunk_size=16, status=status.to(DEVICE), backend="torch")
    plan = Mamba2ChunkScanForward(**core, chunk_size=16, backend="torch").compile()
    with pytest.raises(ValidationError, match=r"^status: this plan was built without status"):
        plan.execute(*core.values(), *plan.allocate_outputs().values(),
                     status=torch.zeros(1, dtype=torch.int32, device=DEVICE))


def _eager_calls():
    """(label, fn(**options)) for every eager wrapper and torch op of the scan."""
    core, t = _base_inputs()
    dy = t["dy"]
    saved = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    return [
        ("forward", lambda **o: fusedops.mamba2_chunk_scan_forward(*core.values(), **o)),
        ("backward", lambda **o: fusedops.mamba2_chunk_scan_backward(*core.values(), dy, saved, **o)),
        ("torch op", lambda **o: fusedops.ops.mamba2_chunk_scan(*core.values(), **o)),
    ]


WRONG_OPTIONS = [("chunk_size", 64.0), ("chunk_size", "64"), ("chunk_size", True),
                 ("dt_softplus", 1), ("dt_limit", object()), ("dt_limit", (0.0,)),
                 ("recompute_states", "yes"), ("backend", 3), ("backend", "cudnn"),
                 ("current_stream", "stream"), ("check_inputs", 1)]


@pytest.mark.parametrize("label,index", [("forward", 0), ("backward", 1), ("torch op", 2)])
@pytest.mark.parametrize("option,value", WRONG_OPTIONS,
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(WRONG_OPTIONS)])
def test_wrong_typed_options_raise_validation_errors(label, index, option, value):
    """chunk_size=64.0 is refused (not truncated to 64) by the eager wrappers and the torch op,
    like every wrongly typed option: a ValidationError naming the option, not a TypeError."""
    fn = _eager_calls()[index][1]
    params = inspect.signature({"forward": fusedops.mamba2_chunk_scan_forward,
                                "backward": fusedops.mamba2_chunk_scan_backward,
                                "torch op": fusedops.ops.mamba2_chunk_scan}[label]).parameters
    if option not in params:
        pytest.skip(f"{label} takes no {option}")
    with pytest.raises(ValidationError, match=rf"^{option}: expected"):
        fn(**{option: value}, **({} if option == "backend" else {"backend": "torch"}))


def test_refused_chunk_size_does_not_poison_the_eager_plan_cache():
    """chunk_size=64.0: refused by the plans, the eager wrappers and the torch op before the
    eager plan cache is consulted; a later chunk_size=64 call builds and runs its plan."""
    core, _ = _base_inputs()
    with pytest.raises(ValidationError, match=r"^chunk_size: expected one of"):
        Mamba2ChunkScanForward(**core, chunk_size=64.0, backend="torch")
    size = len(EAGER_PLANS)
    for _, fn in _eager_calls():
        with pytest.raises(ValidationError,
                           match=r"^chunk_size: expected one of \(16, 32, 64, 128, 256\), got 64.0"):
            fn(chunk_size=64.0, backend="torch")
        assert len(EAGER_PLANS) == size
    y, _, _ = fusedops.mamba2_chunk_scan_forward(*core.values(), 64, backend="torch")
    size = len(EAGER_PLANS)
    again, _, _ = fusedops.mamba2_chunk_scan_forward(*core.values(), 64, backend="torch")
    assert len(EAGER_PLANS) == size and torch.equal(again, y)
    y_op, _ = fusedops.ops.mamba2_chunk_scan(*core.values(), 64, backend="torch")
    assert torch.equal(y_op, y)


class _HostReads(TorchDispatchMode):
    """Records the operators that read a device value on the host (.item(), bool(), tolist())."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


def test_torch_backend_reads_no_index_value_on_the_host():
    """The torch backend sanitises and reports with device ops only (capturable, no sync)."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=34, device=DEVICE),
                    [0, 50, 5, 21, 22, 41])
    t = case.tensors
    args = {k: t[k] for k in ("x", "dt", "A", "B", "C", *samples.OPTIONAL)}
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    fwd = Mamba2ChunkScanForward(**args, **case.options, status=status, backend="torch").compile()
    bwd = Mamba2ChunkScanBackward(**args, dy=t["dy"], dfinal_states=t["dfinal_states"],
                                  **case.options, status=status, backend="torch").compile()
    outputs = fwd.allocate_outputs()
    grads = bwd.allocate_outputs()
    with _HostReads() as mode:
        fwd.execute(**args, **outputs, status=status)
        bwd.execute(**args, dy=t["dy"], saved=outputs["saved"], dfinal_states=t["dfinal_states"],
                    **grads, status=status)
    assert mode.reads == [] and int(status) == Status.CU_SEQLENS


# -- 4b. strided views -----------------------------------------------------------------------------
STRIDED_DTYPES = {"torch": torch.float32, "triton": torch.bfloat16}
FORWARD_NAMES = ("x", "dt", "A", "B", "C", *samples.OPTIONAL)


def _in_wider(tensor, extra, fill=0.0, offset=0):
    """(buffer, view): ``tensor`` [..., h, w] (or [..., w]) as columns [offset, offset + h·w) of
    a wider buffer [..., h·w + extra] filled with ``fill`` (a slice of a fused projection)."""
    width = tensor.shape[-1] * (tensor.shape[-2] if tensor.dim() == 4 else 1)
    buffer = torch.full((*tensor.shape[:2], width + extra), fill, dtype=tensor.dtype,
                        device=tensor.device)
    view = buffer[..., offset:offset + width]
    view = view.unflatten(-1, tensor.shape[-2:]) if tensor.dim() == 4 else view
    view.copy_(tensor)
    return buffer, view


def _projection_views(t):
    """x, B, C and z as slices of one in-projection-like buffer (x after 16 other columns), dt
    as a slice of another, dy as a view of a wider buffer: what a Mamba2 layer hands the scan."""
    x, B, C, z = t["x"], t["B"], t["C"], t["z"]
    widths = [16, x[0, 0].numel(), B[0, 0].numel(), C[0, 0].numel(), z[0, 0].numel(), 8]
    proj = torch.zeros(*x.shape[:2], sum(widths), dtype=x.dtype, device=x.device)
    views, start = {}, widths[0]
    for name, width in zip(("x", "B", "C", "z"), widths[1:]):
        views[name] = proj[..., start:start + width].unflatten(-1, t[name].shape[-2:])
        views[name].copy_(t[name])
        start += width
    _, views["dt"] = _in_wider(t["dt"], 24, offset=8)
    _, views["dy"] = _in_wider(t["dy"], 16, offset=8)
    return views


def _run_views(case, backend, views, outputs):
    """Forward and backward through the plans with the given inputs (``views``) writing y, dx,
    ddt, dB, dC and dz into ``outputs``."""
    t = dict(case.tensors, **views)
    fwd = Mamba2ChunkScanForward(**{k: t[k] for k in FORWARD_NAMES}, **case.options,
                                 backend=backend).compile()
    out = dict(fwd.allocate_outputs(), y=outputs["y"])
    fwd.execute(**{k: t[k] for k in FORWARD_NAMES}, **out, workspace=fwd.allocate_workspace())
    bwd = Mamba2ChunkScanBackward(**{k: t[k] for k in FORWARD_NAMES}, dy=t["dy"],
                                  dfinal_states=t["dfinal_states"], **case.options,
                                  backend=backend).compile()
    grads = dict(bwd.allocate_outputs(), **{k: outputs[k] for k in ("dx", "ddt", "dB", "dC", "dz")})
    bwd.execute(**{k: t[k] for k in FORWARD_NAMES}, dy=t["dy"], saved=out["saved"],
                dfinal_states=t["dfinal_states"], **grads, workspace=bwd.allocate_workspace())
    return dict(y=out["y"], final_states=out["final_states"],
                **{k: grads[k] for k in bwd.gradient_names})


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed-uncovered"])
def test_strided_views_go_in_and_out_without_copies(backend, packed):
    """x, B, C, z as slices of one projection, dt and dy as views of wider buffers, and y, dx,
    ddt, dB, dC, dz written straight into views of NaN-filled wider buffers: the same bits as
    the contiguous run, nothing written beside (packed: tokens no sequence covers, zeroed in
    place)."""
    dtype = STRIDED_DTYPES[backend]
    if packed:
        case = samples.make(1, 37, 8, 8, 2, 16, dtype, seed=40, device=DEVICE, lengths=[5, 0, 20, 12],
                            **ALL)
        case.tensors["cu_seqlens"] = torch.tensor([0, 5, 5, 25, 30], dtype=torch.int32, device=DEVICE)
    else:
        case = samples.make(2, 37, 8, 8, 2, 16, dtype, seed=40, device=DEVICE, **ALL)
    t = case.tensors
    contiguous = dict(y=torch.empty_like(t["x"]), dx=torch.empty_like(t["x"]),
                      dz=torch.empty_like(t["x"]), ddt=torch.empty_like(t["dt"]),
                      dB=torch.empty_like(t["B"]), dC=torch.empty_like(t["C"]))
    expected = _run_views(case, backend, {}, contiguous)
    likes = dict(y="x", dx="x", dz="x", ddt="dt", dB="B", dC="C")
    buffers = {name: _in_wider(torch.empty_like(t[like]), 16, float("nan"), offset=8)
               for name, like in likes.items()}
    result = _run_views(case, backend, _projection_views(t),
                        {name: view for name, (_, view) in buffers.items()})
    for name, value in expected.items():
        assert torch.equal(result[name], value), name
    for name, (buffer, view) in buffers.items():
        assert torch.isnan(buffer[..., :8].float()).all() and torch.isnan(buffer[..., -8:].float()).all(), name


ALL = dict(D="h", z=True, dt_bias=True, initial_states=True, dfinal=True)


def test_strides_must_keep_rows_aligned():
    """Views need rows of whole 16-byte vectors with the other strides multiples of 16 bytes;
    an operand whose rows are not whole vectors (4 bf16 heads of dt: 8 bytes) is taken
    contiguous only, and a contiguous tensor of any size is always taken."""
    core, t = _base_inputs()
    x = torch.zeros(2, 20, 4, 9, dtype=torch.bfloat16, device=DEVICE)[..., :8]   # rows 18 bytes apart
    with pytest.raises(ValidationError, match=r"^x: expected strides of multiples of 16 bytes"):
        Mamba2ChunkScanForward(**dict(core, x=x), chunk_size=16, backend="torch")
    _, dt = _in_wider(t["dt"], 8)
    with pytest.raises(ValidationError, match=r"^dt: expected a contiguous tensor \(a view needs rows of a "
                                              r"multiple of 16 bytes; 4 bfloat16 elements make 8\)"):
        Mamba2ChunkScanForward(**dict(core, dt=dt), chunk_size=16, backend="torch")
    assert Mamba2ChunkScanForward(**dict(core, dt=dt.contiguous()), chunk_size=16, backend="torch")
    plan = Mamba2ChunkScanForward(**core, chunk_size=16, backend="torch").compile()
    out = plan.allocate_outputs()
    y = torch.zeros(2, 20, 4, 9, dtype=torch.bfloat16, device=DEVICE)[..., :8]
    with pytest.raises(ValidationError, match=r"^y: expected the last dimension contiguous and the other "
                                              r"strides multiples of 16 bytes"):
        plan.execute(*core.values(), y, out["final_states"], out["saved"])


def test_torch_op_hands_views_to_the_plans(monkeypatch):
    """fusedops.ops.mamba2_chunk_scan passes the layer's slices to the plans as they are (no
    copy), copies only a layout the plans cannot read (a transposed gradient), and its
    gradients through views equal those through contiguous tensors."""
    case = samples.make(2, 20, 8, 8, 2, 16, torch.float32, seed=41, device=DEVICE, D="h", z=True,
                        dt_bias=True)
    t = case.tensors
    views = _projection_views(t)
    seen = {}
    original = fusedops.mamba2_scan.ops.mamba2_chunk_scan_forward

    def spy(x, dt, A, B, C, *args, **kwargs):
        seen.update(x=x, dt=dt, B=B, C=C, z=kwargs["z"])
        return original(x, dt, A, B, C, *args, **kwargs)
    monkeypatch.setattr(fusedops.mamba2_scan.ops, "mamba2_chunk_scan_forward", spy)
    leaves = {k: views[k].detach().requires_grad_() if k in views else t[k]
              for k in ("x", "dt", "B", "C", "z")}
    args = dict(chunk_size=16, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, backend="torch")
    y, _ = fusedops.ops.mamba2_chunk_scan(leaves["x"], leaves["dt"], t["A"], leaves["B"], leaves["C"],
                                          z=leaves["z"], **{k: v for k, v in args.items() if k != "chunk_size"},
                                          chunk_size=16)
    for name in ("x", "dt", "B", "C", "z"):
        assert seen[name].data_ptr() == views[name].data_ptr(), name
        assert seen[name].stride() == views[name].stride(), name
    y.backward(t["dy"])
    dense = {k: t[k].clone().requires_grad_() for k in ("x", "dt", "B", "C", "z")}
    y2, _ = fusedops.ops.mamba2_chunk_scan(dense["x"], dense["dt"], t["A"], dense["B"], dense["C"],
                                           z=dense["z"], **args)
    y2.backward(t["dy"])
    assert torch.equal(y, y2)
    for name in dense:
        assert torch.equal(leaves[name].grad, dense[name].grad), name


# -- 4c. sequence ids ------------------------------------------------------------------------------
SEQ_IDX = {
    "batch": [[0] * 10 + [1] * 20 + [2] * 7,        # a change mid-chunk, and one at a chunk start
              [0] * 37,                              # one sequence: the initial state throughout
              [3] * 5 + [4] * 31 + [5]],             # not starting at 0: no initial state; 1 token
    "one-row": [[0] * 16 + [1] * 16 + [2] * 5],      # changes exactly at chunk boundaries
}


def _seq_case(dtype, kind, seed, **overrides):
    ids = SEQ_IDX[kind]
    options = dict(ALL, **overrides)
    case = samples.make(len(ids), 37, 4, 8, 2, 16, dtype, seed=seed, device=DEVICE, **options)
    tensors = dict(case.tensors, seq_idx=torch.tensor(ids, dtype=torch.int32, device=DEVICE))
    return Case(f"{case.label} seq_idx {kind}", tensors, case.options)


def _seq_run(case, backend, status=None):
    t = case.tensors
    names = (*FORWARD_NAMES, "seq_idx")
    y, final, saved = fusedops.mamba2_chunk_scan_forward(**{k: t[k] for k in names}, **case.options,
                                                         status=status, backend=backend)
    grads = fusedops.mamba2_chunk_scan_backward(**{k: t[k] for k in names}, dy=t["dy"], saved=saved,
                                                dfinal_states=t["dfinal_states"], **case.options,
                                                status=status, backend=backend)
    return dict(y=y, final_states=final, **grads)


@pytest.mark.parametrize("kind", list(SEQ_IDX))
def test_reference_with_seq_idx_matches_float64_recurrence(kind):
    """The state restarts where the id changes along a row; a row's initial state enters only
    a leading run of id 0; final_states are the rows' last states (mamba_ssm's rule)."""
    case = _seq_case(torch.float64, kind, seed=42)
    compare(_seq_run(case, "torch"), INFO.oracle(case), FLOAT64)
    case.tensors["seq_idx"] = None
    assert not torch.allclose(_seq_run(case, "torch")["y"],
                              INFO.oracle(_seq_case(torch.float64, kind, seed=42))["y"])


def test_seq_idx_recurrence_restarts_and_skips_the_initial_state():
    """The oracle itself: a row of one id is the plain recurrence; a change of id is a fresh
    sequence; a row starting with id 3 ignores its initial state."""
    case = _seq_case(torch.float64, "batch", seed=43)
    t = case.tensors
    kw = dict(dt_bias=t["dt_bias"], dt_softplus=True)
    y, final = mamba2_sequential(t["x"], t["dt"], t["A"], t["B"], t["C"], seq_idx=t["seq_idx"],
                                 initial_states=t["initial_states"], **kw)
    plain, plain_final = mamba2_sequential(t["x"][1:2], t["dt"][1:2], t["A"], t["B"][1:2], t["C"][1:2],
                                           initial_states=t["initial_states"][1:2], **kw)
    assert torch.equal(y[1:2], plain) and torch.equal(final[1:2], plain_final)
    fresh, fresh_final = mamba2_sequential(t["x"][0:1, 10:30], t["dt"][0:1, 10:30], t["A"],
                                           t["B"][0:1, 10:30], t["C"][0:1, 10:30], **kw)
    assert torch.allclose(y[0:1, 10:30], fresh)
    tail, tail_final = mamba2_sequential(t["x"][2:3, 5:36], t["dt"][2:3, 5:36], t["A"],
                                         t["B"][2:3, 5:36], t["C"][2:3, 5:36], **kw)
    assert torch.allclose(y[2:3, 5:36], tail)


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind", list(SEQ_IDX))
def test_kernels_with_seq_idx_match_oracle(backend, dtype, kind):
    case = _seq_case(dtype, kind, seed=44)
    compare(_seq_run(case, backend), INFO.oracle(case), INFO.tolerance("y", dtype))


INVALID_SEQ_IDX = {
    "decreasing": [[0] * 10 + [2] * 10 + [1] * 17, [0] * 37],
    "negative": [[-1] * 4 + [0] * 33, [0] * 20 + [-5] * 17],
    "extreme": [[2**31 - 1] * 3 + [-2**31] * 34, [0] * 37],
}


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("kind", list(INVALID_SEQ_IDX))
def test_invalid_seq_idx_follow_the_change_rule_and_report(backend, kind):
    """Any ids are memory-safe: every backend restarts wherever the id changes (the oracle's
    rule, applied to whatever they hold) and both plans report SEQ_IDX; valid ids report
    nothing."""
    case = _seq_case(torch.float32, "batch", seed=45)
    case.tensors["seq_idx"] = torch.tensor(INVALID_SEQ_IDX[kind], dtype=torch.int32, device=DEVICE)[:, :37]
    case.tensors.update({k: v[:2] for k, v in case.tensors.items()
                         if k in ("x", "dt", "B", "C", "z", "dy", "initial_states", "dfinal_states")})
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    compare(_seq_run(case, backend, status), INFO.oracle(case), INFO.tolerance("y", torch.float32))
    assert int(status) == Status.SEQ_IDX
    valid = _seq_case(torch.float32, "batch", seed=45)
    status.zero_()
    _seq_run(valid, backend, status)
    assert int(status) == 0


@pytest.mark.parametrize("ids,match", [
    ([[0, 0, 1, 0]], r"^seq_idx: expected ids non-decreasing along a row, got seq_idx\[0, 3\] = 0 < "
                     r"seq_idx\[0, 2\] = 1$"),
    ([[0, 0, -1, -1]], r"^seq_idx: expected non-negative ids, got seq_idx\[0, 2\] = -1$"),
])
def test_check_inputs_names_the_bad_seq_idx(ids, match):
    case = samples.make(1, 4, 2, 8, 1, 8, torch.float32, seed=46, device=DEVICE)
    t = case.tensors
    seq_idx = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    core = [t[k] for k in ("x", "dt", "A", "B", "C")]
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_forward(*core, 16, seq_idx=seq_idx, check_inputs=True,
                                           backend="torch")
    with pytest.raises(ValidationError, match=match):
        fusedops.ops.mamba2_chunk_scan(*core, 16, seq_idx=seq_idx, check_inputs=True,
                                       backend="torch")


def test_seq_idx_and_segment_states_validation():
    core, _ = _base_inputs()
    seq_idx = torch.zeros(2, 20, dtype=torch.int32, device=DEVICE)
    packed = {k: v[:1] for k, v in core.items() if k != "A"}
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValidationError, match=r"^seq_idx: expected None with cu_seqlens"):
        Mamba2ChunkScanForward(**packed, A=core["A"], chunk_size=16, cu_seqlens=cu,
                               seq_idx=seq_idx[:1], backend="torch")
    with pytest.raises(ValidationError, match=r"^segment_states: expected None with cu_seqlens"):
        Mamba2ChunkScanForward(**packed, A=core["A"], chunk_size=16, cu_seqlens=cu, backend="torch",
                               segment_states=TensorDesc((3, 4, 8, 8), torch.float32, device=DEVICE))
    with pytest.raises(ValidationError, match=r"^segment_states: expected shape \[b·ceil\(l / chunk_size\), "
                                              r"h, p, n\] = \[4, 4, 8, 8\]"):
        Mamba2ChunkScanForward(**core, chunk_size=16, backend="torch",
                               segment_states=TensorDesc((3, 4, 8, 8), torch.float32, device=DEVICE))


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_segment_states_are_the_states_entering_each_chunk(backend):
    """segment_states[r·nc + c]: the state after token c·Q - 1 of row r (the initial state for
    c = 0), as the float64 recurrence over the first c·Q tokens gives it."""
    case = _seq_case(torch.float32, "batch", seed=47)
    t = case.tensors
    names = (*FORWARD_NAMES, "seq_idx")
    out = fusedops.mamba2_chunk_scan_forward(**{k: t[k] for k in names}, **case.options,
                                             return_segment_states=True, backend=backend)
    states = out["segment_states"].view(3, 3, 4, 8, 16)
    for c in (1, 2):
        _, expected = mamba2_sequential(t["x"][:, :16 * c], t["dt"][:, :16 * c], t["A"],
                                        t["B"][:, :16 * c], t["C"][:, :16 * c],
                                        dt_bias=t["dt_bias"], dt_softplus=True,
                                        initial_states=t["initial_states"],
                                        seq_idx=t["seq_idx"][:, :16 * c])
        assert_close(states[:, c], expected, INFO.tolerance("y", torch.float32), f"chunk {c}")
    assert torch.equal(states[:, 0], t["initial_states"])


# -- 5. the performance model, the tile table, autotune candidates -------------------------------
def _production(label: str):
    """(forward plan, backward plan) of the registry's production shape ``label``, on the CPU."""
    (calls,) = [calls for name, calls in samples.production() if name == label]
    return tuple(call.build("torch") for call in calls)


def test_tile_table_follows_the_target_arch():
    """One entry per architecture, each with its reason; the programs take the target's entry
    (or ``config=``), and the autotune candidates start with it."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan import program as kernels
    from fusedops.backends.triton.mamba2_scan import tiles as kernels_tiles
    from fusedops.core.target import compiling_for
    fwd, bwd = _production("scan h128 p64 n128 Q256")
    assert set(kernels.TILES) == {"sm_80", "sm_90", "sm_100"}
    for arch, (entry, why) in kernels.TILES.items():
        assert why
        with compiling_for(arch):
            assert kernels.tiles(fwd.problem) == kernels.tiles(fwd.problem, entry)
            assert kernels.forward_candidates(fwd.problem)[0] == entry
            assert kernels.backward_candidates(bwd.problem)[0] == entry
    other = kernels.ScanTiles(BQ=32, BP=32, BN=128, BLOCK_H=8, FUSED=False)
    t = kernels.tiles(fwd.problem, other)
    assert (t.BQ, t.BP, t.BN, t.BLOCK_H, t.FUSED) == (32, 32, 128, 8, False)
    names = [k.name for k in kernels.forward_program(fwd.problem, config=other).kernels]
    assert names == ["ssd_dt_cumsum_kernel", "ssd_cb_kernel", "ssd_chunk_states_kernel",
                     "ssd_chunk_scan_fwd_kernel"]
    scan = kernels.forward_program(fwd.problem, config=other).kernels[-1]
    assert scan.grid == (2 * 8 * 64 * 128, 1, 1)      # p / BP x Q / BQ programs per (segment, head)
    fused = replace(other, FUSED=True, FUSED_WARPS=4, FUSED_STAGES=2)
    walk = kernels.forward_program(fwd.problem, config=fused).kernels[-1]
    assert walk.name == "ssd_fused_fwd_kernel"
    assert walk.grid == (2 * 2 * 128, 1, 1)            # p / BP programs per (sequence, head)
    assert (walk.num_warps, walk.num_stages) == (4, 2)
    with compiling_for("sm_90"):
        (dbc,) = [k for k in kernels.backward_program(bwd.problem).kernels
                  if k.name == "ssd_dbc_kernel"]
    # dB and dC of every row block (4) and state tile (the whole state: 1), then dx of every
    # row block and head-dim tile (1), per segment·group
    assert dbc.grid == ((2 * 4 * 1 + 4 * 1) * 64 * 8, 1, 1)
    names = [k.name for k in kernels.backward_program(bwd.problem).kernels]
    assert "ssd_cb_kernel" in names and "ssd_chunk_scan_bwd_dx_kernel" not in names
    apart = replace(kernels.TILES["sm_90"][0], DX_IN_DBC=False)
    names = [k.name for k in kernels.backward_program(bwd.problem, config=apart).kernels]
    assert "ssd_cb_kernel" not in names and "ssd_chunk_scan_bwd_dx_kernel" in names
    wide = samples.make(1, 20, 2, 64, 1, kernels_tiles.FUSED_MAX_STATE + 1, device="cpu")
    wide_plan = Mamba2ChunkScanForward(**{k: wide.tensors[k] for k in samples._FORWARD_TENSORS},
                                       **wide.options, backend="torch")
    assert not kernels.tiles(wide_plan.problem).FUSED      # the walk would hold 256 state columns
    wide_candidates = kernels.forward_candidates(wide_plan.problem)
    assert len({kernels.tiles(wide_plan.problem, c) for c in wide_candidates}) \
        == len(wide_candidates) == 4                        # the two pipelines' entries coincide


SPLIT_COMPILE = """
import json
from dataclasses import replace
from fusedops.backends.triton.mamba2_scan import program as kernels
from fusedops.core.target import compiling_for
from fusedops.kernel_report.compiled import compile_triton
from fusedops.mamba2_scan import samples
(calls,) = [c for label, c in samples.production() if label == "scan h128 p64 n128 Q256"]
fwd = calls[0].build("torch")
for arch in ("sm_90a", "sm_100a"):
    with compiling_for(arch):
        split = replace(kernels.TILES[arch.removesuffix("a")][0], FUSED=False)
        specs = kernels.forward_program(fwd.problem, config=split).kernels[-2:]
    for spec in specs:
        compiled, _ = compile_triton(spec, arch)
        print(json.dumps([arch, spec.name, compiled.spill_bytes]))
"""


def test_split_forward_kernels_compile_without_spills():
    """The split forward's kernels (``FUSED=False``: an autotune candidate, and the states kernel
    the backward runs with recompute_states) compile for sm_90a and sm_100a at the production
    shape without spilling (in a process without the interpreter; the default plans' kernels
    are the kernel report's)."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SPLIT_COMPILE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [name for _, name, _ in rows] == ["ssd_chunk_states_kernel",
                                             "ssd_chunk_scan_fwd_kernel"] * 2
    assert all(spill == 0 for _, _, spill in rows), rows


def test_segment_row_blocks_of_the_model():
    """The loop counts the model sums: a full segment of 4 row blocks, and one of 100 tokens."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan.cost import _Segment
    full = _Segment(256, 1, (64, 64, 64, 64))
    assert (full.rb, full.tri, full.below(), full.above(), full.pair_rows(4)) == \
        (4, 10, 640, 640, 1280)
    short = _Segment(100, 1, (64, 36, 0, 0))
    assert (short.rb, short.tri, short.below(), short.above(), short.pair_rows(4)) == \
        (2, 3, 164, 136, 500)


def test_the_traffic_counter_counts_a_reread_by_reuse_distance():
    """The models' counter (l2_reuse.Programs, docs/performance.md, "How traffic is counted")
    on a grid (4, 2), the first dimension fastest: program p = i + 4·j. Every program loads one
    10-byte tile (twice with ``twice``), 3 bytes alone and stores 1: 14 bytes a program (24
    with ``twice``), so G = 0.5·l2 / 14. Tile i is loaded by programs i and i + 4 (4 apart):
    once if G >= 4 (l2 >= 112), by both programs below; tile j by the 4 consecutive programs of
    its column (1 apart): once if G >= 1 (l2 >= 48 with ``twice``), else once per program (a
    program's own re-load counts once). With i < 2 active, 4 programs run (i + 2·j: tile i 2
    apart, l2 = 56 gives G = 2). Loads alone and stores always count."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.l2_reuse import Programs

    def count(l2, key, active=None, twice=False):
        w = Programs((4, 2), l2, active)
        i, j = w.coords
        every = torch.arange(w.programs)
        for _ in range(1 + twice):
            w.load("a", every, {"i": i, "j": j}[key], 10)
        w.alone(every, 3)
        w.store(every, 1)
        return w.count()

    # (read, written): 8 x 3 bytes alone, 8 x 1 stored
    assert count(112, "i") == (4 * 10 + 24, 8)             # G = 4: the second load hits
    assert count(111, "i") == (8 * 10 + 24, 8)             # G = 3.96: it misses
    assert count(48, "j", twice=True) == (2 * 10 + 24, 8)  # G = 1
    assert count(47, "j", twice=True) == (8 * 10 + 24, 8)  # G < 1: every program's, once
    assert count(56, "i", active=lambda i, j: i < 2) == (2 * 10 + 12, 4)
    assert count(55, "i", active=lambda i, j: i < 2) == (4 * 10 + 12, 4)


def test_the_counter_expands_per_program_loop_bounds():
    """Programs.ranges: one (program, index) per iteration of a loop whose bounds differ
    between programs (the key blocks of a causal query block)."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.l2_reuse import Programs
    prog, index = Programs((3,), 1.0).ranges(torch.tensor([0, 5, 2]), torch.tensor([2, 0, 3]))
    assert prog.tolist() == [0, 0, 2, 2, 2] and index.tolist() == [0, 1, 2, 3, 4]


def test_segment_tokens_follow_the_segment_lengths():
    """The segments the models walk in grid order hold the lengths the floor sums (packed
    sequences: the tuning inputs' even split), then the unused segments."""
    pytest.importorskip("triton")
    from collections import Counter

    from fusedops.backends.triton.mamba2_scan.cost import segment_tokens
    from fusedops.mamba2_scan.contract import segment_lengths
    for label in ("scan h128 p64 n128 Q256", "scan varlen Q256", "scan p80 Q128"):
        problem = _production(label)[0].problem
        tokens = segment_tokens(problem)
        assert len(tokens) == problem.max_segments
        assert Counter(t for t in tokens if t) == dict(segment_lengths(problem)), label
    assert segment_tokens(_production("scan varlen Q256")[0].problem)[:65] == [128] * 64 + [0]


def _production_bytes():
    """Sizes the production shape's cost tests count with (b=2, l=8192, h=128, p=64, n=128,
    g=8, Q=256, bf16, BQ=64): T, S, BQ, Q, h, p, g, n, the element size e, then the bytes of x
    (xb), of the segment states in fp32 (state), of one fp32 state per sequence (seq_state),
    of dts or acum (fp32 per segment), of B or C rows (bc) and of the fp32 C·B tiles of the 10
    pairs as stored and loaded (cb: the 4 diagonal tiles' entries j <= i, in the 32-byte
    sectors their rows touch: sum over rows r < 64 of ceil(4(r + 1)/32)·32 = 9216 bytes)."""
    b, l, h, p, g, n, Q, e = 2, 8192, 128, 64, 8, 128, 256, 2
    T, S, BQ = b * l, b * l // Q, 64
    diagonal = sum(-(-4 * (r + 1) // 32) * 32 for r in range(BQ))
    assert diagonal == 9216
    return (T, S, BQ, Q, h, p, g, n, e, T * h * p * e, S * h * p * n * 4, b * h * p * n * 4,
            S * h * Q * 4, T * g * n * e, S * g * (6 * BQ * BQ * 4 + 4 * diagonal))


def test_forward_model_and_floor_at_the_production_shape():
    """The forward's modelled bytes on sm_90 (b=2, l=8192, h=128, p=64, n=128, g=8, Q=256, bf16,
    BQ=BP=BN=64, D and z, initial states, bf16 passed states), recomputed here by reuse distance
    (G = 0.5 · 50 MB over the mean bytes a program moves), and its floor.

    C·B: 10 pairs x S·g = 512 programs, the 10 pairs of a (segment, group) side by side, each
    loading C rows i and B rows j (64·128·2 = 16 KiB each) and storing a 64 x 64 fp32 tile (16
    KiB; 9 KiB of a diagonal one, its entries j <= i): G = 25e6 / 46,285 = 540, more than the
    at most 9 programs between two pairs that
    share C (or B) rows: C and B are read once.
    The fused walk: 256 programs (b·h, one head-dim tile), each walking its sequence's 32
    segments: x (1 MiB), B and C rows (2 MiB each), the 10 C·B tiles of every segment (5 MiB),
    acum and dts (64 KiB), the last acum, z (1 MiB) and the initial state tile (32 KiB) loaded;
    32 bf16 entering tiles (512 KiB), the fp32 final tile (32 KiB), y and y before the gate
    (2 MiB) stored: about 14 MiB a program, G = 25e6 / 14 MiB = 1.7. B, C and C·B are shared
    by the 16 heads of a group, 1 program apart: read once; x, acum and dts are the program's
    own: once. The split pipeline's states and output kernels (``FUSED=False``) are counted in
    ``test_split_forward_model_at_the_production_shape``."""
    pytest.importorskip("triton")
    from fusedops.core.cost import total
    from fusedops.core.target import compiling_for
    with compiling_for("sm_90"):
        fwd, _ = _production("scan h128 p64 n128 Q256")
        kernels = fwd.kernel_program("triton").kernels
    T, S, BQ, Q, h, p, g, n, e, xb, state, seq_state, acum, bc, cb = _production_bytes()
    assert 0.5 * 50e6 / (2 * BQ * n * e + BQ * BQ * 4) > 9
    assert 0.5 * 50e6 / (14 * 2**20) > 1
    expected = {
        "ssd_dt_cumsum_kernel": (T * h * e + 8 * h, 2 * acum),
        "ssd_cb_kernel": (2 * bc, cb),
        "ssd_fused_fwd_kernel": (xb + 2 * bc + cb + 2 * acum + 4 * S * h + xb + seq_state + 4 * h,
                                 state // 2 + seq_state + 2 * xb),  # z, h0, D; y, y before the gate
    }
    assert {k.name: (k.cost.bytes_read, k.cost.bytes_written) for k in kernels} == expected
    floor = fwd.floor()
    assert floor.bytes_read == 2 * xb + T * h * e + 2 * T * g * n * e + 4 * 3 * h + seq_state
    assert floor.bytes_written == xb + seq_state
    assert floor.mma_flops == 4 * T * h * p * n + S * Q * (Q + 1) // 2 * (2 * h * p + 2 * g * n)
    modelled = total(k.cost for k in kernels)
    assert 1.71 < modelled.bytes / floor.bytes < 1.73         # docs/mamba2_scan.md, Performance model


def test_split_forward_model_at_the_production_shape():
    """The split forward (``FUSED=False``) at the shape above, recounted as the fused walk's
    test does.

    States: 512 programs (2 state tiles x b·h), each walking its sequence's 32 segments: x and B
    (32 x 256 rows x 64 x 2 bytes = 1 MiB each), acum and dts (64 KiB), the last acum (128 B),
    the initial state tile (16 KiB) and 32 bf16 entering tiles plus the fp32 final one
    (278,528 B) stored: G = 25e6 / 2,457,728 = 10.2. x is shared by the 2 tiles of a head (1
    apart), B by the 16 heads of a group (2 apart), acum and dts by the 2 tiles: all once.
    Output: 32768 programs (4 row blocks x S·h), row block i loading acum (256 B), C rows i and
    the state tile (16 KiB each), for k <= i a C·B tile (16 KiB), acum, dts (256 B each) and x
    rows (8 KiB), the diagonal x block again for D (8 KiB) and z (8 KiB), storing y and y before
    the gate (16 KiB): a mean of 128,512 bytes (2.5 blocks k), G = 194.5. C and C·B are shared
    by the 16 heads of the group (4 apart), the state, x, acum and dts by the row blocks of the
    (segment, head) (at most 3 apart): all once."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan import program as kernels_module
    from fusedops.core.cost import total
    from fusedops.core.target import compiling_for
    with compiling_for("sm_90"):
        fwd, _ = _production("scan h128 p64 n128 Q256")
        split = replace(kernels_module.TILES["sm_90"][0], FUSED=False)
        kernels = kernels_module.forward_program(fwd.problem, config=split).kernels
    T, S, BQ, Q, h, p, g, n, e, xb, state, seq_state, acum, bc, cb = _production_bytes()
    expected = {
        "ssd_dt_cumsum_kernel": T * h * e + 8 * h + 2 * acum,
        "ssd_cb_kernel": 2 * bc + cb,
        "ssd_chunk_states_kernel": xb + bc + 2 * acum + 4 * S * h + state // 2 + 2 * seq_state,
        "ssd_chunk_scan_fwd_kernel": (state // 2 + xb + 2 * acum + bc + cb
                                      + xb + 4 * h + 2 * xb),      # z, D; y, y before the gate
    }
    assert {k.name: k.cost.bytes for k in kernels} == expected
    modelled = total(k.cost for k in kernels)
    assert 2.18 < modelled.bytes / fwd.floor().bytes < 2.2


def test_backward_dbc_kernel_at_the_production_shape():
    """The modelled bytes of the backward's dB/dC kernel (with the d(C·B) tiles, C·B and the
    straddling pieces) on sm_90 at the production shape (as the forward's test above, bf16
    passed states), recounted by reuse distance, with dx in its own launch (DX_IN_DBC off) and
    in this one (the table's entry). The 8 dB/dC programs of a (segment, group) run side by side
    (dB and dC fastest, then the 4 row blocks; the whole state in one tile).

    dB of row block j loads its B rows (64·128·2 = 16 KiB), for the 4 - j blocks i >= j C rows
    i (16 KiB) and for each of 16 heads dy rows i (8 KiB) and acum i (256 B), then per head x
    rows j (8 KiB), acum j, dts j (256 B each), the last acum (4 B) and the bf16 dH1 tile (64 x
    128 x 2 = 16 KiB), storing 16 partials (256 B each) and its dB rows (16 KiB). dC of row
    block i likewise with the i + 1 blocks j <= i (B rows j, x rows j, acum j and dts j), dy rows
    i, the bf16 H0 tile, and also the C·B tile (16 KiB) and each head's 2·64 + 1 floats of
    pieces of its i + 1 pairs; dC of row block 0 also loads the dH1 tile (shared with dB) and
    stores each head's <dH1, H0> partial (4 B). dH1 and H0 (bf16) are half the fp32 state's
    bytes each. The 8 programs move 851,056 bytes on average: G = 25e6 / 851,056 = 29.4, more
    than the 7 programs between any two of a (segment, group), so B, C, dy, x, acum, dts, dH1
    and H0 are read once. The partials are 16 x 256 bytes for each of the S·g·8 programs:
    S·h·2·Q·4, twice acum's bytes; without dx here the C·B tiles are stored for dx.

    With dx, 4 more programs per (segment, group), one per row block j, loop the group's 16
    heads: B rows j, the dH1 tile, the C·B tiles (i >= j, j) with dy and acum rows i, x, dts
    and (D) dy rows j, storing dx rows j, a BQ·4 ddt partial and a p·4 dD partial per head. The
    12 programs move 1.40 MB on average: G = 17.8, more than the 11 between any two of a
    (segment, group), so of dx's loads only C·B (the prologue's C·B kernel wrote it: C and B
    read once, the tiles written) and D (h·4 bytes) count; dx's rows and partials are
    written."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan import program as scan_kernels
    from fusedops.core.target import compiling_for
    T, S, BQ, Q, h, p, g, n, e, xb, state, seq_state, acum, bc, cb = _production_bytes()
    assert 0.5 * 50e6 / 851_056 > 7
    pieces = S * h * 10 * (2 * BQ + 1) * 4
    read = 2 * bc + 2 * xb + 2 * acum + 4 * S * h + state
    written = pieces + 2 * acum + 2 * bc + 4 * S * h
    with compiling_for("sm_90"):
        _, bwd = _production("scan h128 p64 n128 Q256")
        apart = replace(scan_kernels.TILES["sm_90"][0], DX_IN_DBC=False)
        for config in (apart, None):
            kernels = scan_kernels.backward_program(bwd.problem, config=config).kernels
            costs = [(k.name, k.cost.bytes_read, k.cost.bytes_written) for k in kernels
                     if k.name in ("ssd_cb_kernel", "ssd_dbc_kernel")]
            if config is apart:
                assert costs == [("ssd_dbc_kernel", read, written + cb)]
            else:
                dD = S * h * (Q // BQ) * p * 4
                assert costs == [("ssd_cb_kernel", 2 * bc, cb),
                                 ("ssd_dbc_kernel", read + cb + h * 4,
                                  written + xb + acum + dD)]


def test_every_production_kernel_is_modelled_above_its_floor():
    """Every kernel of every production plan carries a cost; no plan models fewer bytes or
    tensor-core FLOPs than its floor."""
    pytest.importorskip("triton")
    from fusedops.core.cost import total
    for label, calls in samples.production():
        for call in calls:
            plan = call.build("torch")
            kernels = plan.kernel_program("triton").kernels
            assert all(k.cost is not None for k in kernels), label
            modelled, floor = total(k.cost for k in kernels), plan.floor()
            assert modelled.bytes > floor.bytes and modelled.mma_flops >= floor.mma_flops, label
            assert all(k.cost.mma_rows in (0, 64) for k in kernels), label


def test_tuning_tensors_are_valid_packed_offsets():
    """Timing a packed plan's candidates uses valid cu_seqlens: an even split of the tokens."""
    fwd, bwd = _production("scan varlen Q256")
    for plan in (fwd, bwd):
        cu = plan._tuning_tensors()["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.shape == (65,)
        assert cu[0] == 0 and cu[-1] == 8192 and bool((cu.diff() == 128).all())
        assert plan._tuning_binding()["cu_seqlens"] is not None
    plain, _ = _production("scan h128 p64 n128 Q256")
    assert plain._tuning_tensors() == {}


@pytest.mark.parametrize("backend", [b for b in SCAN_KERNEL_BACKENDS if b == "triton"])
def test_every_autotune_candidate_computes_the_scan(backend):
    """Each candidate's forward and backward programs (the other forward pipeline, dx in its own
    launch, another state tile, head-dim tile) give the reference's results; with z, so the
    backward walk's gate runs on 2 state tiles (only the first writes dz and dy·silu(z)) and,
    at BP = 32, 2 head-dim tiles. Against the float64 reference of the same inputs. dA sums
    dt_k·da_k over the tokens, terms that cancel: the kernels' decay weights
    exp(Acum_i - Acum_j) carry the rounding of the fp32 cumulative sums (the torch path forms
    each difference as its own sum), and the cancellation magnifies it to 0.5-2e-5 of dA here
    (1e-4 at other seeds; the torch path's fp32 error is 0.7-10e-6), so dA gets DA_FP32. So does
    ddt_bias, the sum of ddt over the tokens: its terms cancel too, magnifying ddt's 1.5e-6 to
    1.2-1.7e-5 here (2.1e-5 on another CPU)."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    case = samples.make(1, 70, 2, 64, 1, 128, torch.float32, seed=3, device=DEVICE, chunk=64,
                        D="h", z=True, dt_bias=True, initial_states=True, dfinal=True)
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in case.tensors.items()}
    expected = run(Case(case.label, wide, case.options), "torch")
    t = case.tensors
    fwd_t = {k: t[k] for k in samples._FORWARD_TENSORS}
    probe = Mamba2ChunkScanForward(**fwd_t, **case.options, backend=backend)
    configs = kernels.forward_candidates(probe.problem)
    assert len({kernels.tiles(probe.problem, c) for c in configs}) == len(configs) == 5
    for config in configs:
        fwd = Mamba2ChunkScanForward(**fwd_t, **case.options, backend=backend)
        fwd._program = kernels.forward_program(fwd.problem, config=config)
        outputs = fwd.compile().allocate_outputs()
        fwd.execute(**fwd_t, **outputs, workspace=fwd.allocate_workspace())
        bwd = Mamba2ChunkScanBackward(**fwd_t, dy=t["dy"], dfinal_states=t["dfinal_states"],
                                      **case.options, backend=backend)
        bwd._program = kernels.backward_program(bwd.problem, config=config)
        grads = bwd.compile().allocate_outputs()
        bwd.execute(**fwd_t, dy=t["dy"], saved=outputs["saved"],
                    dfinal_states=t["dfinal_states"], **grads, workspace=bwd.allocate_workspace())
        names = [name for name in expected if name in outputs or name in grads]
        compare(dict(outputs, **grads), expected, KERNEL_TOLERANCE[torch.float32],
                [name for name in names if name not in ("dA", "ddt_bias")])
        for name in ("dA", "ddt_bias"):
            assert_close(grads[name], expected[name], DA_FP32, name)


DA_FP32 = Tolerance(2e-4, 2e-4, "fp32: dA and ddt_bias sum terms that cancel (see the test above)")


@pytest.mark.parametrize("backend", [b for b in SCAN_KERNEL_BACKENDS if b == "triton"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("dx_in_dbc", [False, True], ids=["dx-apart", "dx-in-dbc"])
def test_dbc_kernel_over_several_state_tiles(backend, packed, dx_in_dbc):
    """The dB/dC kernel with the state split into DBC_NNB = 2 tiles: each tile's programs form
    the d(C·B) tiles again, only the first writes C·B (without DX_IN_DBC) and the straddling
    pieces, and every tile writes its U, W' and <dH1, H0> partials, which ddt and dA sum in
    tile order (n = 32 in 16-wide tiles, 2 row blocks of 16 per segment; packed: sequences
    ending inside row blocks and an empty one, so dB/dC programs past a segment's end return
    while dx's write their zero partials). With DX_IN_DBC the launch's dx programs (each
    looping the group's 2 heads; p = 32 in 16-wide head-dim tiles, two programs a row block)
    read the C·B the prologue wrote."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    case = samples.make(1, 70, 2, 32, 1, 32, torch.float32, seed=5, device=DEVICE, chunk=32,
                        D="h", z=True, dt_bias=True, initial_states=not packed,
                        dfinal=not packed, lengths=[21, 0, 49] if packed else None)
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in case.tensors.items()}
    expected = run(Case(case.label, wide, case.options), "torch")
    t = case.tensors
    fwd_t = {k: t[k] for k in samples._FORWARD_TENSORS if k in t}
    config = kernels.ScanTiles(BQ=16, BP=16, BN=16, BLOCK_H=2, DBC_BN=16, DX_IN_DBC=dx_in_dbc)
    fwd = Mamba2ChunkScanForward(**fwd_t, **case.options, backend=backend)
    fwd._program = kernels.forward_program(fwd.problem, config=config)
    outputs = fwd.compile().allocate_outputs()
    fwd.execute(**fwd_t, **outputs, workspace=fwd.allocate_workspace())
    extra = {} if packed else dict(dfinal_states=t["dfinal_states"])
    bwd = Mamba2ChunkScanBackward(**fwd_t, dy=t["dy"], **extra, **case.options, backend=backend)
    bwd._program = kernels.backward_program(bwd.problem, config=config)
    assert kernels.tiles(bwd.problem, config).DBC_BN == 16
    launches = [k.name for k in bwd._program.kernels]
    assert ("ssd_chunk_scan_bwd_dx_kernel" in launches) != dx_in_dbc
    assert ("ssd_cb_kernel" in launches) == dx_in_dbc
    grads = bwd.compile().allocate_outputs()
    bwd.execute(**fwd_t, dy=t["dy"], saved=outputs["saved"], **extra, **grads,
                workspace=bwd.allocate_workspace())
    names = [name for name in expected if name in grads]
    assert {"dB", "dC", "ddt", "dx"} <= set(names)
    compare(grads, expected, KERNEL_TOLERANCE[torch.float32],
            [name for name in names if name != "dA"])
    assert_close(grads["dA"], expected["dA"], DA_FP32, "dA")


def _forward_with(case, config, extra=()):
    """y, final_states, the saved buffer and (without cu_seqlens) segment_states of the Triton
    forward program built with tile-table entry ``config``; ``extra``: more tensor names."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    t = case.tensors
    fwd_t = {k: t[k] for k in (*samples._FORWARD_TENSORS, *extra)}
    descs = {}
    if t.get("cu_seqlens") is None:
        b, l, h, p = t["x"].shape
        segments = b * -(-l // case.options["chunk_size"])
        descs["segment_states"] = TensorDesc((segments, h, p, t["B"].shape[-1]), torch.float32,
                                             device=t["x"].device)
    fwd = Mamba2ChunkScanForward(**fwd_t, **descs, **case.options, backend="triton")
    fwd._program = kernels.forward_program(fwd.problem, config=config)
    outputs = fwd.compile().allocate_outputs()
    fwd.execute(**fwd_t, **outputs, workspace=fwd.allocate_workspace())
    return outputs


SPLIT_CASES = {
    "all-options": lambda: samples.small("all-options", torch.float32, seed=6, device=DEVICE),
    "varlen": lambda: samples.small("varlen", torch.float32, seed=6, device=DEVICE),
    "multi-tile": lambda: samples.small("multi-tile", torch.float32, seed=6, device=DEVICE),
    "odd-dims": lambda: samples.small("odd-dims", torch.float32, seed=6, device=DEVICE),
    "bf16": lambda: samples.small("all-options", torch.bfloat16, seed=6, device=DEVICE),
    "seq-idx": lambda: _seq_case(torch.float32, "batch", seed=44),
}


@pytest.mark.skipif("triton" not in SCAN_KERNEL_BACKENDS, reason="the Triton backend is absent")
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_fused_and_split_forwards_agree(name):
    """The fused walk (``FUSED=True``) and the states + output kernels (``FUSED=False``) give
    the same y, final states and segment states (without packed sequences) within rounding, and
    both match the torch backend. The fused walk rounds its register state to x's dtype for the
    state term as the split output kernel reads the stored copy, and sums the state term in one
    product over n (the split kernel in BN-wide steps): fp32 results agree to ~1e-6."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    case = SPLIT_CASES[name]()
    extra = ("seq_idx",) if "seq_idx" in case.tensors else ()
    base = kernels.TILES["sm_90"][0]
    fused, split = (_forward_with(case, replace(base, FUSED=flag), extra)
                    for flag in (True, False))
    assert set(fused) == set(split)
    tolerance = KERNEL_TOLERANCE[case.tensors["x"].dtype]
    compare(fused, split, tolerance, ["y", "final_states", "segment_states"])
    reference = (_seq_run(case, "torch") if extra else run(case, "torch"))
    compare(fused, reference, tolerance, ["y", "final_states"])


# -- 6. GPU checks -------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS if b == "triton"])
@pytest.mark.parametrize("chunk", [128, 256])
def test_gpu_nemotron_shape_bf16(backend, chunk):
    """h=128 p=64 n=128 g=8 in bf16 against the fp32 torch reference."""
    case = samples.make(2, 2048, 128, 64, 8, 128, torch.bfloat16, seed=20, device=DEVICE,
                        chunk=chunk, **samples.ALL_OPTIONS)
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.bfloat16])


def _varlen_case(seed):
    return samples.make(1, 3000, 16, 64, 2, 64, torch.bfloat16, seed=seed, device=DEVICE,
                        chunk=256, lengths=[700, 1, 0, 256, 2043], **samples.ALL_OPTIONS)


@requires_cuda
@pytest.mark.gpu
def test_gpu_varlen_and_graph_capture():
    """Forward and backward captured together in one graph, replayed on new inputs copied into
    the same buffers: equal to a fresh run."""
    t = _varlen_case(21).tensors
    opts = {k: t[k] for k in ("D", "z", "dt_bias", "initial_states", "cu_seqlens")}
    core = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    fwd = Mamba2ChunkScanForward(**core, chunk_size=256, dt_softplus=True, **opts).compile()
    bo = dict(opts, dfinal_states=t["dfinal_states"])
    bwd = Mamba2ChunkScanBackward(**core, dy=t["dy"], chunk_size=256, dt_softplus=True, **bo).compile()
    y, fin = torch.empty_like(t["x"]), torch.empty(fwd.desc("final_states").shape, device=DEVICE)
    saved, ws_f, ws_b = fwd.allocate_saved(), fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = bwd.allocate_outputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fwd.execute(*core.values(), y, fin, saved, **opts, workspace=ws_f)
        with torch.cuda.graph(graph, stream=stream):
            fwd.execute(*core.values(), y, fin, saved, **opts, workspace=ws_f)
            bwd.execute(*core.values(), t["dy"], saved, **grads, **bo, workspace=ws_b)
    fresh = _varlen_case(22)
    for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "dy", "dfinal_states"):
        t[k].copy_(fresh.tensors[k])
    for buf in (y, fin, ws_f, ws_b, *grads.values()):
        buf.fill_(255 if buf.dtype == torch.uint8 else float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = run(fresh, "triton")
    for name, value in dict(y=y, final_states=fin, **grads).items():
        assert torch.equal(value, expected[name]), name


@requires_cuda
@pytest.mark.gpu
def test_gpu_offsets_beyond_2_31_elements():
    """b·l·h·p > 2^31: the second row of a large batch equals the same row run alone."""
    h, p, g, n = 128, 64, 8, 64
    l = 2**31 // (h * p) // 2 + 256
    t = samples.make(2, l, h, p, g, n, torch.bfloat16, seed=23, device=DEVICE).tensors
    core = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    del t
    fwd = Mamba2ChunkScanForward(**core, chunk_size=256, dt_softplus=True).compile()
    y = torch.empty_like(core["x"])
    fwd.execute(*core.values(), y, torch.empty(2, h, p, n, device=DEVICE), fwd.allocate_saved(),
                workspace=fwd.allocate_workspace())
    row = {k: v[1:].contiguous() if k != "A" else v for k, v in core.items()}
    alone = fusedops.mamba2_chunk_scan_forward(*row.values(), 256, dt_softplus=True)["y"]
    assert torch.equal(y[1:], alone)
