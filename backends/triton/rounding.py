"""Rounding fp32 values to narrower formats independently of how the plain conversion rounds.

The CPU interpreter converts fp32 to bf16 by truncation and to e4m3 inexactly (ties, subnormals;
bit casts of e4m3 values are unreliable there too); GPUs round to nearest even. Where the rounding is part of a kernel's contract (a
stored state, an FP8 cache) the kernels call these under the interpreter, so tests check the
contract exactly; on a GPU the plain conversion is already round-to-nearest-even.
"""

import triton
import triton.language as tl


@triton.jit
def neighbours(v, DTYPE: tl.constexpr, INT: tl.constexpr):
    """(toward-zero neighbour, away neighbour, toward-zero bits) of fp32 v in DTYPE, from the
    conversion's result and one integer step of its bit pattern."""
    near = v.to(DTYPE)
    bits = near.to(INT, bitcast=True)
    toward_zero = tl.abs(near.to(tl.float32)) > tl.abs(v)
    other = tl.where(toward_zero, bits - 1, bits + 1)
    lo_bits = tl.where(toward_zero, other, bits)
    hi = tl.where(toward_zero, bits, other).to(DTYPE, bitcast=True)
    return lo_bits.to(DTYPE, bitcast=True), hi, lo_bits


@triton.jit
def nearest_even(v, DTYPE: tl.constexpr, INT: tl.constexpr):
    """v (fp32) to DTYPE, to nearest with ties to even."""
    lo, hi, lo_bits = neighbours(v, DTYPE, INT)
    d_lo = tl.abs(v - lo.to(tl.float32))
    d_hi = tl.abs(hi.to(tl.float32) - v)
    return tl.where((d_hi < d_lo) | ((d_hi == d_lo) & ((lo_bits & 1) == 1)), hi, lo)


@triton.jit
def stochastic(v, u, DTYPE: tl.constexpr, INT: tl.constexpr):
    """v (fp32) to DTYPE: the away neighbour with probability equal to v's position between the
    two (u uniform in [0, 1)): unbiased, always within one ulp."""
    lo, hi, _ = neighbours(v, DTYPE, INT)
    lo_f = lo.to(tl.float32)
    p = (v - lo_f) / (hi.to(tl.float32) - lo_f)
    return tl.where(u < p, hi, lo)


@triton.jit
def nearest_even_on_grid(v, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """v (fp32) rounded to nearest (ties to even) among the values of a binary format with the
    given mantissa bits and smallest normal exponent (subnormals included), computed in fp32
    arithmetic without bit casts; the result converts exactly to that format."""
    a = tl.abs(v)
    e = tl.floor(tl.log2(tl.maximum(a, 1e-30)))
    e = tl.where(a < tl.exp2(e), e - 1.0, e)
    e = tl.where(a >= tl.exp2(e + 1.0), e + 1.0, e)
    e = tl.maximum(e, MIN_EXPONENT * 1.0)
    ulp = tl.exp2(e - MANTISSA_BITS)
    t = a / ulp
    r = tl.floor(t + 0.5)
    tie_to_odd = ((r - t) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    r = tl.where(tie_to_odd, r - 1.0, r)
    return tl.where(v < 0, -r * ulp, r * ulp)


@triton.jit
def round_to(v, DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """fp32 v to DTYPE (16-bit) to nearest even: the plain conversion on a GPU, nearest_even
    where the conversion does not round (EXACT: bf16 under the interpreter)."""
    if EXACT:
        return nearest_even(v, DTYPE, tl.int16)
    else:
        return v.to(DTYPE)
