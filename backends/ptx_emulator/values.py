"""Floating-point semantics of the PTX emulator: IEEE rounding, bf16, f16, fp8 and tf32.

fp32 ``add``/``sub``/``mul``/``div``/``sqrt`` in round-to-nearest are numpy's own float32
arithmetic (IEEE, correctly rounded). ``fma`` and the directed rounding modes are computed
from the exact float64 value with its residual, rounded to odd first so the second rounding to
float32 is exact (53 >= 2 * 24 + 2 bits).
"""

from __future__ import annotations

import numpy as np

from .faults import PtxFault, UnsupportedPtx

F32_TINY = np.float32(np.finfo(np.float32).tiny)


def round_f64_to_f32(hi: np.ndarray, lo: np.ndarray, mode: str) -> np.ndarray:
    """Rounds hi + lo (an unevaluated float64 sum, |lo| <= ulp(hi)/2) to float32 in ``mode``."""
    s = hi
    inexact = (lo != 0) & np.isfinite(s)
    if inexact.any():
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        toward = np.where(lo > 0, np.inf, -np.inf)
        s = np.where(inexact & even, np.nextafter(s, toward), s)
    r = s.astype(np.float32)
    if mode == "rn":
        return r
    r64 = r.astype(np.float64)
    finite = np.isfinite(s)
    if mode == "rm":
        return np.where(finite & (r64 > s), np.nextafter(r, np.float32(-np.inf)), r)
    if mode == "rp":
        return np.where(finite & (r64 < s), np.nextafter(r, np.float32(np.inf)), r)
    if mode == "rz":
        return np.where(finite & (np.abs(r64) > np.abs(s)), np.nextafter(r, np.float32(0)), r)
    raise PtxFault(f"unsupported rounding mode .{mode}")


def two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a + b rounded, its exact error), float64."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    return s, np.where(np.isfinite(err), err, 0.0)


def f32_op(op: str, mode: str, *args) -> np.ndarray:
    """Correctly rounded fp32 add/sub/mul/fma/div/sqrt/rcp in rounding ``mode``."""
    if mode == "rn" and op in ("add", "sub", "mul", "div", "sqrt"):
        x = [np.asarray(v, dtype=np.float32) for v in args]
        if op == "add":
            return x[0] + x[1]
        if op == "sub":
            return x[0] - x[1]
        if op == "mul":
            return x[0] * x[1]
        if op == "div":
            return x[0] / x[1]
        return np.sqrt(x[0])
    a = [np.asarray(v, dtype=np.float64) for v in args]
    if op in ("add", "sub", "fma"):
        if op == "fma":
            hi, lo = two_sum(a[0] * a[1], a[2])  # the float64 product of two floats is exact
        else:
            hi, lo = two_sum(a[0], a[1] if op == "add" else -a[1])
        return round_f64_to_f32(hi, lo, mode)
    if op == "mul":
        return round_f64_to_f32(a[0] * a[1], np.zeros_like(a[0] * a[1]), mode)
    if op == "rcp" and mode == "rn":
        return (1.0 / a[0]).astype(np.float32)
    raise PtxFault(f"unsupported rounding mode .{mode} for {op}.f32")


def flush(x: np.ndarray) -> np.ndarray:
    """Float32 subnormals flushed to sign-preserving zero (.ftz)."""
    x = np.asarray(x, dtype=np.float32)
    tiny = (np.abs(x) < F32_TINY) & (x != 0)
    if not tiny.any():
        return x
    return np.where(tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def saturate(x: np.ndarray) -> np.ndarray:
    """.sat: clamped to [0, 1], NaN to 0."""
    return np.where(np.isnan(x), 0, np.clip(x, 0, 1)).astype(x.dtype)


# -- bf16 -----------------------------------------------------------------------------------------
def bf16_to_f32(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x, mode: str = "rn", relu: bool = False, satfinite: bool = False) -> np.ndarray:
    """float32 -> bf16 bit patterns, rounded in ``mode`` (rn: to nearest even; rz: toward
    zero); NaN stays a quiet NaN."""
    x = np.asarray(x, dtype=np.float32)
    if relu:
        x = np.where(x < 0, np.float32(0), x)
    bits = x.view(np.uint32).astype(np.uint64)
    if mode == "rn":
        rounded = (
            bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))
        ) >> np.uint64(16)
    elif mode == "rz":
        rounded = bits >> np.uint64(16)
    else:
        raise UnsupportedPtx(f"rounding mode .{mode} for a bf16 conversion is not emulated")
    out = np.where(np.isnan(x), (bits >> np.uint64(16)) | np.uint64(0x40), rounded).astype(
        np.uint16
    )
    if satfinite:
        inf = (out & np.uint16(0x7FFF)) == np.uint16(0x7F80)
        out = np.where(inf, (out & np.uint16(0x8000)) | np.uint16(0x7F7F), out).astype(np.uint16)
    return out


