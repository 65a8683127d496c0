"""Comparison, selection, data movement between registers and conversions between types
(IEEE-rounded as the instruction says; fp8 with round-to-nearest-even and ``.satfinite``)."""

from __future__ import annotations

import numpy as np

from .faults import UnsupportedPtx
from .floats import float_reader, float_writer, mode_of, odd_f32, type_of
from .isa import FLOAT_TYPES, INT_TYPES, SHARED_WINDOW, UNSIGNED, Vec, types_of, value_dtype, width
from .operands import pair_writers, reader, writer
from .values import (
    f32_to_bf16,
    f32_to_f16,
    f32_to_fp8,
    flush,
    fp8_to_f32,
    round_f64_to_f32,
    saturate,
)

_CMP = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "lo": np.less,
    "ls": np.less_equal,
    "hi": np.greater,
    "hs": np.greater_equal,
}
_BOOL = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _compare(cmp: str, t: str):
    if t in FLOAT_TYPES or t in ("bf16", "f16"):

        def fcmp(x, y):
            nan = np.isnan(x) | np.isnan(y)
            if cmp == "num":
                return ~nan
            if cmp == "nan":
                return nan
            if cmp.endswith("u") and cmp[:-1] in _CMP:
                return _CMP[cmp[:-1]](x, y) | nan
            r = _CMP[cmp](x, y)
            return r & ~nan if cmp == "ne" else r

        return fcmp
    if cmp not in _CMP:
        raise UnsupportedPtx(f"integer comparison .{cmp}")
    return _CMP[cmp]


def d_setp(ins):
    cmp, t = ins.opcode[1], type_of(ins)
    combine = next((p for p in ins.opcode[2:] if p in _BOOL), None)
    dst, a, b, *rest = ins.operands
    put_p, put_q = pair_writers(dst, "pred")
    if t in ("bf16", "f16"):
        ga, gb = float_reader(a, t), float_reader(b, t)
    else:
        rt = t.replace("b", "u") if t.startswith("b") else t
        ga, gb = reader(a, rt), reader(b, rt)
    compare = _compare(cmp, t)
    gc = reader(rest[0], "pred") if rest else None
    combine_fn = _BOOL.get(combine)

    def handler(m, L):
        r = compare(ga(m, L), gb(m, L))
        if gc is not None:
            c = gc(m, L)
            put_p(m, L, combine_fn(r, c))
            if put_q is not None:
                put_q(m, L, combine_fn(~r, c))
        else:
            put_p(m, L, r)
            if put_q is not None:
                put_q(m, L, ~r)

    return handler


def d_set(ins):
    raise UnsupportedPtx(f"{ins.where()}: set is not emulated (setp is)")


def d_selp(ins):
    t = type_of(ins)
    d, a, b, c = ins.operands
    bt = f"b{width(t)}"
    ga, gb, gc, put = reader(a, bt), reader(b, bt), reader(c, "pred"), writer(d, bt)
    return lambda m, L: put(m, L, np.where(gc(m, L), ga(m, L), gb(m, L)))


def d_slct(ins):
    types = types_of(ins.opcode)
    d, a, b, c = ins.operands
    bt = f"b{width(types[0])}"
    ga, gb, gc, put = reader(a, bt), reader(b, bt), reader(c, types[1]), writer(d, bt)
    return lambda m, L: put(m, L, np.where(gc(m, L) >= 0, ga(m, L), gb(m, L)))


# -- data movement and conversion -------------------------------------------------------------
def d_mov(ins):
    t = type_of(ins)
    dst, src = ins.operands
    if isinstance(dst, Vec):  # unpack: the first element takes the low bits
        w = width(t) // len(dst.items)
        get = reader(src, f"b{width(t)}")
        puts = [writer(item, f"b{w}") for item in dst.items]
        mask = (1 << w) - 1

        def unpack(m, L):
            bits = np.asarray(get(m, L)).astype(np.uint64)
            for i, put in enumerate(puts):
                put(m, L, ((bits >> np.uint64(i * w)) & np.uint64(mask)).astype(UNSIGNED[w]))

        return unpack
    if isinstance(src, Vec):
        w = width(t) // len(src.items)
        gets = [reader(item, f"b{w}") for item in src.items]
        put = writer(dst, f"b{width(t)}")

        def pack(m, L):
            bits = np.zeros(m.count(L), dtype=np.uint64)
            for i, get in enumerate(gets):
                bits |= np.asarray(get(m, L)).astype(np.uint64) << np.uint64(i * w)
            put(m, L, bits.astype(UNSIGNED[width(t)]))

        return pack
    rt = t if t == "pred" else f"b{width(t)}"
    get, put = reader(src, rt), writer(dst, rt)
    return lambda m, L: put(m, L, get(m, L))


