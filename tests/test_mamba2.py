"""Mamba2 chunked scan (specs/mamba2.md): the reference against float64 recurrence, gradcheck and
transformers; every backend against the reference; conventions at the kinks; the plan contract;
GPU checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedops
from fusedops import Mamba2ChunkScanBackward, Mamba2ChunkScanForward, TensorDesc
from fusedops.errors import ValidationError

import oracles
from helpers import (DEVICE, HAS_CUDA, Tolerance, assert_close, gpu_backends, requires_cuda,
                     runnable_backends)

BACKENDS = runnable_backends()
KERNEL_BACKENDS = [b for b in BACKENDS if b not in ("torch", "cute")]
CPU = torch.device("cpu")
GRADS = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dinitial_states")

# Kernel backends against the fp32 torch reference. The Triton kernels, like mamba_ssm's, round
# the operands of their tensor-core products to the input dtype (decay-weighted C·B, dt-scaled B,
# the fp32 states), so their error is a few units of that dtype's rounding, not one.
KERNEL_TOLERANCE = {
    torch.float32: Tolerance(2e-5, 2e-4, "fp32 products, sums in another order"),
    torch.float16: Tolerance(3e-3, 2e-2, "fp16 operands of the tensor-core products"),
    torch.bfloat16: Tolerance(2.5e-2, 1e-1, "bf16 operands of the tensor-core products"),
}


def make_inputs(b, l, h, p, g, n, dtype=torch.float32, *, seed=0, device=DEVICE, D=None, z=False,
                dt_bias=False, initial_states=False, lengths=None, dfinal=False):
    """Inputs, forward options and backward extras of one problem (lengths: varlen, b = 1)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    wdt = torch.float64 if dtype == torch.float64 else torch.float32
    t = dict(x=rnd(b, l, h, p).to(device, dtype), dt=rnd(b, l, h).to(device, dtype),
             A=(-0.5 - torch.rand(h, generator=gen)).to(device, wdt),
             B=rnd(b, l, g, n).to(device, dtype), C=rnd(b, l, g, n).to(device, dtype))
    opts = {}
    nseq = b
    if lengths is not None:
        assert b == 1 and sum(lengths) == l
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        opts["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
        nseq = len(lengths)
    if D is not None:
        opts["D"] = rnd(*((h,) if D == "h" else (h, p))).to(device, wdt)
    if z:
        opts["z"] = rnd(b, l, h, p).to(device, dtype)
    if dt_bias:
        opts["dt_bias"] = (0.5 * rnd(h)).to(device, wdt)
    if initial_states:
        opts["initial_states"] = rnd(nseq, h, p, n).to(device, wdt)
    extra = dict(dy=rnd(b, l, h, p).to(device, dtype))
    if dfinal:
        extra["dfinal_states"] = rnd(nseq, h, p, n).to(device, wdt)
    return t, opts, extra


def run(backend, t, opts, extra, chunk, dt_softplus=True, dt_limit=(0.0, math.inf), **plan_options):
    """Forward and backward through the plans with caller buffers; returns all outputs."""
    fwd = Mamba2ChunkScanForward(*t.values(), chunk_size=chunk, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit, backend=backend, **opts, **plan_options).compile()
    y = torch.empty(fwd.desc("y").shape, dtype=fwd.desc("y").dtype, device=t["x"].device)
    fin = torch.empty(fwd.desc("final_states").shape, dtype=fwd.desc("final_states").dtype,
                      device=t["x"].device)
    saved = fwd.allocate_saved()
    fwd.execute(*t.values(), y, fin, saved, **opts, workspace=fwd.allocate_workspace())
    bwd_opts = dict(opts)
    if "dfinal_states" in extra:
        bwd_opts["dfinal_states"] = extra["dfinal_states"]
    bwd = Mamba2ChunkScanBackward(*t.values(), extra["dy"], chunk_size=chunk, dt_softplus=dt_softplus,
                                  dt_limit=dt_limit, backend=backend, **bwd_opts,
                                  **plan_options).compile()
    grads = {k: torch.empty(bwd.desc(k).shape, dtype=bwd.desc(k).dtype, device=t["x"].device)
             for k in bwd.gradient_names}
    bwd.execute(*t.values(), extra["dy"], saved, **grads, **bwd_opts,
                workspace=bwd.allocate_workspace())
    assert fwd.selected_backend == bwd.selected_backend == backend
    return dict(y=y, final_states=fin, **grads)


def oracle(t, opts, extra, dt_softplus=True, dt_limit=(0.0, math.inf)):
    """float64 recurrence outputs and gradients (by autograd) of the same problem."""
    leaves = {k: v.detach().double().requires_grad_() for k, v in {**t, **opts}.items()
              if k != "cu_seqlens"}
    y, final = oracles.mamba2_sequential(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], D=leaves.get("D"),
        z=leaves.get("z"), dt_bias=leaves.get("dt_bias"), dt_softplus=dt_softplus, dt_limit=dt_limit,
        initial_states=leaves.get("initial_states"), cu_seqlens=opts.get("cu_seqlens"))
    loss = (y * extra["dy"].double()).sum()
    if "dfinal_states" in extra:
        loss = loss + (final * extra["dfinal_states"].double()).sum()
    names = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
             "dt_bias": "ddt_bias", "initial_states": "dinitial_states"}
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(y=y, final_states=final, **{names[k]: g for k, g in zip(leaves, grads)})


