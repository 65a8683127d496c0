"""Value types of the PTX emulator: register bit patterns, IEEE rounding, bf16."""

from __future__ import annotations

import re

import numpy as np

from .faults import PtxFault

# -- types ---------------------------------------------------------------------------------------
_INT_TYPES = {
    "b8": np.uint8, "u8": np.uint8, "s8": np.int8, "b16": np.uint16, "u16": np.uint16,
    "s16": np.int16, "b32": np.uint32, "u32": np.uint32, "s32": np.int32, "b64": np.uint64,
    "u64": np.uint64, "s64": np.int64,
}
_FLOAT_TYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
_TYPE_NAMES = set(_INT_TYPES) | set(_FLOAT_TYPES) | {"pred", "bf16", "bf16x2", "f16x2", "f32x2"}
_ROUNDING = ("rn", "rm", "rp", "rz")


def _width(t: str) -> int:
    if t == "pred":
        return 1
    if t in ("bf16",):
        return 16
    if t in ("bf16x2", "f16x2"):
        return 32
    if t == "f32x2":
        return 64
    return int(re.sub(r"\D", "", t))


def _from_bits(bits: np.ndarray, t: str) -> np.ndarray:
    """uint64 register bits -> values of PTX type t (bf16 stays raw uint16)."""
    if t == "pred":
        return bits != 0
    w = _width(t)
    raw = bits.astype(_UNSIGNED[w])
    if t in _FLOAT_TYPES:
        return raw.view(_FLOAT_TYPES[t])
    if t in _INT_TYPES:
        return raw.view(_INT_TYPES[t])
    return raw


def _to_bits(values: np.ndarray, t: str) -> np.ndarray:
    """Values of PTX type t -> uint64 register bits (zero-extended)."""
    if t == "pred":
        return np.asarray(values, dtype=bool).astype(np.uint64)
    w = _width(t)
    v = np.asarray(values)
    if t in _FLOAT_TYPES:
        v = v.astype(_FLOAT_TYPES[t])
    elif v.dtype.kind == "f":
        raise PtxFault(f"internal: float values written as {t}")
    else:
        v = v.astype(_INT_TYPES.get(t, _UNSIGNED[w]), copy=False)
    return v.view(_UNSIGNED[w]).astype(np.uint64)


# -- rounding ------------------------------------------------------------------------------------
def _round_f64_to_f32(exact_hi: np.ndarray, exact_lo: np.ndarray, mode: str) -> np.ndarray:
    """Rounds hi + lo (an unevaluated float64 sum, |lo| <= ulp(hi)/2) to float32 in ``mode``.

    The sum is first rounded to float64 by round-to-odd, which makes the second rounding to
    float32 exact (53 >= 2*24 + 2 bits)."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = exact_hi
        inexact = (exact_lo != 0) & np.isfinite(s)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        toward = np.where(exact_lo > 0, np.inf, -np.inf)
        s = np.where(inexact & even, np.nextafter(s, toward), s)
        r = s.astype(np.float32)
        if mode == "rn":
            return r
        r64 = r.astype(np.float64)
        finite = np.isfinite(s)
        if mode == "rm":
            fix = finite & (r64 > s)
            return np.where(fix, np.nextafter(r, np.float32(-np.inf)), r)
        if mode == "rp":
            fix = finite & (r64 < s)
            return np.where(fix, np.nextafter(r, np.float32(np.inf)), r)
        if mode == "rz":
            fix = finite & (np.abs(r64) > np.abs(s))
            return np.where(fix, np.nextafter(r, np.float32(0)), r)
    raise PtxFault(f"unsupported rounding mode .{mode}")


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore"):
        s = a + b
        bb = s - a
        err = (a - (s - bb)) + (b - bb)
    return s, np.where(np.isfinite(err), err, 0.0)


def _f32_op(op: str, mode: str, *args: np.ndarray) -> np.ndarray:
    """Correctly rounded fp32 add/sub/mul/fma/div/sqrt/rcp (computed in float64, exact)."""
    a = [x.astype(np.float64) for x in args]
    with np.errstate(all="ignore"):
        if op in ("add", "sub", "fma"):
            if op == "fma":
                hi, lo = _two_sum(a[0] * a[1], a[2])  # the float64 product of two floats is exact
            else:
                hi, lo = _two_sum(a[0], a[1] if op == "add" else -a[1])
            return _round_f64_to_f32(hi, lo, mode)
        exact = {"mul": lambda: a[0] * a[1], "div": lambda: a[0] / a[1],
                 "sqrt": lambda: np.sqrt(a[0]), "rcp": lambda: 1.0 / a[0]}[op]()
    # mul is exact in float64; div/sqrt/rcp rounded to float64 and then to float32 are
    # correctly rounded for round-to-nearest (53 >= 2*24 + 2); directed modes need the residual.
    if op == "mul" or mode == "rn":
        return _round_f64_to_f32(exact, np.zeros_like(exact), mode)
    raise PtxFault(f"unsupported rounding mode .{mode} for {op}.f32")


def _flush(x: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to sign-preserving zero (.ftz)."""
    tiny = np.abs(x) < np.finfo(np.float32).tiny
    return np.where(tiny & (x != 0), np.copysign(np.float32(0), x), x).astype(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    nan = np.isnan(x)
    return np.where(nan, (bits >> np.uint64(16)) | np.uint64(0x40), rounded).astype(np.uint16)


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
