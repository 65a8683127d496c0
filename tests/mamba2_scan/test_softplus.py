"""dt_softplus precision: softplus(u) for dt from 1e-6 to 10, in the scan forward, its backward
and the state update, on every backend against the same computation in float64. The error of
dt reaches y, the states and every gradient in proportion, so each head (one dt value) is
checked on its own: a softplus written as log(1 + e^u) in fp32 is off by ~1e-3 at dt = 1e-5 and
by 100% below 6e-8; fusedops keeps every head within 1e-4."""

from __future__ import annotations

import math

import pytest
import torch

import fusedops

from helpers import BACKENDS, DEVICE

SCAN_BACKENDS = [b for b in BACKENDS if b in ("torch", "triton")]

DTS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)
LIMIT = 1e-4        # fp32 kernels, per head, relative to the head's own norm


def _raw(target: float) -> float:
    """u with softplus(u) = target."""
    return target + math.log(-math.expm1(-target))


def _inputs(b, l, h, p, g, n, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)
    u = torch.tensor([_raw(t) for t in DTS], dtype=torch.float64)
    dt = u.expand(b, l, h).clone()
    return dict(x=rnd(b, l, h, p), dt=dt, A=-torch.rand(h, generator=gen, dtype=torch.float64) - 0.5,
                B=rnd(b, l, g, n), C=rnd(b, l, g, n))


def _per_head_error(value, ref, head_dim: int) -> torch.Tensor:
    """max over heads of |value - ref| / |ref| (Frobenius norms of the head's slice)."""
    v = value.double().movedim(head_dim, 0).reshape(value.shape[head_dim], -1)
    r = ref.double().movedim(head_dim, 0).reshape(ref.shape[head_dim], -1)
    return ((v - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-300))


def _on(t: dict, dtype):
    return {k: v.to(DEVICE, dtype) for k, v in t.items()}


def test_softplus_inputs_span_the_range():
    u = torch.tensor([_raw(t) for t in DTS], dtype=torch.float64)
    assert torch.allclose(torch.nn.functional.softplus(u), torch.tensor(DTS, dtype=torch.float64),
                          rtol=1e-12)


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_scan_forward_and_backward_keep_small_dt_precise(backend):
    t = _inputs(1, 32, len(DTS), 16, 1, 16)
    gen = torch.Generator().manual_seed(1)
    dy = torch.randn(1, 32, len(DTS), 16, generator=gen, dtype=torch.float64)
    opts = dict(chunk_size=16, dt_softplus=True)
    ref = fusedops.mamba2_chunk_scan_forward(**_on(t, torch.float64), backend="torch", **opts)
    got = fusedops.mamba2_chunk_scan_forward(**_on(t, torch.float32), backend=backend, **opts)
    assert _per_head_error(got["y"], ref["y"], 2).max() < LIMIT
    assert _per_head_error(got["final_states"], ref["final_states"], 1).max() < LIMIT
    ref_g = fusedops.mamba2_chunk_scan_backward(**_on(t, torch.float64), dy=dy.to(DEVICE),
                                                saved=ref["saved"], backend="torch", **opts)
    got_g = fusedops.mamba2_chunk_scan_backward(**_on(t, torch.float32), dy=dy.to(DEVICE, torch.float32),
                                                saved=got["saved"], backend=backend, **opts)
    for name, head_dim in (("dx", 2), ("ddt", 2), ("dA", 0)):
        err = _per_head_error(got_g[name], ref_g[name], head_dim)
        if name == "dA":    # at dt = 10 the decays e^(dt·A) underflow and dA's terms cancel
            err = err[:-1]
        assert err.max() < LIMIT, (name, err.tolist())


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_state_update_keeps_small_dt_precise(backend):
    t = _inputs(2, 1, len(DTS), 16, 1, 16, seed=2)
    one = dict(x=t["x"][:, 0], dt=t["dt"][:, 0], A=t["A"], B=t["B"][:, 0], C=t["C"][:, 0])
    state = torch.zeros(2, len(DTS), 16, 16, device=DEVICE)      # the new state is dt·B⊗x
    dt = torch.nn.functional.softplus(one["dt"])                        # float64, [b, h]
    ref_state = dt[:, :, None, None] * one["x"][:, :, :, None] * one["B"][:, None, None, 0, :]
    ref_y = (ref_state * one["C"][:, None, None, 0, :]).sum(-1)
    got = fusedops.mamba2_state_update(state, **_on(one, torch.float32), dt_softplus=True,
                                       backend=backend)
    assert _per_head_error(got["y"].cpu(), ref_y, 1).max() < LIMIT
    assert _per_head_error(state.cpu(), ref_state, 1).max() < LIMIT