def compare(result, expected, tolerance, names=None):
    for name in names or expected:
        if name in result:
            assert_close(result[name], expected[name], tolerance, name)


CONFIGS = {
    "plain": dict(shape=(2, 37, 4, 8, 2, 16), chunk=16, options={}),
    "all-options": dict(shape=(2, 37, 4, 8, 2, 16), chunk=16,
                        options=dict(D="h", z=True, dt_bias=True, initial_states=True, dfinal=True)),
    "D-per-channel": dict(shape=(1, 40, 2, 8, 1, 8), chunk=16, options=dict(D="hp", z=True)),
    "varlen": dict(shape=(1, 41, 4, 8, 2, 8), chunk=16,
                   options=dict(lengths=[5, 0, 16, 1, 19], D="h", z=True, dt_bias=True,
                                initial_states=True, dfinal=True)),
    "multi-tile": dict(shape=(1, 150, 2, 8, 1, 8), chunk=128, options=dict(D="h", initial_states=True)),
    "odd-dims": dict(shape=(2, 21, 3, 20, 1, 24), chunk=16, options=dict(D="hp", dt_bias=True)),
}


# -- 1. the reference against independent float64 math ------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_float64_recurrence(name):
    cfg = CONFIGS[name]
    t, opts, extra = make_inputs(*cfg["shape"], torch.float64, seed=1, device=CPU, **cfg["options"])
    expected = oracle(t, opts, extra)
    compare(run("torch", t, opts, extra, cfg["chunk"]), expected,
            Tolerance(1e-11, 1e-10, "float64 chunked vs float64 recurrence"))


