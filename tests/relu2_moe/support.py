"""Routed ReLU2 MoE: inputs, runners and comparisons the family's test modules share."""

from __future__ import annotations

import torch

import fusedops
from fusedops.relu2_moe.info import INFO
from fusedops.relu2_moe.samples import expert_inputs
from fusedops.testing import assert_close

from helpers import BACKENDS as RUNNABLE, DEVICE


BACKENDS = [b for b in RUNNABLE if b in INFO.backends]

KERNELS = [b for b in BACKENDS if b != "torch"]


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
