"""Routed ReLU2 MoE (docs/relu2_moe.md): the registry's cases through router + experts against the
float64 oracle; the router and the experts against the oracle and transformers' NemotronHMoE,
gradcheck, routing edge cases (ties, empty experts, one expert for every token, t = 1, k = 1,
E not a power of two, dropped ids, u exactly 0), the device dispatch layout, absent operands
compiled out, accumulate, inference, reproducibility, validation, and the GPU (graph capture
under changing routing). The plan contract (execute checks, no torch op in execute, descs,
repr, generic graph capture) is tested for every plan in test_plan_contract.py."""

from __future__ import annotations

import dataclasses
import pytest
import torch

import fusedops
from fusedops import MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward, TensorDesc
from fusedops.core.status import Status, read_status
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.relu2_moe import oracle
from fusedops.relu2_moe.info import EXPERT_TOLERANCE, INFO
from fusedops.relu2_moe.samples import expert_inputs, fuzz_cases, router_logits
from fusedops.opinfo import Tolerance
from fusedops.testing import assert_close, errors
from fusedops.testing.fuzz import run_guarded

from helpers import BACKENDS as RUNNABLE, DEVICE, check_against_oracle, dtype_id, requires_cuda

BACKENDS = [b for b in RUNNABLE if b in INFO.backends]
KERNELS = [b for b in BACKENDS if b != "torch"]
GPU_KERNELS = KERNELS if torch.cuda.is_available() else []
GRAD_NAMES = ("d_x", "d_topk_weights", "d_w_up", "d_w_down", "d_shared_w_up", "d_shared_w_down")
EXPERT_DTYPES = {"torch": [torch.float64, torch.float32],
                 "triton": [torch.float32, torch.float16, torch.bfloat16]}


def experts_case(t, H, E, I, k, *, shared=0, dtype=torch.float32, seed=0, device=DEVICE):
    """The expert path's inputs (the family's sample generator), as a mutable dict."""
    return expert_inputs(t, H, E, I, k, shared=shared, dtype=dtype, seed=seed, device=device)