def d_cvta(ins):
    d, a = ins.operands
    t = type_of(ins)
    get, put = reader(a, t), writer(d, t)
    if any(p.startswith("shared") for p in ins.opcode):
        window = np.uint64(SHARED_WINDOW)
        if "to" in ins.opcode:
            return lambda m, L: put(
                m, L, (get(m, L).astype(np.uint64) - window).astype(value_dtype(t))
            )
        return lambda m, L: put(m, L, (get(m, L).astype(np.uint64) + window).astype(value_dtype(t)))
    return lambda m, L: put(m, L, get(m, L))


_FP8_KINDS = {"e4m3x2": "e4m3", "e5m2x2": "e5m2"}


def d_cvt(ins):
    types = types_of(ins.opcode)
    if len(types) != 2:
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    dt, st = types
    mode = mode_of(ins)
    ops = ins.operands
    relu, satfinite = "relu" in ins.opcode, "satfinite" in ins.opcode
    if dt in ("bf16x2", "f16x2") and st == "f32":  # d = {cvt(a) high, cvt(b) low}
        d, a, b = ops
        ga, gb, put = reader(a, "f32"), reader(b, "f32"), writer(d, "b32")
        narrow = (
            (lambda x: f32_to_bf16(x, mode, relu, satfinite))
            if dt == "bf16x2"
            else (lambda x: f32_to_f16(np.where(x < 0, 0, x) if relu else x, mode))
        )
        return lambda m, L: put(
            m,
            L,
            (narrow(ga(m, L)).astype(np.uint32) << np.uint32(16))
            | narrow(gb(m, L)).astype(np.uint32),
        )
    if dt in _FP8_KINDS:  # d.b16 = {cvt(a) high, cvt(b) low}
        kind = _FP8_KINDS[dt]
        if st == "f32":
            d, a, b = ops
            ga, gb, put = reader(a, "f32"), reader(b, "f32"), writer(d, "b16")
            return lambda m, L: put(
                m,
                L,
                (f32_to_fp8(ga(m, L), kind, satfinite).astype(np.uint16) << 8)
                | f32_to_fp8(gb(m, L), kind, satfinite).astype(np.uint16),
            )
        if st in ("f16x2", "bf16x2"):
            d, a = ops
            ga, put = float_reader(a, st), writer(d, "b16")

            def from_halves(m, L):
                v = ga(m, L)
                put(
                    m,
                    L,
                    (f32_to_fp8(v[..., 1], kind, satfinite).astype(np.uint16) << 8)
                    | f32_to_fp8(v[..., 0], kind, satfinite).astype(np.uint16),
                )

            return from_halves
    if st in _FP8_KINDS and dt in ("f16x2", "bf16x2"):
        kind = _FP8_KINDS[st]
        d, a = ops
        ga, put = reader(a, "b16"), float_writer(d, dt)

        def widen(m, L):
            bits = np.atleast_1d(ga(m, L))
            put(m, L, np.stack([fp8_to_f32(bits & 0xFF, kind), fp8_to_f32(bits >> 8, kind)], -1))

        return widen
    d, a = ops
    if dt in ("bf16", "f16") and st in ("f32", "f64"):
        ga, put = reader(a, st), writer(d, "b16")
        narrow = (
            (lambda x: f32_to_bf16(x, mode, relu, satfinite))
            if dt == "bf16"
            else (lambda x: f32_to_f16(x, mode))
        )
        if st == "f64":
            return lambda m, L: put(m, L, narrow(_f64_to_f32_odd(ga(m, L))))
        return lambda m, L: put(m, L, narrow(ga(m, L)))
    if st in ("bf16", "f16") and dt in FLOAT_TYPES:
        ga, put = float_reader(a, st), writer(d, dt)
        return lambda m, L: put(m, L, ga(m, L).astype(value_dtype(dt)))
    if st in ("bf16", "f16") and dt in ("bf16", "f16"):
        ga = float_reader(a, st)
        put = float_writer(d, dt)
        return lambda m, L: put(m, L, ga(m, L))
    if dt in FLOAT_TYPES and st in FLOAT_TYPES:
        ga, put = reader(a, st), writer(d, dt)
        ftz, sat = "ftz" in ins.opcode, "sat" in ins.opcode

        def float_float(m, L):
            x = ga(m, L)
            if dt == "f32" and st == "f64":
                r = (
                    x.astype(np.float32)
                    if mode == "rn"
                    else round_f64_to_f32(
                        np.asarray(x, dtype=np.float64), np.zeros(np.shape(x)), mode
                    )
                )
            elif dt == "f16" and st == "f32":
                r = x.astype(np.float16)
            else:
                r = np.asarray(x).astype(value_dtype(dt))
            if (
                "rni" in ins.opcode
                or "rzi" in ins.opcode
                or "rmi" in ins.opcode
                or "rpi" in ins.opcode
            ):
                r = _round_integral(np.asarray(x, dtype=np.float64), ins).astype(value_dtype(dt))
            if ftz and dt == "f32":
                r = flush(r)
            if sat:
                r = saturate(r)
            put(m, L, r)

        return float_float
    if dt in FLOAT_TYPES and st in INT_TYPES:
        ga, put = reader(a, st), writer(d, dt)

        def int_float(m, L):
            x = np.asarray(ga(m, L))
            if dt == "f32":
                if width(st) <= 16 or mode == "rn" and width(st) == 32:
                    r = x.astype(np.float64).astype(np.float32)  # exact in f64, one rounding
                else:
                    hi = x.astype(np.float64)
                    lo = (
                        (x - hi.astype(x.dtype)).astype(np.float64)
                        if width(st) == 64
                        else np.zeros(hi.shape)
                    )
                    r = round_f64_to_f32(hi, lo, mode)
            else:
                r = x.astype(value_dtype(dt))
            put(m, L, r)

        return int_float
    if dt in INT_TYPES and (st in FLOAT_TYPES or st in ("bf16", "f16")):
        ga = float_reader(a, st) if st in ("bf16", "f16") else reader(a, st)
        put = writer(d, dt)
        info = np.iinfo(INT_TYPES[dt])

        def float_int(m, L):
            x = np.asarray(ga(m, L), dtype=np.float64)
            r = _round_integral(x, ins)
            r = np.where(np.isnan(r), 0, np.clip(r, info.min, info.max))
            put(
                m,
                L,
                (
                    r.astype(np.float64).astype(INT_TYPES[dt])
                    if width(dt) < 64
                    else np.array([int(v) for v in np.atleast_1d(r)], dtype=object).astype(
                        INT_TYPES[dt]
                    )
                ),
            )

        return float_int
    if dt in INT_TYPES and st in INT_TYPES:
        ga, put = reader(a, st), writer(d, dt)
        sat = "sat" in ins.opcode
        info = np.iinfo(INT_TYPES[dt])
        wide = (
            np.int64 if st.startswith("s") or st.startswith("u") and width(st) < 64 else np.uint64
        )

        def int_int(m, L):
            x = np.asarray(ga(m, L))
            if sat:
                y = np.clip(
                    x.astype(object) if width(st) == 64 else x.astype(np.int64), info.min, info.max
                )
                return put(m, L, np.asarray(y).astype(INT_TYPES[dt]))
            put(m, L, x.astype(wide).astype(INT_TYPES[dt]))

        return int_int
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


def _round_integral(x: np.ndarray, ins) -> np.ndarray:
    if "rni" in ins.opcode:
        return np.rint(x)
    if "rmi" in ins.opcode:
        return np.floor(x)
    if "rpi" in ins.opcode:
        return np.ceil(x)
    return np.trunc(x)


def _f64_to_f32_odd(x):
    x = np.asarray(x, dtype=np.float64)
    return odd_f32(x, np.zeros(x.shape))


DECODERS = {
    "setp": d_setp,
    "set": d_set,
    "selp": d_selp,
    "slct": d_slct,
    "mov": d_mov,
    "cvta": d_cvta,
    "cvt": d_cvt,
}
