"""The torch backend's hand-written Mamba2 backward (backends/torch/mamba2_scan/backward.py) against
autograd through its own forward, in float64, over every option and their combinations (packed
and sanitised sequences, sequence ids, initial and final states, state_dtype, dt_limit at and
past its bounds, positive log-decays, the softplus threshold); gradcheck of the pair; the
status reporting; and no autograd needed to run it."""

from __future__ import annotations

import pytest
import torch

from fusedops.backends.torch.mamba2_scan.program import chunk_scan_backward, chunk_scan_forward
from fusedops.core.status import Status
from fusedops.mamba2_scan import samples
from fusedops.mamba2_scan.oracle import scan_with_gradients

F64 = torch.float64
CHUNK = 16
GRAD_OF = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
           "dt_bias": "ddt_bias", "initial_states": "dinitial_states"}
INDEX = ("cu_seqlens", "seq_idx")


def problem(b, l, h, p, g, n, *, seed, D=None, z=False, dt_bias=False, h0=False, dfinal=False,
            cu_seqlens=None, seq_idx=None, dt_scale=1.0):
    """Inputs (float64 on the CPU), dy and dfinal_states of one scan; D is None, "h" or "hp"."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    nseq = b if cu_seqlens is None else len(cu_seqlens) - 1
    t = dict(x=rnd(b, l, h, p), dt=dt_scale * rnd(b, l, h),
             A=-0.5 - torch.rand(h, generator=gen, dtype=F64), B=rnd(b, l, g, n),
             C=rnd(b, l, g, n))
    if D is not None:
        t["D"] = rnd(h) if D == "h" else rnd(h, p)
    if z:
        t["z"] = rnd(b, l, h, p)
    if dt_bias:
        t["dt_bias"] = 0.5 * rnd(h)
    if h0:
        t["initial_states"] = rnd(nseq, h, p, n)
    if cu_seqlens is not None:
        t["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int32)
    if seq_idx is not None:
        t["seq_idx"] = torch.tensor(seq_idx, dtype=torch.int32)
    return t, rnd(b, l, h, p), (rnd(nseq, h, p, n) if dfinal else None)


def by_autograd(t, dy, dfinal, options, status=None):
    """Every gradient by autograd through chunk_scan_forward (float64)."""
    leaves = {k: v.clone().requires_grad_() for k, v in t.items() if k not in INDEX}
    core = [leaves.pop(k) for k in ("x", "dt", "A", "B", "C")]
    index = {k: t[k] for k in INDEX if k in t}
    y, final, _, _ = chunk_scan_forward(*core, CHUNK, **leaves, **index, compute_dtype=F64,
                                        status=status, **options)
    outputs, grads = [y], [dy]
    if dfinal is not None:
        outputs.append(final)
        grads.append(dfinal)
    wrt = {k: v for k, v in zip(("x", "dt", "A", "B", "C"), core)} | leaves
    found = torch.autograd.grad(outputs, list(wrt.values()), grads, allow_unused=True)
    return {GRAD_OF[k]: g if g is not None else torch.zeros_like(wrt[k])
            for k, g in zip(wrt, found)}


def by_hand(t, dy, dfinal, options, status=None):
    """Every gradient by chunk_scan_backward (float64)."""
    rest = {k: v for k, v in t.items() if k not in ("x", "dt", "A", "B", "C")}
    return chunk_scan_backward(t["x"], t["dt"], t["A"], t["B"], t["C"], dy, CHUNK,
                               dfinal_states=dfinal, compute_dtype=F64, status=status,
                               **rest, **options)


EVERY = dict(D="h", z=True, dt_bias=True, h0=True, dfinal=True)
SEQ_IDS = [[0] * 10 + [1] * 22 + [2] * 5,          # changes mid-segment and at a segment start
           [0] * 37,
           [3] * 5 + [4] * 31 + [5]]               # not starting at 0: no initial state
CASES = {
    "plain": ((2, 37, 4, 8, 2, 16), {}, dict(dt_softplus=False)),   # dt clamped at 0: zero steps
    "every-option": ((2, 37, 4, 8, 2, 16), EVERY, dict(dt_softplus=True)),
    "D-per-channel": ((1, 40, 2, 8, 1, 8), dict(D="hp", z=True, h0=True), dict(dt_softplus=True)),
    "heads-equal-groups": ((1, 33, 3, 5, 3, 7), dict(D="h", dfinal=True), dict(dt_softplus=True)),
    "varlen": ((1, 41, 4, 8, 2, 8), dict(EVERY, cu_seqlens=[0, 5, 5, 21, 22, 41]),
               dict(dt_softplus=True)),
    "varlen-sanitised": ((1, 41, 4, 8, 2, 8), dict(EVERY, cu_seqlens=[2, 20, 9, 30, 60]),
                         dict(dt_softplus=True)),
    "seq-idx": ((3, 37, 4, 8, 2, 16), dict(EVERY, seq_idx=SEQ_IDS), dict(dt_softplus=True)),
    "state-dtype-bf16": ((1, 41, 4, 8, 2, 8), dict(EVERY, cu_seqlens=[0, 5, 21, 41]),
                         dict(dt_softplus=True, state_dtype=torch.bfloat16)),
    "seq-idx-state-dtype-fp16": ((3, 37, 4, 8, 2, 16), dict(EVERY, seq_idx=SEQ_IDS),
                                 dict(dt_softplus=True, state_dtype=torch.float16)),
    "dt-limit-positive-decay": ((2, 37, 4, 8, 2, 16), dict(EVERY, dt_scale=3.0),
                                dict(dt_softplus=False, dt_limit=(-1.0, 1.5))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_autograd_through_the_forward(name):
    shape, inputs, options = CASES[name]
    t, dy, dfinal = problem(*shape, seed=len(name), **inputs)
    expected, got = by_autograd(t, dy, dfinal, options), by_hand(t, dy, dfinal, options)
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-11, msg=key)


def test_at_the_kinks():
    """dt + bias at the softplus threshold exactly (derivative sigmoid(20)) and above it (1);
    dt exactly at the clamp bounds (the gradient passes) and outside them (it does not)."""
    t, dy, dfinal = problem(1, 20, 2, 4, 1, 4, seed=7, dt_bias=True, h0=True, dfinal=True)
    t["dt"][0, :4, 0] = torch.tensor([20.0, 20.5, 19.5, 25.0], dtype=F64) - t["dt_bias"][0]
    options = dict(dt_softplus=True, dt_limit=(0.0, 21.0))
    expected, got = by_autograd(t, dy, dfinal, options), by_hand(t, dy, dfinal, options)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-11, msg=key)
    t, dy, dfinal = problem(1, 20, 2, 4, 1, 4, seed=8)
    t["dt"][0, :4, 0] = torch.tensor([0.25, 1.5, 0.2, 1.6], dtype=F64)
    options = dict(dt_softplus=False, dt_limit=(0.25, 1.5))
    expected, got = by_autograd(t, dy, dfinal, options), by_hand(t, dy, dfinal, options)
    torch.testing.assert_close(got["ddt"], expected["ddt"], rtol=1e-9, atol=1e-11)
    assert [bool(v != 0) for v in got["ddt"][0, :4, 0]] == [True, True, False, False]


def test_zero_steps_pass_the_exponent_gradient():
    """dt = 0 exactly at the clamp's lower bound (the gradient passes it) at a segment's start
    and end, and over a whole segment: exponents of exactly 0 (acum, acum_last - acum, acum_last,
    pairs of equal acum) pass their gradient, as torch.clamp does at its bound."""
    t, dy, dfinal = problem(1, 37, 2, 4, 1, 4, seed=12, h0=True, dfinal=True)
    t["dt"] = t["dt"].abs()
    zero = [0, 1, 2, 14, 15, *range(16, 32)]
    t["dt"][0, zero] = 0.0
    options = dict(dt_softplus=False)
    expected, got = by_autograd(t, dy, dfinal, options), by_hand(t, dy, dfinal, options)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-11, msg=key)
    assert (got["ddt"][0, zero] != 0).all()


class _Scan(torch.autograd.Function):
    """chunk_scan_forward's y and final_states with chunk_scan_backward as their gradient."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, h0, seq_idx):
        opts = dict(D=D, z=z, dt_bias=dt_bias, initial_states=h0, seq_idx=seq_idx,
                    dt_softplus=True, compute_dtype=F64)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, h0, seq_idx)
        y, final, _, _ = chunk_scan_forward(x, dt, A, B, C, CHUNK, **opts)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, h0, seq_idx = ctx.saved_tensors
        g = chunk_scan_backward(x, dt, A, B, C, dy, CHUNK, D=D, z=z, dt_bias=dt_bias,
                                initial_states=h0, seq_idx=seq_idx, dfinal_states=dfinal,
                                dt_softplus=True, compute_dtype=F64)
        return tuple(g[GRAD_OF[k]] for k in GRAD_OF) + (None,)


