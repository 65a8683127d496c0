"""Floating-point operands and arithmetic shared by the instruction decoders: every float type
(f32, f64, bf16, f16 and the packed x2 forms) read as float32 lanes and written back rounded
once; the elementwise float instruction built from a function of the sources.

``.approx`` instructions (ex2, lg2, rcp, sqrt, rsqrt, sin, cos, tanh, div) are computed
exactly and rounded once, so they can differ from a GPU by the approximation's documented
error.
"""

from __future__ import annotations

import numpy as np

from .faults import UnsupportedPtx
from .isa import FLOAT_TYPES, ROUNDING, UNSIGNED, types_of, width
from .operands import reader, writer
from .values import (
    bf16_to_f32,
    f16_to_f32,
    f32_op,
    f32_to_bf16,
    f32_to_f16,
    flush,
    round_f64_to_f32,
    saturate,
    two_sum,
)

HALF = {"bf16": (bf16_to_f32, f32_to_bf16), "f16": (f16_to_f32, f32_to_f16)}


def mode_of(ins, default: str = "rn") -> str:
    return next((p for p in ins.opcode if p in ROUNDING), default)


def type_of(ins) -> str:
    types = types_of(ins.opcode)
    if not types:
        raise UnsupportedPtx(f"no type in {ins.where()}")
    return types[-1]


# -- floats of every width, as float32 lanes ---------------------------------------------------
def float_reader(op, t: str):
    """Reads a float operand of type ``t`` as float32 values; packed types (bf16x2, f16x2,
    f32x2) as an array of shape (lanes, 2), low element first."""
    if t in ("f32", "f64"):
        get = reader(op, t)
        return get
    if t in HALF:
        get, widen = reader(op, "b16"), HALF[t][0]
        return lambda m, L: widen(get(m, L))
    if t in ("bf16x2", "f16x2"):
        get, widen = reader(op, "b32"), HALF[t[:-2]][0]

        def packed(m, L):
            bits = np.atleast_1d(get(m, L))
            return np.stack([widen(bits & np.uint32(0xFFFF)), widen(bits >> np.uint32(16))], -1)

        return packed
    if t == "f32x2":
        get = reader(op, "b64")

        def pair(m, L):
            bits = np.atleast_1d(get(m, L))
            return np.stack(
                [
                    (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.float32),
                    (bits >> np.uint64(32)).astype(np.uint32).view(np.float32),
                ],
                -1,
            )

        return pair
    raise UnsupportedPtx(f"float operand of type .{t}")


def float_writer(op, t: str):
    """Writes float32 results as type ``t`` (rounded to nearest even for bf16/f16)."""
    if t in ("f32", "f64"):
        return writer(op, t)
    if t in HALF:
        put, narrow = writer(op, "b16"), HALF[t][1]
        return lambda m, L, v: put(m, L, narrow(v))
    if t in ("bf16x2", "f16x2"):
        put, narrow = writer(op, "b32"), HALF[t[:-2]][1]

        def packed(m, L, v):
            lo, hi = narrow(v[..., 0]).astype(np.uint32), narrow(v[..., 1]).astype(np.uint32)
            put(m, L, lo | (hi << np.uint32(16)))

        return packed
    if t == "f32x2":
        put = writer(op, "b64")

        def pair(m, L, v):
            lo = v[..., 0].astype(np.float32).view(np.uint32).astype(np.uint64)
            hi = v[..., 1].astype(np.float32).view(np.uint32).astype(np.uint64)
            put(m, L, lo | (hi << np.uint64(32)))

        return pair
    raise UnsupportedPtx(f"float result of type .{t}")


def odd_f32(hi, lo):
    """hi + lo rounded to float32 by round-to-odd (exact for a later rounding to <= 22 bits)."""
    r = round_f64_to_f32(hi, lo, "rz")
    inexact = (r.astype(np.float64) != hi) | (lo != 0)
    bits = r.view(np.uint32) | inexact.astype(np.uint32)
    return np.where(np.isfinite(hi), bits.view(np.float32), hi.astype(np.float32))