def f32_to_f16(x, mode: str = "rn") -> np.ndarray:
    """float32 -> f16 bit patterns (numpy rounds to nearest even)."""
    if mode != "rn":
        raise PtxFault(f"unsupported rounding mode .{mode} for an f16 conversion")
    return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def f16_to_f32(bits) -> np.ndarray:
    return np.asarray(bits).astype(np.uint16).view(np.float16).astype(np.float32)


def tf32(x: np.ndarray) -> np.ndarray:
    """The tf32 value a tensor core reads from a float32 (its low 13 mantissa bits dropped)."""
    return (np.asarray(x, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(
        np.float32
    )


# -- fp8 ------------------------------------------------------------------------------------------
_FP8 = {"e4m3": (4, 3, 7, 448.0), "e5m2": (5, 2, 15, 57344.0)}


def _fp8_table(kind: str) -> np.ndarray:
    ebits, mbits, bias, _ = _FP8[kind]
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes >> 7, -1.0, 1.0)
    e = (codes >> mbits) & ((1 << ebits) - 1)
    m = codes & ((1 << mbits) - 1)
    value = np.where(e == 0, m * 2.0 ** (1 - bias - mbits), (1 + m / 2**mbits) * 2.0 ** (e - bias))
    value = sign * value
    if kind == "e4m3":
        value[(codes & 0x7F) == 0x7F] = np.nan
    else:
        top = (1 << ebits) - 1
        value[(e == top) & (m == 0)] = sign[(e == top) & (m == 0)] * np.inf
        value[(e == top) & (m != 0)] = np.nan
    return value.astype(np.float32)


FP8_VALUES = {kind: _fp8_table(kind) for kind in _FP8}


def fp8_to_f32(codes, kind: str) -> np.ndarray:
    """fp8 codes (uint8) -> float32, exactly."""
    return FP8_VALUES[kind][np.asarray(codes).astype(np.uint8)]


def f32_to_fp8(x, kind: str, satfinite: bool = True) -> np.ndarray:
    """float32 -> fp8 codes, rounded to nearest even; .satfinite clamps to the largest finite
    value (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float32)
    table = FP8_VALUES[kind]
    finite_codes = np.flatnonzero(np.isfinite(table) & (np.arange(256) < 128))
    mags = table[finite_codes].astype(np.float64)
    order = np.argsort(mags)
    mags, finite_codes = mags[order], finite_codes[order]
    ax = np.abs(x.astype(np.float64))
    idx = np.clip(np.searchsorted(mags, ax), 1, len(mags) - 1)
    lo, hi = mags[idx - 1], mags[idx]
    pick_hi = (ax - lo > hi - ax) | ((ax - lo == hi - ax) & (finite_codes[idx] % 2 == 0))
    code = np.where(pick_hi, finite_codes[idx], finite_codes[idx - 1])
    largest = _FP8[kind][3]
    over = ax > largest
    if satfinite:
        code = np.where(over, finite_codes[-1], code)
    elif kind == "e5m2":
        code = np.where(over, 0x7C, code)
    else:
        code = np.where(over, 0x7F, code)
    code = np.where(np.signbit(x), code | 0x80, code)
    code = np.where(np.isnan(x), 0x7F, code)
    return code.astype(np.uint8)
