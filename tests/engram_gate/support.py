"""Engram saved-state gate: inputs, runners and comparisons the family's test modules share."""

from __future__ import annotations

import torch

from fusedops import EngramGateSavedBackward, EngramGateSavedForward
from fusedops.engram_gate.info import INFO
from fusedops.engram_gate.samples import make
from fusedops.opinfo import Case
from fusedops.testing import assert_close

from helpers import DEVICE


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


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _compiled_pair(backend="torch", n=8):
    t = make_inputs(n, 4, 64, torch.bfloat16, seed=2)
    fwd = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"], backend=backend).compile()
    out, saved = fwd.allocate_outputs().values()
    bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], saved, t["grad_out"], backend=backend).compile()
    grads = dict(bwd.allocate_outputs(), workspace=bwd.allocate_workspace())
    return t, fwd, bwd, out, saved, grads
