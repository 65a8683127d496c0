"""GQA attention: inputs, runners and comparisons the family's test modules share."""

from __future__ import annotations

import torch

import fusedops
from fusedops import GQAAttentionForward
from fusedops.gqa_attention import AttentionProblem
from fusedops.gqa_attention.info import KERNEL_TOLERANCE
from fusedops.gqa_attention.samples import make, make_decode, make_packed
from fusedops.testing import assert_close

from helpers import BACKENDS as RUNNABLE, DEVICE


BACKENDS = [b for b in RUNNABLE if b in GQAAttentionForward.backends]

CPU = torch.device("cpu")

F64 = KERNEL_TOLERANCE[torch.float64]


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, *, seed=0, device=DEVICE):
    """q, k, v, do of the family's dense sample."""
    t = make(b, sq, sk, hq, hkv, d, dtype, seed=seed, device=device).tensors
    return [t[n] for n in ("q", "k", "v", "do")]


def packed(lengths_q, lengths_k, hq, hkv, d, dtype=torch.float32, *, seed=0, device=DEVICE):
    """(q, k, v, do), packing options of the family's packed sample."""
    case = make_packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed=seed, device=device)
    t = case.tensors
    return [t[n] for n in ("q", "k", "v", "do")], dict(
        cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"], **case.options)


def run(backend, q, k, v, do, **opts):
    """Forward and backward through the eager wrappers."""
    f = fusedops.gqa_attention_forward(q, k, v, backend=backend, **opts)
    g = fusedops.gqa_attention_backward(q, k, v, f["o"], f["lse"], do, backend=backend, **opts)
    return dict(o=f["o"], lse=f["lse"], dq=g["dq"], dk=g["dk"], dv=g["dv"])


def compare(result, expected, tolerance, lse_tolerance=None):
    """Every expected result within ``tolerance``; lse: the same -inf rows, the finite ones within
    ``lse_tolerance`` (fp32's kernel tolerance unless float64)."""
    for name, value in expected.items():
        if name == "lse":
            finite = torch.isfinite(value)
            assert torch.equal(finite.cpu(), torch.isfinite(result[name]).cpu()), "lse: -inf rows differ"
            if finite.any():
                tol = lse_tolerance or (F64 if tolerance is F64 else KERNEL_TOLERANCE[torch.float32])
                assert_close(result[name][finite], value[finite].to(result[name].device), tol, "lse")
        else:
            assert_close(result[name], value.to(result[name].device), tolerance, name)


# -- 4. decode ----------------------------------------------------------------------------------
def decode_inputs(b, T, hq, hkv, d, capacity, lengths, dtype=torch.float32, seed=8):
    """q, k_new, v_new, k_cache, v_cache, cache_seqlens (execute()'s order) of a decode sample."""
    t = make_decode(b, T, hq, hkv, d, capacity, lengths, dtype, seed=seed, device=DEVICE).tensors
    return {n: t[n] for n in ("q", "k_new", "v_new", "k_cache", "v_cache", "cache_seqlens")}


def _decode_case(paged, fp8=None, lengths=(5, -3, 95, 40), T=2):
    case = make_decode(4, T, 8, 2, 32, 96, list(lengths), page_size=16 if paged else None,
                       fp8=fp8, seed=33, device=DEVICE)
    return case, dict(case.tensors)


# -- 8. performance model: floors, kernel cost models, tile tables, autotune ---------------------
def _problem(b=1, s=128, hq=4, hkv=2, d=64, causal=True, packed=False, dtype=torch.bfloat16):
    return AttentionProblem(dtype, b, s, s, hq, hkv, d, causal, (-1, -1), 0.125, packed, b * s,
                            b * s, CPU)
