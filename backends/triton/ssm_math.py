"""Element-wise math the Mamba2 scan and state-update kernels share (mamba2_scan/kernels_forward.py,
mamba2_scan/kernels_backward.py, mamba2_inference.py), written once so training and decode round alike."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softplus(u, THRESHOLD: tl.constexpr):
    """log(1 + e^u) in fp32 to a few ulps for every u: u itself above THRESHOLD (as torch's
    softplus), else max(u, 0) + log1p(e^-|u|). log1p(t) is log(w)·t/(w - 1) with w = 1 + t
    rounded (exact when w rounds to 1: then t): the plain log(1 + t) loses t's digits below
    fp32's epsilon, a relative error of ~1e-3 at softplus(u) = 1e-5 and 1.0 below 6e-8."""
    t = tl.exp(-tl.abs(u))
    w = 1.0 + t
    log1p = tl.where(w == 1.0, t, tl.log(w) * (t / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(u > THRESHOLD, u, tl.maximum(u, 0.0) + log1p)