def float_op(ins, fn, arity: int):
    """A float instruction ``d = fn(mode, wide, *sources)`` on f32, f64, bf16/f16 (computed in
    float32 and rounded once: exact for add/sub/mul, round-to-odd for fma), packed x2 types,
    and the mixed forms (``add.f32.bf16``: the leading sources narrow, the last and d f32)."""
    types = types_of(ins.opcode)
    dt = types[0]
    src_types = ([types[1]] * (arity - 1) + [dt]) if len(types) == 2 else [dt] * arity
    if len(types) == 2 and ins.opcode[0] not in ("add", "sub", "fma", "mul"):
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    d, *sources = ins.operands
    gets = [float_reader(o, t) for o, t in zip(sources, src_types)]
    put = float_writer(d, dt)
    mode = mode_of(ins)
    ftz, sat = "ftz" in ins.opcode, "sat" in ins.opcode
    narrow = dt in ("bf16", "f16", "bf16x2", "f16x2")
    if dt == "f64":

        def handler64(m, L):
            put(m, L, fn(mode, True, *[g(m, L) for g in gets]))

        return handler64

    def handler(m, L):
        xs = [g(m, L) for g in gets]
        if ftz:
            xs = [flush(x) for x in xs]
        r = fn(mode, "narrow" if narrow else False, *xs)
        if ftz:
            r = flush(r)
        if sat:
            r = saturate(r)
        put(m, L, r)

    return handler


def arith(op: str):
    def fn(mode, wide, *xs):
        if wide is True:
            x = [np.asarray(v, dtype=np.float64) for v in xs]
            return {
                "add": lambda: x[0] + x[1],
                "sub": lambda: x[0] - x[1],
                "mul": lambda: x[0] * x[1],
                "fma": lambda: x[0] * x[1] + x[2],
            }[op]()
        if wide == "narrow" and op == "fma":
            hi, lo = two_sum(
                xs[0].astype(np.float64) * xs[1].astype(np.float64), xs[2].astype(np.float64)
            )
            return odd_f32(hi, lo)
        return f32_op(op, mode, *xs)

    return fn


def is_float(ins) -> bool:
    t = types_of(ins.opcode)[0]
    return t in FLOAT_TYPES or t in ("bf16", "bf16x2", "f16x2", "f32x2")


def sign_bits(ins, fn):
    """abs/neg of a float type: the sign bit(s) changed, the rest kept (NaN included); .ftz
    flushes f32 subnormals first."""
    t = type_of(ins)
    d, a = ins.operands
    w = width(t)
    mask = {
        "f32": 0x80000000,
        "f64": 0x8000000000000000,
        "bf16": 0x8000,
        "f16": 0x8000,
        "bf16x2": 0x80008000,
        "f16x2": 0x80008000,
    }[t]
    bt = f"b{w}"
    ga, put = reader(a, bt), writer(d, bt)
    umask = UNSIGNED[w](mask)
    ftz = "ftz" in ins.opcode and t == "f32"

    def handler(m, L):
        bits = ga(m, L)
        if ftz:
            bits = flush(bits.view(np.float32)).view(np.uint32)
        put(m, L, fn(bits, umask))

    return handler


def unary(fn):
    def decode(ins):
        t = type_of(ins)
        d, a = ins.operands
        ftz = "ftz" in ins.opcode
        mode = mode_of(ins)
        get, put = float_reader(a, t), float_writer(d, t)

        def handler(m, L):
            x = get(m, L)
            if t == "f64":
                return put(m, L, fn(np.asarray(x, dtype=np.float64), mode))
            if ftz:
                x = flush(x)
            r = fn(np.asarray(x, dtype=np.float64), mode)
            r = (
                r.astype(np.float32)
                if not isinstance(r, np.ndarray) or r.dtype != np.float32
                else r
            )
            if ftz:
                r = flush(r)
            put(m, L, r)

        return handler

    return decode


def rounded(op):
    def fn(x, mode):
        if mode == "rn":
            return {"sqrt": np.sqrt, "rcp": lambda v: 1.0 / v}[op](x)  # double rounding innocuous
        return f32_op(op, mode, x.astype(np.float32))

    return fn