def test_reference_dt_limit_and_softplus_threshold():
    """dt + bias exactly at 20 (softplus' derivative sigmoid) and above (1), and dt at the clamp
    bounds exactly (the gradient passes) and outside (it does not)."""
    t, opts, extra = make_inputs(1, 12, 2, 4, 1, 4, torch.float64, seed=2, device=CPU, dt_bias=True)
    t["dt"][0, :4, 0] = torch.tensor([20.0, 20.5, 19.5, 25.0], dtype=torch.float64) - opts["dt_bias"][0]
    compare(run("torch", t, opts, extra, 16), oracle(t, opts, extra),
            Tolerance(1e-11, 1e-10, "float64"))
    t, opts, extra = make_inputs(1, 12, 2, 4, 1, 4, torch.float64, seed=3, device=CPU)
    t["dt"][0, :6, 0] = torch.tensor([0.25, 1.5, 0.2, 1.6, 0.25, 1.0], dtype=torch.float64)
    limit = (0.25, 1.5)
    r = run("torch", t, opts, extra, 16, dt_softplus=False, dt_limit=limit)
    compare(r, oracle(t, opts, extra, dt_softplus=False, dt_limit=limit), Tolerance(1e-11, 1e-10, "float64"))
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
    t, opts, _ = make_inputs(1, l, 2, 2, 1, 3, torch.float64, seed=4, device=CPU, D="h", z=True,
                             dt_bias=True, initial_states=True, lengths=lengths)
    args = [t["x"], t["dt"], t["A"], t["B"], t["C"], opts["D"], opts["z"], opts["dt_bias"],
            opts["initial_states"]]
    args = [a.requires_grad_() for a in args] + [opts.get("cu_seqlens")]
    assert torch.autograd.gradcheck(_ScanThroughPlans.apply, args, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_transformers_mamba2_chunk_scan(backend):
    """transformers' pure-torch NemotronH scan (fp32), forward and through autograd backward."""
    if backend == "cute":
        pytest.skip("no cute scan")
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    t, opts, extra = make_inputs(2, 45, 4, 8, 2, 16, torch.float32, seed=5, D="h", dt_bias=True,
                                 initial_states=True, dfinal=True)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in {**t, **opts}.items()}
    y, final = modeling.mamba2_chunk_scan(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], 16, D=leaves["D"],
        dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"], dt_softplus=True,
        return_final_states=True)
    grads = torch.autograd.grad((y * extra["dy"]).sum() + (final * extra["dfinal_states"]).sum(),
                                list(leaves.values()))
    names = dict(x="dx", dt="ddt", A="dA", B="dB", C="dC", D="dD", dt_bias="ddt_bias",
                 initial_states="dinitial_states")
    expected = dict(y=y, final_states=final, **{names[k]: g for k, g in zip(leaves, grads)})
    tol = KERNEL_TOLERANCE[torch.float32]
    compare(run(backend, t, opts, extra, 16), expected, tol)


# -- 2. every backend against the reference ------------------------------------------------------
KERNEL_CASES = [
    ("all-options", torch.float32, {}), ("varlen", torch.float32, {}),
    ("plain", torch.float32, dict(dt_limit=(0.5, 1.5))), ("D-per-channel", torch.float32, {}),
    ("multi-tile", torch.float32, {}), ("odd-dims", torch.float32, {}),
    ("all-options", torch.float16, {}), ("all-options", torch.bfloat16, {}),
    ("varlen", torch.float32, dict(recompute_states=True)),
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name,dtype,extra_options", KERNEL_CASES,
                         ids=[f"{n}-{str(d).removeprefix('torch.')}{'-' + '-'.join(o) if o else ''}"
                              for n, d, o in KERNEL_CASES])
