"""Small @triton.jit helpers shared by the kernels of several operators."""

import triton
import triton.language as tl


@triton.jit
def mm(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation. UPCAST: fp32 operands (the CPU interpreter cannot
    multiply bf16); IEEE: exact fp32 products (fp32 inputs) instead of tf32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def last_at_most(ptr, value, n, STEPS: tl.constexpr):
    """The largest i in [0, n) with ptr[i] <= value, for non-decreasing ptr[0..n) with
    ptr[0] <= value; STEPS >= ceil(log2(n)) + 1 binary-search steps."""
    lo = value * 0
    hi = lo + n - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        up = tl.load(ptr + mid) <= value
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    return lo


@triton.jit
def report(status, bad, BIT: tl.constexpr, HAS_STATUS: tl.constexpr):
    """ORs BIT into the status word when any element of ``bad`` (a block of bools) is true
    (an integer OR: order-independent, deterministic). ``status`` is compiled out (a constexpr
    None) when the plan has no status word."""
    if HAS_STATUS:
        if tl.max(bad.to(tl.int32)) != 0:
            tl.atomic_or(status, BIT)


@triton.jit
def report_if(status, bad, BIT: tl.constexpr, HAS_STATUS: tl.constexpr):
    """``report`` for one scalar condition."""
    if HAS_STATUS:
        if bad:
            tl.atomic_or(status, BIT)
