"""Mamba2 chunked scan: the math. The reference against float64 oracles and gradcheck, every backend against the
reference, edge cases and invalid index data (what each backend computes from them).
"""

from __future__ import annotations

import pytest
import torch

import fusedops
import fusedops.ops
from fusedops.core.status import Status
from fusedops.mamba2_scan import samples
from fusedops.mamba2_scan.info import INFO
from fusedops.mamba2_scan.oracle import mamba2_sequential
from fusedops.testing import assert_close

from helpers import DEVICE, dtype_id

from .support import (CPU, FORWARD_NAMES, GRADS, KERNEL_TOLERANCE, SCAN_BACKENDS, SEQ_IDX,
                      _scan_with_status, _seq_case, _seq_run, _with_cu, compare, run)


FLOAT64 = INFO.tolerance("y", torch.float64)


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


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("index", range(len(samples.EDGE)),
                         ids=["one-token", "one-chunk", "chunk-plus-one", "empty-sequences",
                              "heads-equal-groups-recompute"])
def test_edge_cases_match_oracle(backend, dtype, index):
    case = INFO.cases("edge", dtype=dtype, device=DEVICE)[index]
    compare(run(case, backend), INFO.oracle(case), INFO.tolerance("y", dtype))


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
def test_accumulate_adds_parameter_gradients(backend):
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=11, device=DEVICE, D="hp",
                        dt_bias=True)
    base = run(case, backend)
    ones = {k: torch.ones_like(base[k]) for k in ("dA", "dD", "ddt_bias")}
    accumulated = run(case, backend, accumulate=True, grads=ones)
    for k in ("dA", "dD", "ddt_bias"):
        assert_close(accumulated[k], base[k] + 1, KERNEL_TOLERANCE[torch.float32], k)
    assert torch.equal(accumulated["dx"], base["dx"])


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