def test_kernels_match_reference(backend, name, dtype, extra_options):
    cfg = CONFIGS[name]
    t, opts, extra = make_inputs(*cfg["shape"], dtype, seed=6, **cfg["options"])
    limit = extra_options.get("dt_limit", (0.0, math.inf))
    plan_options = {k: v for k, v in extra_options.items() if k != "dt_limit"}
    expected = run("torch", t, opts, extra, cfg["chunk"], dt_limit=limit)
    compare(run(backend, t, opts, extra, cfg["chunk"], dt_limit=limit, **plan_options), expected,
            KERNEL_TOLERANCE[dtype])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_kernels_at_dt_limits_and_softplus_threshold(backend):
    t, opts, extra = make_inputs(1, 20, 2, 8, 1, 8, torch.float32, seed=7)
    t["dt"][0, :6, 0] = torch.tensor([0.25, 1.5, 0.2, 1.6, 0.25, 1.0])
    limit = (0.25, 1.5)
    expected = run("torch", t, opts, extra, 16, dt_softplus=False, dt_limit=limit)
    result = run(backend, t, opts, extra, 16, dt_softplus=False, dt_limit=limit)
    compare(result, expected, KERNEL_TOLERANCE[torch.float32])
    assert [bool(v != 0) for v in result["ddt"][0, :4, 0]] == [True, True, False, False]
    t, opts, extra = make_inputs(1, 20, 2, 8, 1, 8, torch.float32, seed=8)
    t["dt"][0, :4, 1] = torch.tensor([20.0, 20.5, 19.5, -30.0])
    compare(run(backend, t, opts, extra, 16), run("torch", t, opts, extra, 16),
            KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_positive_log_decay_stays_finite(backend):
    """dt·A > 0 (negative dt through dt_limit) grows the state; exponents of decay differences
    are clamped to <= 0, so nothing overflows, and the backends agree."""
    if backend == "cute":
        pytest.skip("no cute scan")
    t, opts, extra = make_inputs(1, 64, 2, 8, 1, 8, torch.float32, seed=9, initial_states=True)
    t["dt"] = (-20.0 * torch.rand(1, 64, 2, generator=torch.Generator().manual_seed(9))).to(DEVICE)
    limit = (-30.0, 30.0)
    result = run(backend, t, opts, extra, 16, dt_softplus=False, dt_limit=limit)
    for name, value in result.items():
        assert torch.isfinite(value).all(), name
    if backend != "torch":
        compare(result, run("torch", t, opts, extra, 16, dt_softplus=False, dt_limit=limit),
                KERNEL_TOLERANCE[torch.float32], ("y", "final_states"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bitwise_reproducible(backend):
    if backend == "cute":
        pytest.skip("no cute scan")
    cfg = CONFIGS["varlen"]
    t, opts, extra = make_inputs(*cfg["shape"], torch.float32, seed=10, **cfg["options"])
    first, second = run(backend, t, opts, extra, 16), run(backend, t, opts, extra, 16)
    for name in first:
        assert torch.equal(first[name], second[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_adds_parameter_gradients(backend):
    if backend == "cute":
        pytest.skip("no cute scan")
    t, opts, extra = make_inputs(1, 20, 2, 8, 1, 8, torch.float32, seed=11, D="hp", dt_bias=True)
    base = run(backend, t, opts, extra, 16)
    bwd = Mamba2ChunkScanBackward(*t.values(), extra["dy"], chunk_size=16, dt_softplus=True,
                                  accumulate=True, backend=backend, **opts).compile()
    fwd = Mamba2ChunkScanForward(*t.values(), chunk_size=16, dt_softplus=True, backend=backend,
                                 **opts).compile()
    saved = fwd.allocate_saved()
    fwd.execute(*t.values(), torch.empty_like(t["x"]), torch.empty(1, 2, 8, 8, device=DEVICE), saved,
                **opts, workspace=fwd.allocate_workspace())
    grads = {k: (torch.ones if k in ("dA", "dD", "ddt_bias") else torch.empty)(
        bwd.desc(k).shape, dtype=bwd.desc(k).dtype, device=DEVICE) for k in bwd.gradient_names}
    bwd.execute(*t.values(), extra["dy"], saved, **grads, **opts, workspace=bwd.allocate_workspace())
    for k in ("dA", "dD", "ddt_bias"):
        assert_close(grads[k], base[k] + 1, KERNEL_TOLERANCE[torch.float32], k)
    assert torch.equal(grads["dx"], base["dx"])


# -- 3. the plan contract ------------------------------------------------------------------------
def _base_inputs(**kw):
    t, opts, extra = make_inputs(2, 20, 4, 8, 2, 8, torch.bfloat16, seed=12, **kw)
    return t, opts, extra


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(2, 20, 32, dtype=torch.bfloat16)), r"x: expected a 4-d tensor \[b, l, h, p\]"),
    (dict(dt=torch.zeros(2, 20, 4, dtype=torch.float16)), r"dt: expected dtype bfloat16 or float32, got float16"),
    (dict(A=torch.zeros(4, dtype=torch.bfloat16)), r"A: expected dtype float32, got bfloat16"),
    (dict(B=torch.zeros(2, 20, 3, 8, dtype=torch.bfloat16)), r"B: expected shape \[b, l, g, n\] with .* g >= 1 dividing h = 4"),
    (dict(C=torch.zeros(2, 20, 2, 4, dtype=torch.bfloat16)), r"C: expected shape \[b, l, g, n\] like B = \[2, 20, 2, 8\]"),
    (dict(chunk_size=48), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got 48"),
    (dict(D=torch.zeros(3)), r"D: expected shape \[h\] = \[4\] or \[h, p\] = \[4, 8\], got \[3\]"),
    (dict(initial_states=torch.zeros(3, 4, 8, 8)), r"initial_states: expected shape \[b, h, p, n\] = \[2, 4, 8, 8\]"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), r"x: expected b == 1 with cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int64)), r"cu_seqlens: expected dtype int32, got int64"),
    (dict(dt_limit=(1.0, 0.5)), r"dt_limit: expected lo <= hi"),
    (dict(x=torch.zeros(2, 20, 8, 4, dtype=torch.bfloat16).transpose(2, 3)), r"x: expected a contiguous tensor"),
])
def test_construction_errors(change, match):
    t, opts, _ = _base_inputs()
    args = dict(t, chunk_size=16)
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    with pytest.raises(ValidationError, match=match):
        Mamba2ChunkScanForward(**args, backend="torch")


def test_execute_errors_and_properties():
    t, opts, extra = _base_inputs(z=True)
    fwd = Mamba2ChunkScanForward(*t.values(), chunk_size=16, z=opts["z"], backend="torch").compile()
    y = torch.empty_like(t["x"])
    fin = torch.empty(2, 4, 8, 8, device=DEVICE)
    with pytest.raises(ValidationError, match=r"z: expected a torch.Tensor, got NoneType"):
        fwd.execute(*t.values(), y, fin, fwd.allocate_saved())
    with pytest.raises(ValidationError, match=r"D: this plan was built without D"):
        fwd.execute(*t.values(), y, fin, fwd.allocate_saved(), z=opts["z"], D=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValidationError, match=r"y: must not overlap x"):
        fwd.execute(*t.values(), t["x"], fin, fwd.allocate_saved(), z=opts["z"])
    assert fwd.problem.max_segments == 4 and fwd.problem.states_bytes == 4 * 4 * 8 * 8 * 4


def test_saved_and_workspace_formulas():
    pytest.importorskip("triton")
    from fusedops.backends.triton import mamba2 as kernels
    from fusedops.mamba2 import ScanProblem
    p = ScanProblem(torch.bfloat16, torch.bfloat16, 2, 8192, 128, 64, 8, 128, 256, None, True, False,
                    True, True, True, (0.0, math.inf), False, False, False, False, CPU)
    assert p.max_segments == 64 and p.states_bytes == 64 * 128 * 64 * 128 * 4
    assert kernels.saved_size(p) == p.states_bytes + 2 * 8192 * 128 * 64 * 2
    recompute = ScanProblem(**{**p.__dict__, "recompute_states": True})
    assert kernels.saved_size(recompute) == 2 * 8192 * 128 * 64 * 2
    varlen = ScanProblem(**{**p.__dict__, "batch": 1, "num_sequences": 10})
    assert varlen.max_segments == 32 + 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_plans_from_descs_and_no_torch_op_in_execute(backend):
    if backend == "cute":
        pytest.skip("no cute scan")
    t, opts, extra = _base_inputs(D="h", z=True)
    descs = {k: TensorDesc.from_tensor(v) for k, v in {**t, **opts}.items()}
    fwd = Mamba2ChunkScanForward(descs["x"], descs["dt"], descs["A"], descs["B"], descs["C"],
                                 chunk_size=16, D=descs["D"], z=descs["z"], backend=backend).compile()
    y, fin, saved, ws = (torch.empty_like(t["x"]), torch.empty(2, 4, 8, 8, device=DEVICE),
                         fwd.allocate_saved(), fwd.allocate_workspace())
    calls = []

    class NoTorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"execute() dispatched {func}")
    fwd._launch = lambda tensors, stream: calls.append(sorted(k for k, v in tensors.items() if v is not None))
    with NoTorchOps():
        fwd.execute(*t.values(), y, fin, saved, **opts, workspace=ws)
    assert calls and "y" in calls[0] and "saved" in calls[0]


# -- 4. GPU checks -------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in gpu_backends() if b == "triton"])
@pytest.mark.parametrize("chunk", [128, 256])
def test_gpu_nemotron_shape_bf16(backend, chunk):
    """h=128 p=64 n=128 g=8 in bf16 against the fp32 torch reference."""
    t, opts, extra = make_inputs(2, 2048, 128, 64, 8, 128, torch.bfloat16, seed=20, D="h", z=True,
                                 dt_bias=True, initial_states=True, dfinal=True)
    compare(run(backend, t, opts, extra, chunk), run("torch", t, opts, extra, chunk),
            KERNEL_TOLERANCE[torch.bfloat16])


@requires_cuda
@pytest.mark.gpu
def test_gpu_varlen_and_graph_capture():
    t, opts, extra = make_inputs(1, 3000, 16, 64, 2, 64, torch.bfloat16, seed=21, D="h", z=True,
                                 dt_bias=True, initial_states=True, dfinal=True,
                                 lengths=[700, 1, 0, 256, 2043])
    fwd = Mamba2ChunkScanForward(*t.values(), chunk_size=256, dt_softplus=True, **opts).compile()
    bo = dict(opts, dfinal_states=extra["dfinal_states"])
    bwd = Mamba2ChunkScanBackward(*t.values(), extra["dy"], chunk_size=256, dt_softplus=True, **bo).compile()
    y, fin = torch.empty_like(t["x"]), torch.empty(fwd.desc("final_states").shape, device=DEVICE)
    saved, ws_f, ws_b = fwd.allocate_saved(), fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = {k: torch.empty(bwd.desc(k).shape, dtype=bwd.desc(k).dtype, device=DEVICE) for k in bwd.gradient_names}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fwd.execute(*t.values(), y, fin, saved, **opts, workspace=ws_f)
        with torch.cuda.graph(graph, stream=stream):
            fwd.execute(*t.values(), y, fin, saved, **opts, workspace=ws_f)
            bwd.execute(*t.values(), extra["dy"], saved, **grads, **bo, workspace=ws_b)
    fresh, fresh_opts, fresh_extra = make_inputs(1, 3000, 16, 64, 2, 64, torch.bfloat16, seed=22,
                                                 D="h", z=True, dt_bias=True, initial_states=True,
                                                 dfinal=True, lengths=[700, 1, 0, 256, 2043])
    for k in t:
        t[k].copy_(fresh[k])
    for k in ("D", "z", "dt_bias", "initial_states"):
        opts[k].copy_(fresh_opts[k])
    extra["dy"].copy_(fresh_extra["dy"])
    bo["dfinal_states"].copy_(fresh_extra["dfinal_states"])
    for buf in (y, fin, ws_f, ws_b, *grads.values()):
        buf.fill_(255 if buf.dtype == torch.uint8 else float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = run("triton", fresh, fresh_opts, fresh_extra, 256)
    for name, value in dict(y=y, final_states=fin, **grads).items():
        assert torch.equal(value, expected[name]), name


@requires_cuda
@pytest.mark.gpu
def test_gpu_offsets_beyond_2_31_elements():
    """b·l·h·p > 2^31: the second row of a large batch equals the same row run alone."""
    h, p, g, n = 128, 64, 8, 64
    l = 2**31 // (h * p) // 2 + 256
    t, opts, extra = make_inputs(2, l, h, p, g, n, torch.bfloat16, seed=23)
    fwd = Mamba2ChunkScanForward(*t.values(), chunk_size=256, dt_softplus=True).compile()
    y = torch.empty_like(t["x"])
    fwd.execute(*t.values(), y, torch.empty(2, h, p, n, device=DEVICE), fwd.allocate_saved(),
                workspace=fwd.allocate_workspace())
    row = {k: v[1:].contiguous() if k != "A" else v for k, v in t.items()}
    alone = fusedops.mamba2_chunk_scan_forward(*row.values(), 256, dt_softplus=True)["y"]
    assert torch.equal(y[1:], alone)
