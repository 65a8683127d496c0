"""Mamba2 chunked scan (docs/mamba2.md): the reference against the float64 recurrence, gradcheck
and transformers; every backend against the reference and the oracle; conventions at the kinks;
validation; GPU checks. The plan contract (execute checks, no torch op in execute, descs, repr,
graph capture) is tested for every plan in test_plan_contract.py."""

from __future__ import annotations


import pytest
import torch

import fusedops
from fusedops import Mamba2ChunkScanBackward, Mamba2ChunkScanForward, TensorDesc
from fusedops.errors import ValidationError
from fusedops.mamba2 import samples
from fusedops.mamba2.info import INFO
from fusedops.mamba2.oracle import scan_with_gradients
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
    (dict(x=torch.zeros(2, 20, 8, 4, dtype=torch.bfloat16).transpose(2, 3)), r"x: expected a contiguous tensor"),
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
    assert fwd.problem.max_segments == 4 and fwd.problem.states_bytes == 4 * 4 * 8 * 8 * 4
    assert fwd.saved_size == 0 and fwd.saved_states_bytes == fwd.problem.states_bytes


def _descs(b, l, h, p, g, n, *, nseq=None, z=True, dtype=torch.bfloat16):
    d = lambda *shape, dt=dtype: TensorDesc(shape, dt, device="cpu")  # noqa: E731
    return dict(x=d(b, l, h, p), dt=d(b, l, h), A=d(h, dt=torch.float32), B=d(b, l, g, n),
                C=d(b, l, g, n), D=d(h, dt=torch.float32), z=d(b, l, h, p) if z else None,
                dt_bias=d(h, dt=torch.float32),
                cu_seqlens=None if nseq is None else d(nseq + 1, dt=torch.int32))


def test_saved_and_workspace_formulas():
    """The Triton program's saved buffer: the segment-start states (unless recomputed) and y
    before the gate; the forward and backward declare the same layout."""
    pytest.importorskip("triton")
    descs = _descs(2, 8192, 128, 64, 8, 128)
    fwd = Mamba2ChunkScanForward(**descs, chunk_size=256, dt_softplus=True, backend="torch")
    p = fwd.problem
    assert p.max_segments == 64 and p.states_bytes == 64 * 128 * 64 * 128 * 4
    triton_fwd = fwd.kernel_program("triton")
    assert triton_fwd.saved.size == p.states_bytes + 2 * 8192 * 128 * 64 * 2
    bwd = Mamba2ChunkScanBackward(**descs, dy=descs["x"], chunk_size=256, dt_softplus=True,
                                  backend="torch")
    assert bwd.kernel_program("triton").saved.size == triton_fwd.saved.size
    recompute = Mamba2ChunkScanForward(**descs, chunk_size=256, recompute_states=True, backend="torch")
    assert recompute.kernel_program("triton").saved.size == 2 * 8192 * 128 * 64 * 2
    assert recompute.saved_states_bytes == 0
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
                "dfinal_ptr", "dh0_ptr", "dD_part_ptr", "dbias_part_ptr", "dbias_ptr", "dD_ptr"}
    for plan in plans:
        program = plan.kernel_program("triton")
        for kernel in program.kernels:
            assert not optional & set(kernel.runtime_arg_names()), kernel.name
        assert "gate" not in " ".join(k.name for k in program.kernels)


# -- 4. GPU checks -------------------------------------------------------------------------------
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
