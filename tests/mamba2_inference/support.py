"""Mamba2 inference: inputs, runners and comparisons the family's test modules share."""

from __future__ import annotations

import torch

from fusedops import Mamba2StateUpdate
from fusedops.mamba2_inference import samples

from helpers import BACKENDS, DEVICE


BACKENDS = [b for b in BACKENDS if b in Mamba2StateUpdate.backends]

CORE = ("x", "dt", "A", "B", "C")


def decode_inputs(b, T, h, p, g, n, *, seed=0, dtype=torch.float32, **options):
    """(core: x, dt, A, B, C; opts: D, z, dt_bias, dt_softplus; the case's state)."""
    case = samples.make(b, T, h, p, g, n, dtype, D="h", z=True, dt_bias=True, seed=seed,
                        device=DEVICE, **options)
    t = case.tensors
    core = {k: t[k] for k in CORE}
    return core, dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True), t["state"]


# -- 5. the performance model, the block table, autotune candidates ------------------------------
def _production(label: str):
    (calls,) = [calls for name, calls in samples.production() if name == label]
    return calls[0].build("torch")