def test_gradcheck_with_sequence_ids_and_every_option():
    ids = [[0] * 7 + [1] * 13 + [2] * 3, [4] * 23]
    t, _, _ = problem(2, 23, 2, 3, 1, 2, seed=9, D="hp", z=True, dt_bias=True, h0=True,
                      seq_idx=ids)
    args = [t[k].requires_grad_() for k in GRAD_OF]
    assert torch.autograd.gradcheck(_Scan.apply, (*args, t["seq_idx"]), eps=1e-6, atol=1e-7,
                                    rtol=1e-5)


BAD_INDEX = [(dict(cu_seqlens=[0, 30, 20, 50]), Status.CU_SEQLENS),
             (dict(seq_idx=[[0] * 20 + [2] * 10 + [1] * 7]), Status.SEQ_IDX)]


@pytest.mark.parametrize("index,bit", BAD_INDEX)
def test_reports_bad_index_data_like_the_forward(index, bit):
    t, dy, dfinal = problem(1, 37, 2, 4, 1, 4, seed=10, h0=True, dfinal=True, **index)
    status = torch.zeros(1, dtype=torch.int32)
    by_hand(t, dy, dfinal, {}, status)
    assert int(status) == bit


def test_runs_without_autograd():
    """No graph is built: the backward runs under inference_mode and returns plain tensors."""
    t, dy, dfinal = problem(2, 37, 4, 8, 2, 16, seed=11, **EVERY)
    expected = by_autograd(t, dy, dfinal, dict(dt_softplus=True))
    with torch.inference_mode():
        got = by_hand(t, dy, dfinal, dict(dt_softplus=True))
    for key, value in got.items():
        assert value.grad_fn is None and not value.requires_grad
        torch.testing.assert_close(value, expected[key], rtol=1e-9, atol=1e-11, msg=key)


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_fp32_decay_gradients_without_cancellation():
    """Large steps (dt = 20 on several tokens): in fp32, dA and ddt stay within a few roundings
    of the float64 recurrence, because each a_k = dt_k·A gathers its gradient from the terms
    that span it (a difference of cumulative sums, d acum_i = rows - columns, loses 1e-5)."""
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=8)
    t = case.tensors
    t["dt"][0, :4, 1] = torch.tensor([20.0, 20.5, 19.5, -30.0])
    got = chunk_scan_backward(t["x"], t["dt"], t["A"], t["B"], t["C"], t["dy"], CHUNK,
                              dt_softplus=True)
    expected = scan_with_gradients(t, dt_softplus=True)
    assert rel_l2(got["dA"], expected["dA"]) < 1.5e-6      # 1.4e-5 as rows - columns
    assert rel_l2(got["ddt"], expected["ddt"]) < 3e-6
