"""Routed ReLU2 MoE: the math. The reference against float64 oracles and gradcheck, every backend against the
reference, edge cases and invalid index data (what each backend computes from them).
"""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops import ReLU2MoEBackward, ReLU2MoEForward
from fusedops.core.status import Status, read_status
from fusedops.errors import ValidationError
from fusedops.relu2_moe import oracle
from fusedops.relu2_moe.info import EXPERT_TOLERANCE, INFO
from fusedops.relu2_moe.samples import fuzz_cases, router_logits
from fusedops.opinfo import Tolerance
from fusedops.testing import assert_close, errors
from fusedops.testing.fuzz import run_guarded

from helpers import DEVICE, check_against_oracle, dtype_id

from .support import (BACKENDS, EXPERT_NAMES, KERNELS, _bad_ids_case, _status, compare,
                      experts_case, run_experts)


GRAD_NAMES = ("d_x", "d_topk_weights", "d_w_up", "d_w_down", "d_shared_w_up", "d_shared_w_down")

EXPERT_DTYPES = {"torch": [torch.float64, torch.float32],
                 "triton": [torch.float32, torch.float16, torch.bfloat16]}


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
