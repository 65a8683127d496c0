"""Engram saved-state gate: the math. The reference against float64 oracles and gradcheck, every backend against the
reference, edge cases and invalid index data (what each backend computes from them).
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedops
from fusedops import EngramGateSavedBackward
from fusedops.engram_gate import DOT_CLAMP
from fusedops.testing import assert_close

from helpers import BACKENDS, DEVICE

from .support import DTYPES, check_against_oracle, make_inputs, run_plans


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,s,d", SHAPES, ids=lambda v: str(v))
def test_backend_matches_oracle(backend, dtype, n, s, d):
    t = make_inputs(n, s, d, dtype, seed=n + s + d)
    check_against_oracle(t, run_plans(t, backend), dtype)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulate_adds_into_grad_weight(backend):
    t = make_inputs(19, 2, 64, torch.float32, seed=13)
    base = run_plans(t, backend)
    start = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    acc = run_plans(t, backend, accumulate=True, grad_weight=start.clone())
    assert_close(acc["grad_weight"], start + base["grad_weight"], torch.float32, "accumulated grad_weight")
    assert torch.equal(acc["grad_x"], base["grad_x"])