def run_experts(backend, case, **options):
    """Forward + backward of the experts through the eager wrappers."""
    fwd_args = {n: case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")}
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    out, saved = fusedops.relu2_moe_forward(**fwd_args, **shared, backend=backend, **options)
    grads = fusedops.relu2_moe_backward(**fwd_args, d_out=case["d_out"], saved=saved, **shared,
                                        backend=backend)
    return dict(out=out, **grads)


def compare(result, expected, tolerance, names=None):
    for name in names or expected:
        assert_close(result[name], expected[name].to(result[name].device), tolerance, name)


# -- 0. the registry's cases: router -> experts -> backward -> router backward ------------------
@pytest.mark.parametrize("backend,dtype", [(b, d) for b in BACKENDS for d in EXPERT_DTYPES[b]],
                         ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else v)
@pytest.mark.parametrize("kind", INFO.sample_kinds)
def test_cases_match_oracle(backend, dtype, kind):
    for case in INFO.cases(kind, dtype=dtype, device=DEVICE, backend=backend):
        results = INFO.run(case, backend)
        assert set(results) == set(INFO.oracle(case)), case.label
        check_against_oracle(INFO, case, results)


# -- 1. router -------------------------------------------------------------------------------------
ROUTER_CASES = {
    "nano-like": dict(E=12, k=3, bias=True, scale=2.5),
    "grouped": dict(E=12, k=3, n_group=4, topk_group=2, bias=True),
    "k1-no-norm": dict(E=8, k=1, norm=False, scale=2.5),
    "all-experts": dict(E=5, k=5),
    "groups-of-two": dict(E=6, k=2, n_group=3, topk_group=1),
}


def router_inputs(t, E, *, bias, seed=0, dtype=torch.float32):
    return router_logits(t, E, bias=bias, seed=seed, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ROUTER_CASES)
def test_router_matches_oracle(backend, name):
    c = ROUTER_CASES[name]
    logits, bias = router_inputs(37, c["E"], bias=c.get("bias", False))
    opts = dict(n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
                norm_topk_prob=c.get("norm", True), routed_scaling_factor=c.get("scale", 1.0))
    w, ids = fusedops.moe_router(logits, c["k"], correction_bias=bias, backend=backend, **opts)
    ew, eids = oracle.router(logits.cpu(), c["k"], None if bias is None else bias.cpu(),
                             opts["n_group"], opts["topk_group"], opts["norm_topk_prob"],
                             opts["routed_scaling_factor"])
    assert ids.dtype == torch.int32 and torch.equal(ids.cpu().long(), eids)
    assert_close(w, ew, Tolerance(1e-6, 1e-6, "fp32 sigmoid and normalisation"), "topk_weights")
    d_w = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    leaf = logits.detach().cpu().double().requires_grad_()
    expected = torch.autograd.grad(oracle.router(leaf, c["k"], None if bias is None else bias.cpu(),
                                                      opts["n_group"], opts["topk_group"],
                                                      opts["norm_topk_prob"],
                                                      opts["routed_scaling_factor"])[0],
                                   leaf, d_w.cpu().double())[0]
    d_logits = fusedops.moe_router_backward(logits, ids, d_w, norm_topk_prob=opts["norm_topk_prob"],
                                            routed_scaling_factor=opts["routed_scaling_factor"],
                                            backend=backend)["d_logits"]
    assert_close(d_logits, expected, Tolerance(1e-6, 1e-6, "fp32 sigmoid derivative"), "d_logits")
    assert (d_logits.cpu() != 0).sum(-1).le(c["k"]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_ties_go_to_the_lower_index(backend):
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = logits[1, 6] = 1.0           # a tie at the top
    w, ids = fusedops.moe_router(logits, 3, backend=backend)
    assert ids.tolist() == [[0, 1, 2], [5, 6, 0], [0, 1, 2]]
    assert torch.allclose(w[0].cpu(), torch.full((3,), 1 / 3))
    # tied groups: every group scores the same, the lower groups win
    w, ids = fusedops.moe_router(torch.zeros(2, 8, device=DEVICE), 2, n_group=4, topk_group=2,
                                 backend=backend)
    assert ids.tolist() == [[0, 1], [0, 1]]
    # the bias decides the selection, the weights stay the unbiased scores
    bias = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 1.0], device=DEVICE)
    w, ids = fusedops.moe_router(torch.zeros(1, 8, device=DEVICE), 2, correction_bias=bias,
                                 norm_topk_prob=False, backend=backend)
    assert ids.tolist() == [[7, 0]] and torch.allclose(w.cpu(), torch.tensor([[0.5, 0.5]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_reads_half_precision_logits(backend, dtype):
    logits, bias = router_inputs(21, 16, bias=True, dtype=dtype)
    w, ids = fusedops.moe_router(logits, 4, correction_bias=bias, backend=backend)
    ew, eids = oracle.router(logits.cpu().float(), 4, bias.cpu())
    assert torch.equal(ids.cpu().long(), eids)
    assert_close(w, ew, Tolerance(1e-6, 1e-6, "fp32 math on the given logits"), "topk_weights")
    d = fusedops.moe_router_backward(logits, ids, torch.ones_like(w), backend=backend)["d_logits"]
    assert d.dtype == dtype


class _Router(torch.autograd.Function):
    """The router's weights as a function of the logits through the plans (ids held fixed)."""

    @staticmethod
    def forward(ctx, logits, options):
        w, ids = fusedops.moe_router(logits, backend="torch", **options)
        ctx.save_for_backward(logits, ids)
        ctx.options = options
        return w

    @staticmethod
    def backward(ctx, d_w):
        logits, ids = ctx.saved_tensors
        o = ctx.options
        return fusedops.moe_router_backward(
            logits, ids, d_w.contiguous(), norm_topk_prob=o["norm_topk_prob"],
            routed_scaling_factor=o["routed_scaling_factor"], backend="torch")["d_logits"], None


@pytest.mark.parametrize("norm", [True, False])
def test_router_gradcheck_float64(norm):
    # well separated logits: a perturbation of 1e-6 never changes the selection
    logits = (torch.randperm(40, generator=torch.Generator().manual_seed(3)).double() / 8 - 2.5)
    logits = logits.reshape(5, 8).requires_grad_()
    options = dict(top_k=3, norm_topk_prob=norm, routed_scaling_factor=2.5,
                   correction_bias=torch.linspace(0, 0.01, 8, dtype=torch.float64))
    assert torch.autograd.gradcheck(lambda v: _Router.apply(v, options), (logits,))


# -- 2. experts against float64 and transformers ------------------------------------------------
@pytest.mark.parametrize("backend,dtype", [(b, d) for b in BACKENDS for d in EXPERT_DTYPES.get(b, [])])
@pytest.mark.parametrize("shared", [0, 40])
def test_experts_match_float64(backend, dtype, shared):
    case = experts_case(19, 32, 6, 48, 2, shared=shared, dtype=dtype, seed=4)
    result = run_experts(backend, case)
    compare(result, oracle.expert_results(case), EXPERT_TOLERANCE[dtype])
    for name, value in result.items():
        if name in ("d_w_up", "d_w_down", "d_shared_w_up", "d_shared_w_down"):
            assert value.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        elif name != "d_topk_weights":
            assert value.dtype == dtype


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_match_the_torch_backend(backend, dtype):
    # same rounding points; only the order of fp32 sums differs
    case = experts_case(45, 64, 7, 80, 3, shared=48, dtype=dtype, seed=5)
    expected = run_experts("torch", case)
    tol = {torch.float32: Tolerance(2e-6, 2e-5, "fp32 sums in another order"),
           torch.float16: Tolerance(1e-4, 1e-3, "an fp16 rounding of u, a or out that flips"),
           torch.bfloat16: Tolerance(8e-4, 8e-3, "a bf16 rounding of u, a or out that flips")}[dtype]
    compare(run_experts(backend, case), expected, tol)


def _nemotron_moe(H, E, I, k, shared, n_group, topk_group, seed):
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE
    config = transformers.NemotronHConfig(
        hidden_size=H, n_routed_experts=E, moe_intermediate_size=I,
        moe_shared_expert_intermediate_size=shared, num_experts_per_tok=k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5,
        mlp_hidden_act="relu2", mlp_bias=False)
    torch.manual_seed(seed)
    moe = NemotronHMoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        moe.gate.weight.mul_(4.0)
        moe.gate.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    return moe


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grouped", [False, True])
def test_matches_transformers_nemotron_h_moe(backend, grouped):
    """Router + experts + shared expert, forward and the autograd backward of every parameter
    and the input, against transformers' NemotronHMoE (fp32, tiny config)."""
    H, E, I, k, shared = 32, 6, 24, 2, 40
    moe = _nemotron_moe(H, E, I, k, shared, 3 if grouped else 1, 2 if grouped else 1, seed=6)
    x = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(7))
    d_out = torch.randn(2, 9, H, generator=torch.Generator().manual_seed(8))
    x_leaf = x.clone().requires_grad_()
    out = moe(x_leaf)
    params = dict(x=x_leaf, gate=moe.gate.weight, w_up=moe.experts.up_proj,
                  w_down=moe.experts.down_proj, shared_w_up=moe.shared_experts.up_proj.weight,
                  shared_w_down=moe.shared_experts.down_proj.weight)
    expected = dict(zip(params, torch.autograd.grad(out, list(params.values()), d_out)))
    _, hf_weights, hf_ids = moe.gate(x)

    flat = x.reshape(-1, H).to(DEVICE)
    gate_w = moe.gate.weight.detach().to(DEVICE)
    logits = flat @ gate_w.T
    weights, ids = fusedops.moe_router(
        logits, k, correction_bias=moe.gate.e_score_correction_bias.to(DEVICE),
        n_group=3 if grouped else 1, topk_group=2 if grouped else 1, routed_scaling_factor=2.5,
        backend=backend)
    # transformers' top-k is unordered: compare the selections as sorted sets first
    order = torch.sort(hf_ids, dim=-1).indices
    assert torch.equal(torch.sort(ids.cpu().long(), -1).values, hf_ids.gather(1, order))
    assert_close(torch.sort(weights.cpu(), -1).values, torch.sort(hf_weights.detach(), -1).values,
                 Tolerance(1e-6, 1e-6, "fp32 router"), "topk_weights")
    detached = {n: p.detach().to(DEVICE) for n, p in params.items() if n not in ("x", "gate")}
    case = dict(x=flat, topk_ids=ids, topk_weights=weights, d_out=d_out.reshape(-1, H).to(DEVICE),
                **detached)
    r = run_experts(backend, case)
    d_logits = fusedops.moe_router_backward(logits, ids, r["d_topk_weights"],
                                            routed_scaling_factor=2.5, backend=backend)["d_logits"]
    tol = Tolerance(1e-5, 5e-5, "fp32, another summation order")
    assert_close(r["out"].reshape(out.shape), out.detach(), tol, "out")
    assert_close(r["d_x"] + d_logits @ gate_w, expected["x"].reshape(-1, H), tol, "d_x")
    assert_close(d_logits.T @ flat, expected["gate"], tol, "d_gate")
    for name in ("w_up", "w_down", "shared_w_up", "shared_w_down"):
        assert_close(r["d_" + name], expected[name], tol, "d_" + name)


class _Experts(torch.autograd.Function):
    """The expert path through the plans, for gradcheck."""

    @staticmethod
    def forward(ctx, x, w_up, w_down, weights, su, sd, ids):
        out, saved = fusedops.relu2_moe_forward(x, w_up, w_down, ids, weights, shared_w_up=su,
                                                shared_w_down=sd, backend="torch")
        ctx.save_for_backward(x, w_up, w_down, weights, su, sd, ids, saved)
        return out

    @staticmethod
    def backward(ctx, d_out):
        x, w_up, w_down, weights, su, sd, ids, saved = ctx.saved_tensors
        g = fusedops.relu2_moe_backward(x, w_up, w_down, ids, weights, d_out.contiguous(), saved,
                                        shared_w_up=su, shared_w_down=sd, weight_grad_dtype=torch.float64,
                                        backend="torch")
        return (g["d_x"], g["d_w_up"], g["d_w_down"], g["d_topk_weights"], g["d_shared_w_up"],
                g["d_shared_w_down"], None)


def test_experts_gradcheck_float64():
    case = experts_case(5, 6, 4, 7, 2, shared=5, dtype=torch.float64, seed=9, device="cpu")
    ids = case["topk_ids"].clone()
    ids[2, 1] = -1
    inputs = tuple(case[n].requires_grad_() for n in ("x", "w_up", "w_down", "topk_weights",
                                                      "shared_w_up", "shared_w_down"))
    assert torch.autograd.gradcheck(lambda *v: _Experts.apply(*v, ids), inputs)


def test_moe_block_gradcheck_float64():
    """Router weight, input and experts together: logits = x·W_routerᵀ -> router -> experts,
    through the plans' forward and backward, against finite differences."""
    case = experts_case(6, 5, 6, 7, 2, shared=4, dtype=torch.float64, seed=20, device="cpu")
    w_router = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(21))
    options = dict(top_k=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    logits = case["x"] @ w_router.T
    _, ids = fusedops.moe_router(logits, backend="torch", **options)
    gap = torch.sort(torch.sigmoid(logits), -1, descending=True).values
    assert (gap[:, 1] - gap[:, 2]).min() > 1e-4, "the selection must not flip under perturbation"

    def block(x, w_r, w_up, w_down, su, sd):
        weights = _Router.apply(x @ w_r.T, options)
        return _Experts.apply(x, w_up, w_down, weights, su, sd, ids)
    inputs = tuple(v.requires_grad_() for v in (case["x"], w_router, case["w_up"], case["w_down"],
                                                case["shared_w_up"], case["shared_w_down"]))
    assert torch.autograd.gradcheck(block, inputs)


# -- 3. routing edge cases -----------------------------------------------------------------------
def _edge_case(name):
    if name == "empty experts":
        case = experts_case(12, 16, 9, 24, 2, seed=10)
        case["topk_ids"] = torch.stack([torch.tensor([0, 4])[torch.randperm(2)] for _ in range(12)]).int().to(DEVICE)
    elif name == "one expert for every token":
        case = experts_case(33, 16, 5, 24, 1, seed=11)
        case["topk_ids"].fill_(3)
    elif name == "t = 1":
        case = experts_case(1, 16, 5, 24, 3, shared=8, seed=12)
    elif name == "k = 1, E = 1":
        case = experts_case(7, 16, 1, 24, 1, seed=13)
    elif name == "E = 5, k = E":
        case = experts_case(6, 16, 5, 24, 5, seed=14)
    elif name == "dropped ids":
        case = experts_case(10, 16, 6, 24, 3, seed=15)
        case["topk_ids"][0] = -1
        case["topk_ids"][3, 1] = -7
        case["topk_ids"][5, 2] = 6           # out of range: dropped
    else:  # u exactly 0: a zero token and an expert row of zeros
        case = experts_case(8, 16, 4, 24, 2, shared=8, seed=16)
        case["x"][2] = 0
        case["w_up"][:, 5] = 0
    return case


EDGE_CASES = ["empty experts", "one expert for every token", "t = 1", "k = 1, E = 1",
              "E = 5, k = E", "dropped ids", "u exactly 0"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", EDGE_CASES)
def test_routing_edge_cases(backend, name):
    case = _edge_case(name)
    result = run_experts(backend, case)
    compare(result, oracle.expert_results(case), EXPERT_TOLERANCE[torch.float32])
    dropped = (case["topk_ids"] < 0) | (case["topk_ids"] >= case["w_up"].shape[0])
    assert (result["d_topk_weights"][dropped] == 0).all()
    if name == "empty experts":
        unused = [e for e in range(9) if e not in (0, 4)]
        assert (result["d_w_up"][unused] == 0).all() and (result["d_w_down"][unused] == 0).all()
    if name == "u exactly 0":
        assert (result["d_w_up"][:, 5] == 0).all()       # d_u = 0 where u = 0
        assert (result["d_w_down"][:, :, 5] == 0).all()  # a = 0 there


@pytest.mark.parametrize("backend", KERNELS)
def test_device_dispatch_layout(backend):
    """counts, tile-padded offsets and each expert's assignments in order, read from saved."""
    case = experts_case(40, 16, 7, 24, 3, seed=17)
    case["topk_ids"][1, 0] = -1
    plan = ReLU2MoEForward(*(case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")),
                           backend=backend).compile()
    saved = plan.allocate_saved().fill_(0xFF)
    out = torch.empty_like(case["x"])
    plan.execute(*(case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")), out, saved,
                 workspace=plan.allocate_workspace())
    layout = plan.program.saved
    tile = next(s.kernel for s in plan.program.stages if s.name == "moe_offsets_kernel").constexpr("TILE")
    counts, offsets, rows = (layout.carve(saved, n).tensor().cpu() for n in ("counts", "offsets", "sorted"))
    flat = case["topk_ids"].reshape(-1).cpu()
    expected_counts = torch.bincount(flat[flat >= 0], minlength=7)
    assert torch.equal(counts, expected_counts.int())
    padded = (expected_counts + tile - 1) // tile * tile
    assert torch.equal(offsets, torch.cat([torch.zeros(1), padded.cumsum(0)]).int())
    for e in range(7):
        start = int(offsets[e])
        assert rows[start:start + int(counts[e])].tolist() == (flat == e).nonzero().flatten().tolist()
    assert plan.saved_size == layout.size


@pytest.mark.parametrize("shared,is_inference", [(0, True), (8, False)])
def test_absent_operands_are_compiled_out(shared, is_inference):
    """The Triton programs pass no placeholder for an operand a launch does not have: the shared
    expert's buffers without one, the dispatch of the dense shared GEMMs, the routing weights
    of unweighted GEMMs, u outside the dgrad-down epilogue, the rows and ids outside a
    combining epilogue are constexpr None; every tensor a stage binds is one the plan declares
    (or a piece of its workspace or saved buffer). With a shared expert its down GEMM sums the
    rows (no combine kernel); without one the combine kernel does."""
    pytest.importorskip("triton")
    case = experts_case(8, 16, 4, 24, 2, shared=shared, device="cpu")
    descs = {n: TensorDesc.from_tensor(v) for n, v in case.items()}
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared_descs = {n: descs.get(n) for n in ("shared_w_up", "shared_w_down")}
    plans = [ReLU2MoEForward(*(descs[n] for n in names), **shared_descs, is_inference=is_inference,
                             backend="torch"),
             ReLU2MoEBackward(*(descs[n] for n in names), descs["d_out"], **shared_descs,
                              backend="torch")]
    for plan in plans:
        program = plan.kernel_program("triton")
        if is_inference and isinstance(plan, ReLU2MoEForward):
            assert program.saved.size == 0
        declared = set(plan._descs) | {"workspace"}
        for stage in program.stages:
            constexprs = dict(stage.kernel.constexprs)
            bound = {v for v in stage.bind.values() if isinstance(v, str)}
            assert bound <= declared, (stage.name, bound - declared)
            if stage.name == "moe_gemm_kernel":
                routed, weighted = constexprs["ROUTED"], constexprs["WEIGHTED"]
                for arg in ("sorted_ptr", "offsets_ptr", "counts_ptr"):
                    assert (arg in constexprs) == (not routed) and (constexprs.get(arg, 0) is None) == (not routed)
                assert ("weight_ptr" in constexprs) == (not weighted)
                assert ("u_ptr" in constexprs) == (constexprs["EPILOGUE"] != 2)
                combining = constexprs["EPILOGUE"] == 3
                assert combining == (stage.bind["out_ptr"] in ("out", "d_x")) and \
                    (not combining or not routed)
                for arg in ("rows_ptr", "ids_ptr", "stride_out"):
                    assert (arg in constexprs) == (not combining)
        combines = [s for s in program.stages if s.name == "moe_combine_kernel"]
        assert len(combines) == (0 if shared else 1)
        assert any(s.name == "moe_gemm_kernel" and not dict(s.kernel.constexprs)["ROUTED"]
                   for s in program.stages) == bool(shared)


# -- 3b. tile tables, autotune candidates and the cost model ---------------------------------------
def _experts_plan(cls, case, backend="torch", **options):
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    extra = dict(d_out=case["d_out"]) if cls is ReLU2MoEBackward else {}
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    return cls(*(case[n] for n in names), **extra, **shared, backend=backend, **options)


def test_tile_tables_follow_the_arch_and_candidates_keep_the_saved_layout():
    """Every arch has an entry with its reason; the candidates start with it, never change the
    routed row tile (the dispatch padding the forward saves) and split it evenly."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.relu2_moe import program as kernels
    from fusedops.backends.triton.relu2_moe import router as router_kernels
    from fusedops.backends.triton.relu2_moe import tiles as tiles
    from fusedops.core.target import compiling_for
    for t, k in ((200, 2), (16, 1)):                   # row tile 128, then decode-sized (16)
        case = experts_case(t, 16, 4, 24, k, shared=8, device="cpu")
        fwd = _experts_plan(ReLU2MoEForward, case)
        bwd = _experts_plan(ReLU2MoEBackward, case)
        for arch, (entry, why) in tiles.TILES.items():
            assert why and tiles.ROUTER_TILES[arch][1]
            with compiling_for(arch):
                assert tiles.tiles_for(fwd.problem) == entry
                found = kernels.forward_candidates(fwd.problem)
                assert found[0] == entry and len(found) >= 3 and len(set(found)) == len(found)
                tile = tiles.row_tile(fwd.problem)
                saved = kernels.forward_program(fwd.problem).saved.size
                for config in found:
                    assert tiles.row_tile(fwd.problem, config) == tile
                    assert tile % tiles.routed_bm(fwd.problem, config) == 0
                    assert kernels.forward_program(fwd.problem, config).saved.size == saved
                    assert kernels.backward_program(bwd.problem, config).saved.size == saved
        assert router_kernels.forward_candidates(fwd.problem)[0] == tiles.ROUTER_TILES["sm_90"][0]


def _moe_problem(t, H, E, I, k, *, shared=0, accumulate=False):
    from fusedops.relu2_moe.contract import MoEProblem
    return MoEProblem(torch.bfloat16, t, H, E, I, k, shared, False, accumulate, torch.float32,
                      torch.device("cpu"))


def test_reuse_distance_counts_a_reread_within_the_l2_once():
    """docs/performance.md, "How traffic is counted": a tile loaded again by a program at most
    G programs after the previous load hits (G = half the L2 over the mean bytes a program
    moves); further apart, or a first load, it counts; a program's own bytes and stores always
    count; a program loading a tile twice counts it once."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.l2_reuse import reuse_traffic
    P, l2 = 10, 2 * 10 * 100.0                  # 100 bytes a program: G = 0.5·2000 / 100 = 10
    prog = torch.arange(P)
    zero = torch.zeros(P, dtype=torch.float64)
    stores = torch.full((P,), 50.0, dtype=torch.float64)
    every_5th = [(prog, prog % 5, torch.full((P,), 50.0))]      # key k by programs k, k + 5
    assert reuse_traffic(P, every_5th, zero, stores, l2) == (5 * 50.0, 500.0)
    assert reuse_traffic(P, every_5th, zero, stores, l2 / 4) == (10 * 50.0, 500.0)  # G = 2.5
    twice = [(torch.cat([prog, prog]), torch.zeros(2 * P, dtype=torch.int64),
              torch.full((2 * P,), 25.0))]
    assert reuse_traffic(P, twice, zero, stores, 1.0) == (25.0 * P, 500.0)     # once per program
    alone = torch.full((P,), 7.0, dtype=torch.float64)
    assert reuse_traffic(P, every_5th, alone, stores, l2)[0] == 5 * 50.0 + 70.0


def test_cost_model_follows_the_grid_order():
    """The dense GEMM (GROUP_M row tiles through every column tile, 16 column tiles of 128): at
    K = 256 a program moves 160 KiB, so G = 25 MB / 160 KiB ≈ 156 programs and x and W count
    once, even across two groups of 8 row tiles (W's column tile is re-read 121 programs later);
    at K = 16384 a program moves 8 MiB (G ≈ 3): x's row tile, re-read every GROUP_M = 8
    programs, counts once per column tile while W's column tile, re-read by the next row tile,
    counts once per group; a grid ordered row tile by row tile (GROUP_M = 1) turns that round."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.relu2_moe import cost as C
    N, BM = 2048, 128
    cases = ((1024, 256, 8, lambda x, w: x + w), (2048, 256, 8, lambda x, w: x + w),
             (1024, 16384, 8, lambda x, w: 16 * x + w), (1024, 16384, 1, lambda x, w: x + 8 * w))
    for t, K, group, expected in cases:
        p = _moe_problem(t, K, 1, N, 1, shared=N)
        cost = C.gemm_cost(p, routed=False, kdim=K, ndim=N, bm=BM, bn=128, bk=64, group_m=group,
                           grid_m_tiles=t // BM, row_tile=BM, arch="sm_90a")
        assert cost.bytes_read == expected(t * K * 2, K * N * 2), (t, K, group)
        assert cost.bytes_written == t * N * 2


def test_cost_model_at_nano_shapes():
    """At Nemotron 3 Nano's shapes (t = 8192, bf16, sm_90a): the up GEMM writes u [t·k, I] and
    nothing else (no relu(u)² buffer: the down GEMM forms it in registers); the down GEMM
    writes the weighted rows [t·k, H] in x's dtype and the shared expert's combining down GEMM
    reads them back (no combine kernel); under balanced routing each expert's 3 row tiles fall
    in one L2 group of 6, so each GEMM reads every expert's weights once, u or x's rows once
    per expert (k times per token); the routed weight gradients read the fp32 gradients once
    and write them once (accumulating), and their A and B operands once per expert. Every
    plan's floor is below its model, with the same tensor-core FLOPs to within the tiles'
    padding."""
    pytest.importorskip("triton")
    from fusedops.core.cost import total
    from fusedops.relu2_moe.samples import production
    plans = {(label, call.plan.__name__, tuple(call.options)): call.build("torch")
             for label, calls in production() for call in calls}
    fwd = plans[("moe nano t8192", "ReLU2MoEForward", ())]
    p = fwd.problem
    e, R, t, H, I, Is = 2, p.assignments, p.tokens, p.hidden, p.intermediate, p.shared_intermediate
    stages = fwd.kernel_program("triton").stages
    assert not any(s.name == "moe_combine_kernel" for s in stages)
    up, down, shared_up, shared_down = (s.kernel.cost for s in stages if s.name == "moe_gemm_kernel")
    weights, index = p.experts * H * I * e, 4 * (2 * p.experts + 1)
    rows, u = R * H * e, R * I * e
    assert up.bytes_written == u and down.bytes_written == rows
    assert up.bytes_read == pytest.approx(weights + R * (H * e + 4) + index, rel=1e-9)
    assert down.bytes_read == pytest.approx(weights + R * (I * e + 8) + index, rel=1e-9)
    assert shared_down.bytes_read > rows + t * Is * e + H * Is * e
    assert shared_down.bytes_written == t * H * e
    bwd = plans[("moe nano t8192", "ReLU2MoEBackward", ("accumulate",))]
    routed = [(dict(s.kernel.constexprs)["SPLIT"], s.kernel.cost)
              for s in bwd.kernel_program("triton").stages
              if s.name == "moe_wgrad_kernel" and dict(s.kernel.constexprs)["ROUTED"]]
    assert [split for split, _ in routed] == [1, 2, 3, 1, 2, 3]   # d_W_down, then d_W_up
    grads = p.experts * H * I * 4
    for split, wgrad in routed:           # A: u or d_u [R, I], B: d_out or x gathered [R, H]
        if split > 1:                     # balanced routing: no expert passes the chunk
            assert wgrad.bytes_written == 0 and wgrad.mma_flops == 0
            continue
        assert wgrad.bytes_written == grads
        assert grads + u + rows < wgrad.bytes_read < grads + u + rows + 0.01e9
    for key, plan in plans.items():
        costs = [k.cost for k in plan.kernel_program("triton").kernels]
        assert all(c is not None for c in costs), key
        modelled, floor = total(costs), plan.floor()
        assert floor.bytes <= modelled.bytes * 1.0001, key
        assert floor.mma_flops <= modelled.mma_flops, key
    modelled = total(s.kernel.cost for s in stages)
    assert modelled.mma_flops <= 1.05 * fwd.floor().mma_flops      # 1856 columns in 1920


@pytest.mark.parametrize("backend", KERNELS)
def test_tuning_tensors_are_a_valid_routing_and_a_real_dispatch(backend):
    """The autotune inputs: k distinct valid experts per token, and for the backward the saved
    buffer a forward wrote for them (counts that add up to t·k)."""
    case = experts_case(40, 16, 7, 24, 3, shared=8, seed=21)
    bwd = _experts_plan(ReLU2MoEBackward, case, backend=backend)
    tensors = bwd._tuning_tensors()
    ids = tensors["topk_ids"]
    assert ids.dtype == torch.int32 and ids.shape == (40, 3)
    assert ((ids >= 0) & (ids < 7)).all()
    assert all(len(set(row)) == 3 for row in ids.tolist())
    counts = bwd.program.saved.carve(tensors["saved"], "counts").tensor().cpu()
    assert torch.equal(counts, torch.bincount(ids.reshape(-1).long().cpu(), minlength=7).int())
    router = MoERouterBackward(torch.randn(40, 7, device=DEVICE), case["topk_ids"],
                               case["topk_weights"], backend=backend)
    assert ((router._tuning_tensors()["topk_ids"] < 7)).all()


@pytest.mark.parametrize("backend", KERNELS)
def test_every_candidate_computes_the_same_results(backend):
    """Each autotune candidate's forward and backward programs (other column tiles, split row
    tiles, weight-gradient steps) give the table entry's results."""
    from fusedops.backends.triton.relu2_moe import program as kernels
    case = experts_case(200, 16, 4, 24, 2, shared=8, dtype=torch.float16, seed=22)
    fwd = _experts_plan(ReLU2MoEForward, case, backend=backend).compile()
    bwd = _experts_plan(ReLU2MoEBackward, case, backend=backend).compile()
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}

    def run():
        out, saved = torch.empty_like(case["x"]), fwd.allocate_saved()
        fwd.execute(*(case[n] for n in names), out, saved, **shared,
                    workspace=fwd.allocate_workspace())
        grads = bwd.allocate_outputs()
        bwd.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                    workspace=bwd.allocate_workspace())
        return dict(out=out, **grads)
    reference = run()
    configs = kernels.forward_candidates(fwd.problem)
    assert any(c.bm_split > 1 for c in configs)
    for config in configs[1:]:
        for plan, program in ((fwd, kernels.forward_program), (bwd, kernels.backward_program)):
            plan._program = program(plan.problem, config=config)
            plan._launch = None
            plan.compile()
        result = run()
        for name, value in reference.items():     # sums in another order: another rounding
            assert_close(result[name], value, EXPERT_TOLERANCE[torch.float16], f"{config} {name}")


def _skewed_case(dtype):
    """300 tokens, 5 experts, k = 2: every token's first expert is 0 and 250 tokens' second is 1
    (every 7th token's second dropped), so experts 0 and 1 pass the split-K chunk."""
    case = experts_case(300, 32, 5, 48, 2, shared=16, dtype=dtype, seed=3)
    ids = case["topk_ids"]
    ids[:, 0] = 0
    ids[:250, 1] = 1
    ids[250:, 1] = torch.arange(50, dtype=ids.dtype, device=ids.device) % 3 + 2
    ids[::7, 1] = -1
    return case


def test_wgrad_split_items_cover_every_row_within_the_slots():
    """relu2_moe.cost.wgrad_items, the model of the split-K work table: the three launches together
    take every row of every expert exactly once, no program more than ``chunk`` rows, and the
    chunks past a split expert's first fit the slots, whatever the counts; chunk = t·k / slots
    rounded up to the K step, off where it reaches t."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.relu2_moe.cost import wgrad_items
    from fusedops.backends.triton.relu2_moe.tiles import HOPPER, wgrad_split
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        E, slots, chunk = 1 + trial % 9, 1 + trial % 8, 16 * (1 + trial % 4)
        total = chunk * slots                       # the bound chunk >= t·k / slots allows
        counts = torch.multinomial(torch.rand(E, generator=generator) ** 4, total,
                                   replacement=True, generator=generator).bincount(minlength=E)
        launches = [wgrad_items(counts, split, chunk, slots) for split in (1, 2, 3)]
        covered = torch.zeros(E, dtype=torch.int64)
        for items in launches:
            covered.index_add_(0, items.expert, items.rows)
        assert torch.equal(covered, counts), (counts, chunk, slots)
        whole, chunks, firsts = launches
        assert chunks.to_slot.all() and not (whole.to_slot.any() or firsts.to_slot.any())
        assert len(whole.expert) == E and torch.equal(whole.rows == 0, (counts > chunk) | (counts == 0))
        assert len(chunks.expert) == int(firsts.parts.sum()) <= slots
        assert int(torch.cat([items.rows for items in launches]).max()) <= chunk
    nano = _moe_problem(8192, 2688, 128, 1856, 6)
    assert wgrad_split(nano, HOPPER, 64) == (8, 6144)              # 49152 / 8
    assert wgrad_split(_moe_problem(8192, 2688, 512, 1856, 22), HOPPER, 64) == (0, 0)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skewed_routing_splits_the_weight_gradients_deterministically(backend, dtype):
    """A hot expert's rows go to split-K chunks (fp32 slots, added in chunk order): the results
    match the torch backend, repeat bit for bit, add to accumulated gradients once, and agree
    with the unsplit kernels (another order of fp32 sums)."""
    from fusedops.backends.triton.relu2_moe import program as kernels
    from fusedops.backends.triton.relu2_moe.tiles import tiles_for
    case = _skewed_case(dtype)
    bwd = _experts_plan(ReLU2MoEBackward, case, backend=backend)
    slots, chunk = kernels._wgrad_split(bwd.problem, tiles_for(bwd.problem))
    counts = torch.bincount(case["topk_ids"][case["topk_ids"] >= 0].long().cpu(), minlength=5)
    assert slots and int(counts.max()) > 2 * chunk
    expected = run_experts("torch", case)
    tol = {torch.float32: Tolerance(2e-6, 2e-5, "fp32 sums in another order"),
           torch.float16: Tolerance(1e-4, 1e-3, "an fp16 rounding of u, a or out that flips")}[dtype]
    first, second = run_experts(backend, case), run_experts(backend, case)
    compare(first, expected, tol)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}
    _, saved = fusedops.relu2_moe_forward(*(case[n] for n in names), **shared, backend=backend)
    for config in (None, dataclasses.replace(tiles_for(bwd.problem), wgrad_split_slots=0)):
        plan = _experts_plan(ReLU2MoEBackward, case, backend=backend, accumulate=True)
        if config is not None:
            plan._program = kernels.backward_program(plan.problem, config=config)
        plan.compile()
        grads = {n: torch.full(plan.desc(n).shape, 0.5, dtype=plan.desc(n).dtype, device=DEVICE)
                 for n in plan.gradient_names}
        plan.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                     workspace=plan.allocate_workspace())
        for n in ("d_w_up", "d_w_down"):
            assert_close(grads[n], first[n] + 0.5, Tolerance(1e-5, 1e-5, "fp32 sums in another "
                                                             "order"), f"{config} {n}")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("wdt", [torch.float32, torch.float16])
def test_shared_weight_gradients_in_one_launch_are_the_two_launches_bits(backend, wdt):
    """The tile table's ``dense_wgrad_pair`` (sm_90, sm_100) runs the shared expert's two weight
    gradients in one launch, the first's tiles then the second's; with it off (sm_80) they run
    as two. Same tiles, same order of sums: the same bits, accumulated onto the buffers or not,
    in fp32 or in x's dtype."""
    from fusedops.backends.triton.relu2_moe import program as kernels
    from fusedops.backends.triton.relu2_moe.tiles import tiles_for
    case = experts_case(70, 48, 4, 40, 2, shared=160, dtype=torch.float16, seed=21)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}
    _, saved = fusedops.relu2_moe_forward(*(case[n] for n in names), **shared, backend=backend)
    results = {}
    for pair in (True, False):
        for accumulate in (True, False):
            plan = _experts_plan(ReLU2MoEBackward, case, backend=backend, accumulate=accumulate,
                                 weight_grad_dtype=wdt)
            config = dataclasses.replace(tiles_for(plan.problem), dense_wgrad_pair=pair)
            plan._program = kernels.backward_program(plan.problem, config=config)
            launches = [s.name for s in plan._program.stages]
            assert launches.count("moe_dense_wgrad_pair_kernel") == pair
            assert launches.count("moe_wgrad_kernel") == 6 + 2 * (not pair)   # routed: split-K
            plan.compile()
            grads = {n: torch.full(plan.desc(n).shape, 0.5, dtype=plan.desc(n).dtype,
                                   device=DEVICE) for n in plan.gradient_names}
            plan.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                         workspace=plan.allocate_workspace())
            for n in ("d_shared_w_up", "d_shared_w_down"):
                results[pair, accumulate, n] = grads[n].float() - 0.5 * accumulate
    expected = run_experts("torch", {n: v.double() if v.is_floating_point() else v
                                     for n, v in case.items()})
    for n in ("d_shared_w_up", "d_shared_w_down"):
        for accumulate in (True, False):
            assert torch.equal(results[True, accumulate, n], results[False, accumulate, n]), n
            assert_close(results[True, accumulate, n].double(), expected[n],
                         EXPERT_TOLERANCE[torch.float16], n)


# -- 4. plan contract -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_into_main_grads_and_weight_grad_dtype(backend):
    dtype = torch.float16 if backend != "torch" else torch.float32
    case = experts_case(20, 32, 5, 40, 2, shared=24, dtype=dtype, seed=18)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = dict(shared_w_up=case["shared_w_up"], shared_w_down=case["shared_w_down"])
    fwd = ReLU2MoEForward(*(case[n] for n in names), **shared, backend=backend).compile()
    out, saved = torch.empty_like(case["x"]), fwd.allocate_saved()
    fwd.execute(*(case[n] for n in names), out, saved, **shared, workspace=fwd.allocate_workspace())
    fresh = run_experts(backend, case)
    for accumulate, wdt in ((True, torch.float32), (False, dtype)):
        bwd = ReLU2MoEBackward(*(case[n] for n in names), case["d_out"], **shared,
                               accumulate=accumulate, weight_grad_dtype=wdt, backend=backend).compile()
        assert bwd.gradient_names == GRAD_NAMES
        grads = {n: torch.empty(bwd.desc(n).shape, dtype=bwd.desc(n).dtype, device=DEVICE)
                 for n in bwd.gradient_names}
        start = {n: torch.full_like(v, 0.5) for n, v in grads.items()}
        for n in grads:
            grads[n].copy_(start[n])
        bwd.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                    workspace=bwd.allocate_workspace())
        for n in ("d_w_up", "d_w_down", "d_shared_w_up", "d_shared_w_down"):
            assert grads[n].dtype == wdt
            expected = fresh[n] + 0.5 if accumulate else fresh[n].to(wdt)
            tol = Tolerance(1e-6, 1e-6, "fp32 add") if accumulate else Tolerance(1e-3, 1e-3, "fp16 output")
            assert_close(grads[n], expected, tol, n)
        assert torch.equal(grads["d_x"], fresh["d_x"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_forward_and_reproducibility(backend):
    case = experts_case(30, 32, 6, 40, 2, shared=24, dtype=torch.float16 if backend != "torch" else torch.float32, seed=19)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = dict(shared_w_up=case["shared_w_up"], shared_w_down=case["shared_w_down"])
    plan = ReLU2MoEForward(*(case[n] for n in names), **shared, is_inference=True, backend=backend).compile()
    assert plan.saved_size == 0
    out = torch.empty_like(case["x"])
    result = plan.execute(*(case[n] for n in names), out, **shared, workspace=plan.allocate_workspace())
    assert list(result.keys()) == ["out", "saved"] and result["saved"] is None
    eager_out, eager_saved = fusedops.relu2_moe_forward(*(case[n] for n in names), **shared,
                                                        is_inference=True, backend=backend)
    first, second = run_experts(backend, case), run_experts(backend, case)
    assert eager_saved is None and torch.equal(eager_out, first["out"])
    assert torch.equal(out, first["out"])
    for name in first:
        assert torch.equal(first[name], second[name]), name
    with pytest.raises(ValidationError, match="saved: this plan was built without saved"):
        plan.execute(*(case[n] for n in names), out, torch.empty(8, dtype=torch.uint8, device=DEVICE),
                     **shared, workspace=plan.allocate_workspace())


@pytest.mark.parametrize("change,match", [
    (dict(w_down=torch.zeros(4, 24, 16)), r"w_down: expected shape \[E, H, I\] = \[4, 16, 24\], got \[4, 24, 16\]"),
    (dict(topk_ids=torch.zeros(8, 2)), r"topk_ids: expected dtype int32, got float32"),
    (dict(topk_weights=torch.zeros(8, 3)), r"topk_weights: expected shape \[t, k\] like topk_ids = \[8, 2\]"),
    (dict(topk_weights=torch.zeros(8, 2, dtype=torch.float16)), r"topk_weights: expected dtype float32"),
    (dict(w_up=torch.zeros(4, 24, 16, dtype=torch.float16)), r"w_up: expected dtype float32, got float16"),
    (dict(shared_w_up=torch.zeros(8, 16)), r"shared_w_up, shared_w_down: expected both"),
    (dict(shared_w_up=torch.zeros(8, 16), shared_w_down=torch.zeros(16, 9)),
     r"shared_w_down: expected shape \[H, I_shared\] = \[16, 8\], got \[16, 9\]"),
    (dict(x=torch.zeros(0, 16), topk_ids=torch.zeros(0, 2, dtype=torch.int32),
          topk_weights=torch.zeros(0, 2)), r"x: expected t, H >= 1"),
])
def test_experts_validation(change, match):
    case = experts_case(8, 16, 4, 24, 2)
    args = {n: case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")}
    args.update({k: v.to(DEVICE) for k, v in change.items()})
    with pytest.raises(ValidationError, match=match):
        ReLU2MoEForward(**args)


def test_backward_validation_and_float64_needs_torch():
    case = experts_case(8, 16, 4, 24, 2)
    args = [case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights", "d_out")]
    with pytest.raises(ValidationError, match=r"weight_grad_dtype: expected float32, got torch.float16"):
        ReLU2MoEBackward(*args, weight_grad_dtype=torch.float16)
    with pytest.raises(ValidationError, match=r"weight_grad_dtype: expected bfloat16 or .*, got torch.int32"):
        ReLU2MoEBackward(*args, weight_grad_dtype=torch.int32)
    f16 = experts_case(8, 16, 4, 24, 2, dtype=torch.float16)
    f16_args = [f16[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights", "d_out")]
    with pytest.raises(ValidationError, match=r"weight_grad_dtype: expected float32 or float16, got torch.bfloat16"):
        ReLU2MoEBackward(*f16_args, weight_grad_dtype=torch.bfloat16, backend="torch")
    with pytest.raises(ValidationError, match=r"accumulate: expected a bool"):
        ReLU2MoEBackward(*args, accumulate=1)
    if KERNELS:
        f64 = experts_case(8, 16, 4, 24, 2, dtype=torch.float64)
        with pytest.raises(UnsupportedError, match="float64"):
            ReLU2MoEForward(*(f64[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")),
                            backend=KERNELS[0])


@pytest.mark.parametrize("options,match", [
    (dict(top_k=9), r"top_k: expected at most E = 8 experts, got 9"),
    (dict(top_k=2, n_group=3), r"n_group: expected a divisor of E = 8"),
    (dict(top_k=2, n_group=8), r"giving groups of >= 2 experts"),
    (dict(top_k=2, n_group=4, topk_group=5), r"topk_group: expected at most n_group = 4, got 5"),
    (dict(top_k=5, n_group=4, topk_group=2), r"top_k: expected at most topk_group · E / n_group = 4"),
    (dict(top_k=2, routed_scaling_factor=float("inf")), r"routed_scaling_factor: expected a finite float"),
    (dict(top_k=2, correction_bias=torch.zeros(7)), r"correction_bias: expected shape \[E\] = \[8\]"),
    (dict(top_k=0), r"top_k: expected an int >= 1, got 0"),
])
def test_router_validation(options, match):
    options = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    with pytest.raises(ValidationError, match=match):
        MoERouter(torch.zeros(4, 8, device=DEVICE), **options)
    with pytest.raises(ValidationError, match=r"topk_ids: expected \[t, k\] with t = 4 like logits and 1 <= k <= E = 8"):
        MoERouterBackward(torch.zeros(4, 8, device=DEVICE), torch.zeros(4, 9, dtype=torch.int32, device=DEVICE),
                          torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValidationError, match=r"d_topk_weights: expected shape \[t, k\] like topk_ids"):
        MoERouterBackward(torch.zeros(4, 8, device=DEVICE),
                          torch.zeros(4, 2, dtype=torch.int32, device=DEVICE),
                          torch.zeros(4, 3, device=DEVICE))


# -- 5. GPU --------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_KERNELS or ["triton"])
def test_gpu_nano_like_shapes_against_the_torch_backend(backend):
    case = experts_case(2048, 1024, 32, 512, 6, shared=1024, dtype=torch.bfloat16, seed=30)
    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(2048, 32, generator=gen).to(DEVICE)
    case["topk_weights"], case["topk_ids"] = fusedops.moe_router(logits, 6, routed_scaling_factor=2.5)
    expected = run_experts("torch", case)
    first, second = run_experts(backend, case), run_experts(backend, case)
    compare(first, expected, Tolerance(8e-3, 3e-2, "bf16 roundings of u or a that flip"))
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} not bitwise reproducible"


@requires_cuda
@pytest.mark.gpu
def test_gpu_graph_capture_with_changing_routing():
    case = experts_case(512, 256, 16, 128, 4, shared=128, dtype=torch.bfloat16, seed=32)
    logits = torch.randn(512, 16, device=DEVICE)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = dict(shared_w_up=case["shared_w_up"], shared_w_down=case["shared_w_down"])
    router = MoERouter(logits, top_k=4, routed_scaling_factor=2.5).compile()
    fwd = ReLU2MoEForward(*(case[n] for n in names), **shared).compile()
    bwd = ReLU2MoEBackward(*(case[n] for n in names), case["d_out"], **shared).compile()
    out, saved, ws_f, ws_b = (torch.empty_like(case["x"]), fwd.allocate_saved(),
                              fwd.allocate_workspace(), bwd.allocate_workspace())
    grads = {n: torch.empty(bwd.desc(n).shape, dtype=bwd.desc(n).dtype, device=DEVICE)
             for n in bwd.gradient_names}
    ids, weights = case["topk_ids"], case["topk_weights"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            router.execute(logits, weights, ids)
            fwd.execute(case["x"], case["w_up"], case["w_down"], ids, weights, out, saved, **shared,
                        workspace=ws_f)
            bwd.execute(case["x"], case["w_up"], case["w_down"], ids, weights, case["d_out"], saved,
                        **grads, **shared, workspace=ws_b)
    for skew in (0.0, 8.0):   # balanced, then almost every token to expert 3
        logits.copy_(torch.randn(512, 16, device=DEVICE))
        logits[:, 3] += skew
        graph.replay()
        torch.cuda.synchronize()
        w, i = fusedops.moe_router(logits, 4, routed_scaling_factor=2.5)
        assert torch.equal(i, ids) and torch.equal(w, weights)
        expected = run_experts("triton", dict(case, topk_ids=i, topk_weights=w))
        assert torch.equal(out, expected["out"])
        for name, value in grads.items():
            assert torch.equal(value, expected[name]), name


# -- 6. index data: dropped ids, the status word, check_inputs, NaN logits -----------------------
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1
EXPERT_NAMES = ("x", "w_up", "w_down", "topk_ids", "topk_weights")


def _status():
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def _bad_ids_case(padding_only=False):
    """E = 6, k = 3 with ids -1 (padding) and, unless ``padding_only``, E, -7 and the int32
    extremes; the dropped assignments' routing weights are NaN (they must never be read)."""
    case = experts_case(10, 16, 6, 24, 3, shared=8, seed=40)
    ids = case["topk_ids"]
    ids[0] = -1
    ids[4, 2] = -1
    if not padding_only:
        ids[3, 1], ids[5, 2], ids[6, 0], ids[7, 1] = 6, -7, INT32_MAX, INT32_MIN
    dropped = (ids < 0) | (ids >= 6)
    case["topk_weights"] = case["topk_weights"].masked_fill(dropped, float("nan"))
    return case, dropped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("padding_only", [False, True], ids=["invalid", "padding"])
def test_dropped_ids_add_nothing_and_set_the_status_bit(backend, padding_only):
    """An id outside [0, E) drops its assignment on every plan that reads topk_ids: out, d_x and
    the weight gradients are those of the kept assignments (the oracle skips the dropped ones;
    their NaN weights are never read), d_topk_weights is exactly 0 there, and the status word
    holds EXPERT_ID unless every dropped id is -1 (padding)."""
    case, dropped = _bad_ids_case(padding_only)
    expected_status = Status.OK if padding_only else Status.EXPERT_ID
    status = _status()
    args = {n: case[n] for n in EXPERT_NAMES}
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}
    out, saved = fusedops.relu2_moe_forward(**args, **shared, status=status, backend=backend)
    assert read_status(status) == expected_status
    status.zero_()
    grads = fusedops.relu2_moe_backward(**args, d_out=case["d_out"], saved=saved, **shared,
                                        status=status, backend=backend)
    assert read_status(status) == expected_status
    result = dict(out=out, **grads)
    expected = oracle.expert_results(dict(case, topk_weights=case["topk_weights"].nan_to_num(0.0)))
    compare(result, expected, EXPERT_TOLERANCE[torch.float32])
    assert (grads["d_topk_weights"][dropped] == 0).all()
    assert all(torch.isfinite(v).all() for v in result.values())

    # router backward: the dropped slots add nothing, their r counts 0 in S, d_w is not read
    logits = router_inputs(10, 6, bias=False, seed=41)[0]
    d_w = torch.randn(10, 3, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    status.zero_()
    d_logits = fusedops.moe_router_backward(logits, case["topk_ids"], d_w.masked_fill(dropped, float("nan")),
                                            routed_scaling_factor=2.5, status=status,
                                            backend=backend)["d_logits"]
    assert read_status(status) == expected_status
    leaf = logits.detach().cpu().double().requires_grad_()
    s = torch.sigmoid(leaf)
    ids, keep = case["topk_ids"].cpu().long(), ~dropped.cpu()
    r = torch.where(keep, s.gather(1, ids.clamp(0, 5)), torch.zeros((), dtype=torch.float64))
    w = 2.5 * r / (r.sum(-1, keepdim=True) + 1e-20)
    reference, = torch.autograd.grad(w, leaf, torch.where(keep, d_w.cpu().double(), 0.0))
    assert_close(d_logits, reference, Tolerance(1e-6, 1e-6, "fp32 sigmoid derivative"), "d_logits")


@pytest.mark.parametrize("backend", KERNELS)
def test_backends_agree_on_invalid_ids_under_guard_bands(backend):
    """The experts' training forward and backward (whose saved buffers differ per backend, so
    the registry's fuzz test leaves them out on kernel backends) on drawn index data, every
    buffer in guard bands: nothing outside the buffers changes, the status equals the expected
    one on both backends, and the outputs equal the torch backend's."""
    plans = ("forward", "backward")
    kernel = fuzz_cases(2026, backend, DEVICE, plans=plans)
    reference = fuzz_cases(2026, "torch", DEVICE, plans=plans)
    problems = []
    for case, ref_case in zip(kernel, reference):
        assert case.label == ref_case.label
        got, ref = run_guarded(case, backend), run_guarded(ref_case, "torch")
        if got.damaged or ref.damaged:
            problems.append(f"{case.label}: wrote outside {got.damaged + ref.damaged}")
        if got.status != case.expected or ref.status != case.expected:
            problems.append(f"{case.label}: status {got.status.describe()} / torch "
                            f"{ref.status.describe()}, expected {case.expected.describe()}")
        for name, value in got.outputs.items():
            if name == "saved":
                continue
            if not torch.isfinite(value).all():
                problems.append(f"{case.label}: {name} not finite")
            elif errors(value, ref.outputs[name])[0] > 1e-5:
                problems.append(f"{case.label}: {name} differs from the torch backend")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_backward_sums_a_repeated_id_in_slot_order(backend):
    """The router never repeats an id, but a caller may: each slot is its own term, and the
    terms of a repeated id add up (the same on every backend)."""
    logits = router_inputs(4, 8, bias=False, seed=43)[0]
    ids = torch.tensor([[1, 1, 2], [3, 0, 3], [5, 5, 5], [7, 6, 4]], dtype=torch.int32, device=DEVICE)
    d_w = torch.randn(4, 3, generator=torch.Generator().manual_seed(44)).to(DEVICE)
    leaf = logits.detach().cpu().double().requires_grad_()
    r = torch.sigmoid(leaf).gather(1, ids.cpu().long())
    for norm in (True, False):
        w = r / (r.sum(-1, keepdim=True) + 1e-20) if norm else r
        reference, = torch.autograd.grad(w, leaf, d_w.cpu().double(), retain_graph=True)
        d_logits = fusedops.moe_router_backward(logits, ids, d_w, norm_topk_prob=norm,
                                                backend=backend)["d_logits"]
        assert_close(d_logits, reference, Tolerance(1e-6, 1e-6, "fp32 sigmoid derivative"), "d_logits")


@pytest.mark.filterwarnings("ignore:invalid value encountered")   # inf + -inf, on purpose
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_nan_scores_rank_last(backend):
    """A NaN choice score ranks below every number (as -inf, ties to the lower index), a NaN
    group score likewise: the ids are always k distinct experts in [0, E) of eligible groups;
    the weights of a NaN score are NaN (with the normalisation, the whole token's)."""
    nan = float("nan")
    logits = torch.zeros(4, 8)
    logits[0] = torch.tensor([nan, 1.0, nan, 2.0, nan, nan, 0.5, nan])
    logits[1] = nan                                  # every score NaN
    logits[2, :] = torch.arange(8.0)
    logits[2, 7] = nan                               # the best logit is NaN: not selected
    logits[3] = torch.tensor([nan, nan, nan, -1.0, nan, nan, nan, nan])
    logits = logits.to(DEVICE)
    w, ids = fusedops.moe_router(logits, 3, backend=backend)
    assert ids.tolist() == [[3, 1, 6], [0, 1, 2], [6, 5, 4], [3, 0, 1]]
    assert torch.isfinite(w[0]).all() and torch.isfinite(w[2]).all()
    assert torch.isnan(w[1]).all() and torch.isnan(w[3]).all()       # normalised by a NaN sum
    w, _ = fusedops.moe_router(logits, 3, norm_topk_prob=False, backend=backend)
    assert torch.isnan(w[3]).tolist() == [False, True, True]         # NaN only where s is NaN
    # a NaN bias ranks its expert last too; the weights stay the (finite) scores
    bias = torch.tensor([nan, 0, 0, 0, 0, 0, 0, 0.0], device=DEVICE)
    w, ids = fusedops.moe_router(torch.zeros(1, 8, device=DEVICE), 8, correction_bias=bias,
                                 backend=backend)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 0]] and torch.isfinite(w).all()
    # groups (4 groups of 2, top 2 groups): NaN scores and NaN group scores (+inf + -inf) rank
    # last, ties to the lower group; no expert of a group left out is taken
    g_logits = torch.full((3, 8), nan)               # row 0: every score NaN
    g_logits[1, 6], g_logits[1, 7] = 3.0, 2.0        # row 1: only group 3 is finite
    g_logits[2] = torch.tensor([0.0, 0, 1, 1, 2, 2, 0, 0])
    g_bias = torch.zeros(8)
    g_bias[2], g_bias[3] = float("inf"), float("-inf")   # row 2: group 1 scores inf + -inf = NaN
    w, ids = fusedops.moe_router(g_logits.to(DEVICE), 4, correction_bias=g_bias.to(DEVICE),
                                 n_group=4, topk_group=2, backend=backend)
    assert ids.tolist() == [[0, 1, 2, 3], [6, 7, 0, 1], [4, 5, 0, 1]]
    for row in ids.tolist():
        assert len(set(row)) == 4 and all(0 <= e < 8 for e in row)
    expected_w, expected_ids = oracle.router(g_logits, 4, g_bias, 4, 2)
    assert torch.equal(ids.cpu().long(), expected_ids)
    assert torch.equal(torch.isnan(w.cpu()), torch.isnan(expected_w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_inputs_names_the_argument_and_entry(backend, monkeypatch):
    case, _ = _bad_ids_case()
    args = {n: case[n] for n in EXPERT_NAMES}
    message = r"topk_ids: expected entries in \[0, 6\) or -1 \(padding\), got topk_ids\[3, 1\] = 6"
    with pytest.raises(ValidationError, match=message):
        fusedops.relu2_moe_forward(**args, backend=backend, check_inputs=True)
    out, saved = fusedops.relu2_moe_forward(**args, backend=backend, check_inputs=False)
    with pytest.raises(ValidationError, match=message):
        fusedops.relu2_moe_backward(**args, d_out=case["d_out"], saved=saved, backend=backend,
                                    check_inputs=True)
    logits = torch.zeros(10, 6, device=DEVICE)
    with pytest.raises(ValidationError, match=message):
        fusedops.moe_router_backward(logits, case["topk_ids"], torch.zeros(10, 3, device=DEVICE),
                                     backend=backend, check_inputs=True)
    with pytest.raises(ValidationError, match=message):
        fusedops.ops.relu2_moe(**args, backend=backend, check_inputs=True)
    monkeypatch.setenv("FUSEDOPS_CHECK_INPUTS", "1")
    with pytest.raises(ValidationError, match=message):
        fusedops.relu2_moe_forward(**args, backend=backend)
    plan = ReLU2MoEForward(*args.values(), backend=backend)
    with pytest.raises(ValidationError, match=message):
        plan.check_index_values(topk_ids=case["topk_ids"])
    padded, _ = _bad_ids_case(padding_only=True)
    plan.check_index_values(topk_ids=padded["topk_ids"])             # -1 is padding: accepted
    fusedops.relu2_moe_forward(**{n: padded[n] for n in EXPERT_NAMES}, backend=backend)


def test_status_word_is_checked_sticky_and_compiled_out_when_absent():
    case = experts_case(8, 16, 4, 24, 2)
    args = [case[n] for n in EXPERT_NAMES]
    for bad, match in ((torch.zeros(1, dtype=torch.int64), r"status: expected dtype int32"),
                       (torch.zeros(2, dtype=torch.int32), r"status: expected shape \[1\] = \[1\]")):
        with pytest.raises(ValidationError, match=match):
            ReLU2MoEForward(*args, status=bad.to(DEVICE))
        with pytest.raises(ValidationError, match=match):
            MoERouterBackward(torch.zeros(8, 4, device=DEVICE), case["topk_ids"],
                              case["topk_weights"], status=bad.to(DEVICE))
    plan = ReLU2MoEForward(*args, backend="torch").compile()
    out, saved = torch.empty_like(case["x"]), plan.allocate_saved()
    with pytest.raises(ValidationError, match=r"status: this plan was built without status"):
        plan.execute(*args, out, saved, status=_status())
    # sticky: the word keeps the bits of earlier executes (and bits fusedops never sets)
    status = _status().fill_(0x100)
    plan = ReLU2MoEForward(*args, status=TensorDesc((1,), torch.int32, device=DEVICE),
                           backend="torch").compile()
    bad = case["topk_ids"].clone()
    bad[2, 1] = 4
    plan.execute(*args[:3], bad, args[4], out, saved, status=status)
    plan.execute(*args, out, saved, status=status)
    assert int(status.item()) == 0x100 | Status.EXPERT_ID


@pytest.mark.parametrize("call", [
    lambda c: fusedops.moe_router(c["logits"], "2"),
    lambda c: fusedops.moe_router(c["logits"], 2, n_group=2.0),
    lambda c: fusedops.moe_router(c["logits"], 2, norm_topk_prob=1),
    lambda c: fusedops.moe_router(c["logits"], 2, routed_scaling_factor="2.5"),
    lambda c: fusedops.moe_router(c["logits"], 2, backend=5),
    lambda c: fusedops.moe_router(c["logits"], 2, current_stream="now"),
    lambda c: fusedops.moe_router_backward(c["logits"], c["topk_ids"], c["topk_weights"],
                                           norm_topk_prob=None),
    lambda c: fusedops.moe_router_backward(c["logits"], c["topk_ids"], c["topk_weights"],
                                           check_inputs="yes"),
    lambda c: fusedops.relu2_moe_forward(*(c[n] for n in EXPERT_NAMES), is_inference=1),
    lambda c: fusedops.relu2_moe_forward(*(c[n] for n in EXPERT_NAMES), check_inputs=1),
    lambda c: fusedops.relu2_moe_backward(*(c[n] for n in EXPERT_NAMES), c["d_out"], c["saved"],
                                          weight_grad_dtype="float32"),
    lambda c: fusedops.relu2_moe_backward(*(c[n] for n in EXPERT_NAMES), c["d_out"], c["saved"],
                                          backend=None),
    lambda c: fusedops.ops.moe_router(c["logits"], 2.0),
    lambda c: fusedops.ops.moe_router(c["logits"], True),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, n_group="1"),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, norm_topk_prob="yes"),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, routed_scaling_factor=object()),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, backend=3),
    lambda c: fusedops.ops.relu2_moe(*(c[n] for n in EXPERT_NAMES), backend=["torch"]),
    lambda c: fusedops.ops.relu2_moe(*(c[n] for n in EXPERT_NAMES), check_inputs="no"),
], ids=lambda f: "")
def test_wrong_typed_options_raise_validation_error(call):
    case = experts_case(8, 16, 4, 24, 2)
    case["logits"] = torch.zeros(8, 4, device=DEVICE)
    case["saved"] = fusedops.relu2_moe_forward(*(case[n] for n in EXPERT_NAMES))[1]
    with pytest.raises(ValidationError, match=r"^(top_k|n_group|norm_topk_prob|routed_scaling_factor|"
                                              r"backend|current_stream|check_inputs|is_inference|"
                                              r"weight_grad_dtype): expected"):
        call(case)


# -- 6. strided activations ------------------------------------------------------------------------
STRIDED_DTYPES = {"torch": torch.float32, "triton": torch.bfloat16}


def _in_wider(tensor, extra, fill=0.0, offset=0):
    """(buffer, view): ``tensor`` [rows, width] in columns [offset, offset + width) of a wider
    buffer [rows, width + extra] filled with ``fill`` (a slice of a fused projection)."""
    rows, width = tensor.shape
    buffer = torch.full((rows, width + extra), fill, dtype=tensor.dtype, device=tensor.device)
    view = buffer[:, offset:offset + width]
    view.copy_(tensor)
    return buffer, view


def _padding_untouched(buffer, offset, width):
    """Every column of ``buffer`` outside [offset, offset + width) still NaN."""
    outside = torch.ones(buffer.shape[1], dtype=torch.bool, device=buffer.device)
    outside[offset:offset + width] = False
    return bool(torch.isnan(buffer[:, outside].float()).all())


def _router_and_experts(backend, case, logits, *, outputs=None):
    """Router, router backward, experts forward and backward through their plans with the
    given activations (x, d_out and logits: tensors or views) writing into ``outputs`` (out,
    d_x, d_logits: fresh contiguous tensors when None)."""
    names = ("w_up", "w_down", "topk_ids", "topk_weights")
    x, d_out = case["x"], case["d_out"]
    t, H = x.shape
    E, k = case["w_up"].shape[0], case["topk_ids"].shape[1]
    outputs = outputs or dict(out=torch.empty(t, H, dtype=x.dtype, device=DEVICE),
                              d_x=torch.empty(t, H, dtype=x.dtype, device=DEVICE),
                              d_logits=torch.empty(t, E, device=DEVICE))
    router = MoERouter(logits, top_k=k, routed_scaling_factor=2.5, backend=backend).compile()
    weights, ids = torch.empty(t, k, device=DEVICE), torch.empty(t, k, dtype=torch.int32, device=DEVICE)
    router.execute(logits, weights, ids)
    d_weights = torch.linspace(-1.0, 1.0, t * k, device=DEVICE).reshape(t, k)
    router_bwd = MoERouterBackward(logits, ids, d_weights, routed_scaling_factor=2.5,
                                   backend=backend).compile()
    router_bwd.execute(logits, ids, d_weights, outputs["d_logits"])
    shared = dict(shared_w_up=case["shared_w_up"], shared_w_down=case["shared_w_down"])
    params = [case[n] for n in names]
    fwd = ReLU2MoEForward(x, *params, **shared, backend=backend).compile()
    saved = fwd.allocate_saved()
    fwd.execute(x, *params, outputs["out"], saved, **shared, workspace=fwd.allocate_workspace())
    bwd = ReLU2MoEBackward(x, *params, d_out, **shared, backend=backend).compile()
    grads = {n: torch.full(bwd.desc(n).shape, float("nan"), dtype=bwd.desc(n).dtype, device=DEVICE)
             for n in bwd.gradient_names if n != "d_x"}
    bwd.execute(x, *params, d_out, saved, outputs["d_x"], grads["d_topk_weights"],
                grads["d_w_up"], grads["d_w_down"], **shared, d_shared_w_up=grads["d_shared_w_up"],
                d_shared_w_down=grads["d_shared_w_down"], workspace=bwd.allocate_workspace())
    return dict(topk_weights=weights, topk_ids=ids, saved=saved, **grads,
                **{n: v.clone() for n, v in outputs.items()})


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_go_in_and_out_without_copies(backend):
    """logits, x and d_out as views of wider buffers (router logits in the middle of a fused
    projection, x after other columns, d_out with rows 0 apart: one row broadcast to every
    token), and out, d_x and d_logits written straight into views of NaN-filled wider buffers:
    the same bits as the contiguous run, nothing written beside."""
    dtype = STRIDED_DTYPES[backend]
    case = experts_case(19, 32, 8, 48, 2, shared=40, dtype=dtype, seed=41)
    case["d_out"] = case["d_out"][3].expand(19, 32)          # row stride 0
    logits, _ = router_logits(19, 8, bias=False, seed=42, device=DEVICE)
    expected = _router_and_experts(backend, dict(case, d_out=case["d_out"].contiguous()), logits)
    _, x = _in_wider(case["x"], 40, offset=16)                 # columns [16, 48) of 72
    _, logits_view = _in_wider(logits, 28, offset=12)          # columns [12, 20) of 36
    buffers = dict(out=_in_wider(torch.empty_like(case["x"]), 8, float("nan"), offset=8),
                   d_x=_in_wider(torch.empty_like(case["x"]), 24, float("nan")),
                   d_logits=_in_wider(torch.empty_like(logits), 4, float("nan"), offset=4))
    result = _router_and_experts(backend, dict(case, x=x), logits_view,
                                 outputs={n: view for n, (_, view) in buffers.items()})
    for name, value in expected.items():
        if name == "saved" and backend != "torch":
            continue                # bytes nothing writes (row padding) differ run to run
        assert torch.equal(result[name], value), name
    for name, (buffer, view) in buffers.items():
        offset = view.storage_offset()
        assert _padding_untouched(buffer, offset, view.shape[1]), name


def test_strided_views_fill_the_same_saved_dispatch_and_u():
    """The kernels' saved buffer (dispatch and u) is the same whether x is a view or not (the
    bytes the forward writes; row padding aside)."""
    if not KERNELS:
        pytest.skip("needs a kernel backend")
    case = experts_case(19, 32, 8, 48, 2, dtype=torch.bfloat16, seed=43)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    _, x = _in_wider(case["x"], 8)
    plain = ReLU2MoEForward(*(case[n] for n in names), backend=KERNELS[0]).compile()
    layout = plain.kernel_program(KERNELS[0]).saved
    runs = []
    for xs in (case["x"], x):
        saved = torch.zeros(plain.saved_size, dtype=torch.uint8, device=DEVICE)
        plain.execute(xs, *(case[n] for n in names[1:]), torch.empty_like(case["x"]), saved,
                      workspace=plain.allocate_workspace())
        runs.append(saved)
    assert torch.equal(runs[0], runs[1]) and layout.size == plain.saved_size


def test_strides_must_keep_rows_aligned():
    """Rows of a view must start 16 bytes apart (and 16-byte aligned), the last dimension
    contiguous; a row that is not a whole number of 16-byte vectors (E = 6 fp32 logits: 24
    bytes) is taken contiguous only. The refusals name the tensor."""
    case = experts_case(8, 32, 4, 24, 2, dtype=torch.bfloat16)
    names = ("w_up", "w_down", "topk_ids", "topk_weights")
    params = [case[n] for n in names]
    misaligned = torch.zeros(8, 35, dtype=torch.bfloat16, device=DEVICE)[:, :32]  # rows 70 B apart
    with pytest.raises(ValidationError, match=r"x: expected strides of multiples of 16 bytes"):
        ReLU2MoEForward(misaligned, *params)
    with pytest.raises(ValidationError, match=r"x: expected the last dimension contiguous"):
        ReLU2MoEForward(torch.zeros(32, 8, dtype=torch.bfloat16, device=DEVICE).T, *params)
    with pytest.raises(ValidationError, match=r"x: expected .*16"):
        ReLU2MoEForward(torch.zeros(8, 48, dtype=torch.bfloat16, device=DEVICE)[:, 1:33], *params)
    with pytest.raises(ValidationError, match=r"d_out: expected strides of multiples of 16 bytes"):
        ReLU2MoEBackward(case["x"], *params, misaligned)
    plan = ReLU2MoEForward(case["x"], *params, backend="torch").compile()
    saved = plan.allocate_saved()
    with pytest.raises(ValidationError, match=r"out: expected the last dimension contiguous and "
                                              r"the other strides multiples of 16 bytes"):
        plan.execute(case["x"], *params, misaligned, saved)
    with pytest.raises(ValidationError, match=r"x: expected the last dimension contiguous and"):
        plan.execute(misaligned, *params, torch.empty_like(case["x"]), saved)
    logits = torch.zeros(8, 4, device=DEVICE)
    router_bwd = MoERouterBackward(logits, case["topk_ids"], case["topk_weights"],
                                   backend="torch").compile()
    with pytest.raises(ValidationError, match=r"d_logits: expected the last dimension contiguous"):
        router_bwd.execute(logits, case["topk_ids"], case["topk_weights"],
                           torch.zeros(8, 5, device=DEVICE)[:, :4])
    # E = 6 fp32: contiguous rows are 24 bytes apart, so logits are taken contiguous only
    odd = torch.zeros(8, 6, device=DEVICE)
    plan = MoERouter(odd, top_k=2, backend="torch").compile()
    plan.execute(odd, torch.empty(8, 2, device=DEVICE),
                 torch.empty(8, 2, dtype=torch.int32, device=DEVICE))
    wide = torch.zeros(8, 8, device=DEVICE)[:, :6]
    with pytest.raises(ValidationError, match=r"logits: expected a contiguous tensor \(a view needs "
                                              r"rows of a multiple of 16 bytes; 6 float32 "
                                              r"elements make 24\)"):
        MoERouter(wide, top_k=2)
    with pytest.raises(ValidationError, match=r"logits: expected a contiguous tensor, got strides"):
        plan.execute(wide, torch.empty(8, 2, device=DEVICE),
                     torch.empty(8, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValidationError, match=r"w_up: expected a contiguous tensor"):
        ReLU2MoEForward(case["x"], case["w_up"].transpose(1, 2).contiguous().transpose(1, 2),
                        *params[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_ops_take_views_without_copies(backend):
    """fusedops.ops.moe_router and relu2_moe take logits, x and d_out as views: forward and
    backward dispatch no aten::contiguous or aten::clone (the torch profiler's op list), with
    the same results and gradients as contiguous inputs; a layout the kernels cannot read (a
    transposed x) is copied, not refused."""
    dtype = STRIDED_DTYPES[backend]
    case = experts_case(12, 32, 8, 24, 2, shared=16, dtype=dtype, seed=44)
    logits, _ = router_logits(12, 8, bias=False, seed=45, device=DEVICE)
    params = {n: case[n].clone().requires_grad_() for n in ("w_up", "w_down")}
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}

    def run(x, logits, d_out):
        x = x.detach().requires_grad_()
        logits = logits.detach().requires_grad_()
        w, ids = fusedops.ops.moe_router(logits, 2, routed_scaling_factor=2.5, backend=backend)
        out = fusedops.ops.relu2_moe(x, params["w_up"], params["w_down"], ids, w, **shared,
                                     backend=backend)
        x_grad, logits_grad, w_up_grad = torch.autograd.grad(out, (x, logits, params["w_up"]), d_out)
        return out, x_grad, logits_grad, w_up_grad

    _, d_out = _in_wider(case["d_out"], 16, offset=8)
    expected = run(case["x"], logits, case["d_out"])
    x_view = _in_wider(case["x"], 24, offset=8)[1]             # columns [8, 40) of 56
    logits_view = _in_wider(logits, 8, offset=4)[1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = run(x_view, logits_view, d_out)
    copies = [e.key for e in prof.key_averages() if e.key in ("aten::contiguous", "aten::clone")]
    assert not copies, copies
    for got, want in zip(result, expected):
        assert torch.equal(got, want)
    assert result[0].is_contiguous() and result[1].shape == x_view.shape
    transposed = run(case["x"].T.contiguous().T, logits, case["d_out"])
    assert torch.equal(transposed[0], expected[0])
    # the fake implementations describe what the real ops return for views (contiguous outputs)
    router_args = (logits_view, None, 2, 1, 1, True, 2.5, backend)
    w, ids = torch.ops.fusedops.moe_router_fwd(*router_args)
    args = (x_view, case["w_up"], case["w_down"], ids, w, *shared.values(), backend)
    _, saved = torch.ops.fusedops.relu2_moe_fwd(*args)
    for op, op_args in ((torch.ops.fusedops.moe_router_fwd, router_args),
                        (torch.ops.fusedops.moe_router_bwd, (logits_view, ids, w, True, 2.5, backend)),
                        (torch.ops.fusedops.relu2_moe_fwd, args),
                        (torch.ops.fusedops.relu2_moe_bwd, (*args[:5], d_out, saved, *args[5:]))):
        torch.library.opcheck(op, op_args, test_utils=("test_schema", "test_faketensor"))
