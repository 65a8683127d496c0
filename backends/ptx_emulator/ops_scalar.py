"""Per-thread arithmetic and logic: integer and float add/sub/mul/mad/fma/div/rem/min/max/abs/neg,
bitwise and shift operations, bit-field and byte permutes, and the transcendental functions.

Each decoder takes an ``Instr`` and returns ``handler(m, L)``.
"""

from __future__ import annotations

import numpy as np

from .faults import UnsupportedPtx
from .floats import arith, float_op, is_float, rounded, sign_bits, type_of, unary
from .isa import INT_TYPES, UNSIGNED, value_dtype, width
from .operands import immediate, reader, writer
from .values import f32_op


def d_add(ins):
    return float_op(ins, arith("add"), 2) if is_float(ins) else _int_binary(ins, np.add)


def d_sub(ins):
    return float_op(ins, arith("sub"), 2) if is_float(ins) else _int_binary(ins, np.subtract)


def d_fma(ins):
    return float_op(ins, arith("fma"), 3)


def _minmax(ins, pick):
    t = type_of(ins)
    nan = "NaN" in ins.opcode
    if t in INT_TYPES or t in ("s16x2", "u16x2"):
        relu = "relu" in ins.opcode
        base = _int_binary(ins, pick)
        if not relu:
            return base
        d, a, b = ins.operands
        ga, gb, put = reader(a, t), reader(b, t), writer(d, t)
        return lambda m, L: put(m, L, np.maximum(pick(ga(m, L), gb(m, L)), 0))

    def pair(x, y):
        fm = {np.maximum: np.fmax, np.minimum: np.fmin}[pick]
        r = (pick if nan else fm)(x, y)
        # -0 < +0 for min/max
        both_zero = (x == 0) & (y == 0)
        if np.any(both_zero):
            neg = (
                np.signbit(x) | np.signbit(y)
                if pick is np.minimum
                else np.signbit(x) & np.signbit(y)
            )
            r = np.where(both_zero, np.where(neg, -0.0, 0.0).astype(r.dtype), r)
        return r

    def fn(mode, wide, *xs):  # two sources, or three (sm_100: max.f32 d, a, b, c)
        r = pair(xs[0], xs[1])
        for x in xs[2:]:
            r = pair(r, x)
        if "relu" in ins.opcode:
            r = np.where(r < 0, np.zeros_like(r), r)
        return r

    return float_op(ins, fn, len(ins.operands) - 1)


def d_max(ins):
    return _minmax(ins, np.maximum)


def d_min(ins):
    return _minmax(ins, np.minimum)


# -- integers ----------------------------------------------------------------------------------
def _packed16(t):
    return t in ("s16x2", "u16x2")


def _int_binary(ins, fn):
    t = type_of(ins)
    d, a, b = ins.operands
    if _packed16(t):
        et = "s16" if t == "s16x2" else "u16"
        ga, gb, put = reader(a, "b32"), reader(b, "b32"), writer(d, "b32")

        def packed(m, L):
            x, y = np.atleast_1d(ga(m, L)), np.atleast_1d(gb(m, L))
            lo = fn(
                (x & 0xFFFF).astype(np.uint16).view(INT_TYPES[et]),
                (y & 0xFFFF).astype(np.uint16).view(INT_TYPES[et]),
            )
            hi = fn(
                (x >> 16).astype(np.uint16).view(INT_TYPES[et]),
                (y >> 16).astype(np.uint16).view(INT_TYPES[et]),
            )
            put(
                m,
                L,
                lo.astype(INT_TYPES[et]).view(np.uint16).astype(np.uint32)
                | (hi.astype(INT_TYPES[et]).view(np.uint16).astype(np.uint32) << np.uint32(16)),
            )

        return packed
    if t not in INT_TYPES:
        raise UnsupportedPtx(f"{ins.where()}: type .{t} is not emulated")
    dt = INT_TYPES[t]
    ga, gb, put = reader(a, t), reader(b, t), writer(d, t)
    if "sat" in ins.opcode:

        def saturating(m, L):
            r = fn(ga(m, L).astype(np.int64), gb(m, L).astype(np.int64))
            info = np.iinfo(dt)
            put(m, L, np.clip(r, info.min, info.max).astype(dt))

        return saturating
    return lambda m, L: put(m, L, fn(ga(m, L), gb(m, L)).astype(dt))


def _bitwise(fn):
    def decode(ins):
        t = type_of(ins)
        d, a, b = ins.operands
        ga, gb, put = reader(a, t), reader(b, t), writer(d, t)
        return lambda m, L: put(m, L, fn(ga(m, L), gb(m, L)))

    return decode


d_and = _bitwise(np.bitwise_and)
d_or = _bitwise(np.bitwise_or)
d_xor = _bitwise(np.bitwise_xor)


def d_not(ins):
    t = type_of(ins)
    d, a = ins.operands
    ga, put = reader(a, t), writer(d, t)
    return lambda m, L: put(m, L, ~ga(m, L))


def d_cnot(ins):
    t = type_of(ins)
    d, a = ins.operands
    ga, put = reader(a, t), writer(d, t)
    return lambda m, L: put(m, L, (ga(m, L) == 0).astype(value_dtype(t)))


def d_lop3(ins):
    d, a, b, c, lut = ins.operands
    table = int(immediate(lut.text, "u32")) & 0xFF
    ga, gb, gc, put = reader(a, "b32"), reader(b, "b32"), reader(c, "b32"), writer(d, "b32")

    def handler(m, L):
        x, y, z = ga(m, L), gb(m, L), gc(m, L)
        r = np.zeros(np.broadcast(x, y, z).shape, dtype=np.uint32)
        for k in range(8):
            if table >> k & 1:
                r |= (x if k & 4 else ~x) & (y if k & 2 else ~y) & (z if k & 1 else ~z)
        put(m, L, r)

    return handler


def d_mul(ins):
    t = type_of(ins)
    if is_float(ins):
        return float_op(ins, arith("mul"), 2)
    d, a, b = ins.operands
    w = width(t)
    ga, gb = reader(a, t), reader(b, t)
    signed = t.startswith("s")
    if "wide" in ins.opcode:
        wide = ("s" if signed else "u") + str(2 * w)
        put = writer(d, wide)
        return lambda m, L: put(
            m, L, ga(m, L).astype(INT_TYPES[wide]) * gb(m, L).astype(INT_TYPES[wide])
        )
    put = writer(d, t)
    if "hi" in ins.opcode:
        return lambda m, L: put(m, L, _mul_hi(ga(m, L), gb(m, L), w, signed))
    if "lo" in ins.opcode or "mul24" in ins.opcode[0]:
        return lambda m, L: put(m, L, (ga(m, L) * gb(m, L)).astype(INT_TYPES[t]))
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


def _mul_hi(x, y, w: int, signed: bool):
    if w <= 32:
        wide = np.int64 if signed else np.uint64
        return ((x.astype(wide) * y.astype(wide)) >> w).astype(x.dtype)
    xs = np.atleast_1d(x).astype(object)
    ys = np.atleast_1d(y).astype(object)
    r = np.array(
        [(int(p) * int(q)) >> 64 for p, q in zip(*np.broadcast_arrays(xs, ys))], dtype=object
    )
    return (
        r.astype(np.int64 if signed else np.uint64)
        if signed
        else np.array([int(v) & ((1 << 64) - 1) for v in r], dtype=np.uint64)
    )


def d_mad(ins):
    t = type_of(ins)
    if is_float(ins):
        return float_op(ins, arith("fma"), 3)
    d, a, b, c = ins.operands
    w, signed = width(t), t.startswith("s")
    ga, gb = reader(a, t), reader(b, t)
    if "wide" in ins.opcode:
        wide = ("s" if signed else "u") + str(2 * w)
        gc, put = reader(c, wide), writer(d, wide)
        dt = INT_TYPES[wide]
        return lambda m, L: put(m, L, ga(m, L).astype(dt) * gb(m, L).astype(dt) + gc(m, L))
    gc, put = reader(c, t), writer(d, t)
    if "hi" in ins.opcode:
        return lambda m, L: put(
            m, L, (_mul_hi(ga(m, L), gb(m, L), w, signed) + gc(m, L)).astype(INT_TYPES[t])
        )
    if "lo" in ins.opcode:
        return lambda m, L: put(m, L, (ga(m, L) * gb(m, L) + gc(m, L)).astype(INT_TYPES[t]))
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


def _int_divide(ins, remainder: bool):
    t = type_of(ins)
    d, a, b = ins.operands
    ga, gb, put = reader(a, t), reader(b, t), writer(d, t)
    dt = INT_TYPES[t]

    def handler(m, L):
        x, y = np.atleast_1d(ga(m, L)), np.atleast_1d(gb(m, L))
        x, y = np.broadcast_arrays(x, y)
        zero = y == 0
        safe = np.where(zero, 1, y)
        if t.startswith("s"):
            xx, yy = x.astype(object) if width(t) == 64 else x.astype(np.int64), (
                safe.astype(object) if width(t) == 64 else safe.astype(np.int64)
            )
            q = np.abs(xx) // np.abs(yy) * np.sign(xx) * np.sign(yy)
            r = xx - q * yy
            out = r if remainder else q
            out = (
                np.array([int(v) for v in out.ravel()], dtype=object).astype(np.int64)
                if width(t) == 64
                else out
            )
            out = out.astype(np.int64).astype(dt)
        else:
            out = (x % safe) if remainder else (x // safe)
        put(m, L, np.where(zero, (x if remainder else np.asarray(-1).astype(dt)), out).astype(dt))

    return handler


def d_div(ins):
    t = type_of(ins)
    if t in INT_TYPES:
        return _int_divide(ins, False)

    def fn(mode, wide, x, y):
        if wide is True:
            return x / y
        return f32_op("div", mode, x, y)

    return float_op(ins, fn, 2)


def d_rem(ins):
    return _int_divide(ins, True)


def d_abs(ins):
    t = type_of(ins)
    d, a = ins.operands
    if t in INT_TYPES:
        ga, put = reader(a, t), writer(d, t)
        return lambda m, L: put(m, L, np.abs(ga(m, L)).astype(INT_TYPES[t]))
    return sign_bits(ins, lambda bits, mask: bits & ~mask)


def d_neg(ins):
    t = type_of(ins)
    d, a = ins.operands
    if t in INT_TYPES:
        ga, put = reader(a, t), writer(d, t)
        return lambda m, L: put(m, L, (-ga(m, L)).astype(INT_TYPES[t]))
    return sign_bits(ins, lambda bits, mask: bits ^ mask)


def d_shl(ins):
    t = type_of(ins)
    d, a, b = ins.operands
    w = width(t)
    ga, gb, put = reader(a, f"b{w}"), reader(b, "u32"), writer(d, f"b{w}")
    ut = UNSIGNED[w]

    def handler(m, L):
        x, n = ga(m, L), gb(m, L).astype(np.uint64)
        r = (
            (x.astype(np.uint64) << np.minimum(n, 63))
            if w < 64
            else x << np.minimum(n, 63).astype(ut)
        )
        put(m, L, np.where(n >= w, 0, r).astype(ut))

    return handler


def d_shr(ins):
    t = type_of(ins)
    d, a, b = ins.operands
    w = width(t)
    ga, gb, put = reader(a, t), reader(b, "u32"), writer(d, t)
    dt = value_dtype(t)

    def handler(m, L):
        x, n = ga(m, L), gb(m, L)
        if t.startswith("s"):
            r = x >> np.minimum(n, w - 1).astype(dt)
        else:
            r = np.where(n >= w, 0, x >> np.minimum(n, w - 1).astype(dt))
        put(m, L, np.asarray(r).astype(dt))

    return handler


def d_bfe(ins):
    t = type_of(ins)
    d, a, b, c = ins.operands
    w, signed = width(t), t.startswith("s")
    ga, gb, gc, put = reader(a, f"u{w}"), reader(b, "u32"), reader(c, "u32"), writer(d, t)
    ut = UNSIGNED[w]

    def handler(m, L):
        x = ga(m, L).astype(np.uint64)
        pos = (gb(m, L) & 0xFF).astype(np.uint64)
        length = (gc(m, L) & 0xFF).astype(np.uint64)
        x, pos, length = np.broadcast_arrays(x, pos, length)
        shifted = np.where(pos >= w, 0, x >> np.minimum(pos, 63))
        mask = np.where(
            length >= 64,
            np.uint64(0xFFFFFFFFFFFFFFFF),
            (np.uint64(1) << np.minimum(length, 63)) - np.uint64(1),
        )
        field = shifted & mask
        if signed:
            top = np.minimum(pos + length - np.uint64(1), np.uint64(w - 1))
            sbit = np.where(length == 0, 0, (x >> top) & np.uint64(1))
            field = np.where((sbit == 1) & (length < w), field | ~mask, field)
        put(m, L, field.astype(ut).view(value_dtype(t)))

    return handler


def d_bfi(ins):
    t = type_of(ins)
    d, f, b, p, n = ins.operands
    w = width(t)
    gf, gb = reader(f, f"b{w}"), reader(b, f"b{w}")
    gp, gn, put = reader(p, "u32"), reader(n, "u32"), writer(d, f"b{w}")

    def handler(m, L):
        pos = (gp(m, L) & 0xFF).astype(np.uint64)
        length = (gn(m, L) & 0xFF).astype(np.uint64)
        mask = np.where(
            length >= 64,
            np.uint64(0xFFFFFFFFFFFFFFFF),
            (np.uint64(1) << np.minimum(length, 63)) - np.uint64(1),
        )
        mask = np.where(pos >= w, 0, mask << np.minimum(pos, 63))
        src = np.where(pos >= w, 0, gf(m, L).astype(np.uint64) << np.minimum(pos, 63))
        r = (gb(m, L).astype(np.uint64) & ~mask) | (src & mask)
        put(m, L, r.astype(UNSIGNED[w]))

    return handler


def d_prmt(ins):
    d, a, b, c = ins.operands
    if len(ins.opcode) > 2:
        raise UnsupportedPtx(f"{ins.where()}: prmt modes are not emulated")
    ga, gb, gc, put = reader(a, "b32"), reader(b, "b32"), reader(c, "b32"), writer(d, "b32")

    def handler(m, L):
        x, y, sel = np.broadcast_arrays(
            np.atleast_1d(ga(m, L)), np.atleast_1d(gb(m, L)), np.atleast_1d(gc(m, L))
        )
        source = x.astype(np.uint64) | (y.astype(np.uint64) << np.uint64(32))
        r = np.zeros(x.shape, dtype=np.uint32)
        for i in range(4):
            s = (sel >> np.uint32(4 * i)) & np.uint32(0xF)
            byte = (
                (source >> ((s & 7).astype(np.uint64) * np.uint64(8))) & np.uint64(0xFF)
            ).astype(np.uint32)
            byte = np.where(s & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint32)
            r |= byte << np.uint32(8 * i)
        put(m, L, r)

    return handler


def d_popc(ins):
    t = type_of(ins)
    d, a = ins.operands
    ga, put = reader(a, t), writer(d, "u32")

    def handler(m, L):
        x = np.atleast_1d(ga(m, L)).astype(np.uint64)
        count = np.zeros(x.shape, dtype=np.uint32)
        for i in range(width(t)):
            count += ((x >> np.uint64(i)) & np.uint64(1)).astype(np.uint32)
        put(m, L, count)

    return handler


def d_clz(ins):
    t = type_of(ins)
    d, a = ins.operands
    ga, put, w = reader(a, t), writer(d, "u32"), width(t)

    def handler(m, L):
        x = np.atleast_1d(ga(m, L)).astype(np.uint64)
        n = np.full(x.shape, w, dtype=np.uint32)
        for i in range(w):
            n = np.where((x >> np.uint64(i)) & np.uint64(1), np.uint32(w - 1 - i), n)
        put(m, L, n)

    return handler


def d_brev(ins):
    t = type_of(ins)
    d, a = ins.operands
    ga, put, w = reader(a, t), writer(d, t), width(t)

    def handler(m, L):
        x = np.atleast_1d(ga(m, L)).astype(np.uint64)
        r = np.zeros(x.shape, dtype=np.uint64)
        for i in range(w):
            r |= ((x >> np.uint64(i)) & np.uint64(1)) << np.uint64(w - 1 - i)
        put(m, L, r.astype(UNSIGNED[w]))

    return handler


# -- transcendental and special functions (exact, rounded once) --------------------------------
d_ex2 = unary(lambda x, mode: np.exp2(x))
d_lg2 = unary(lambda x, mode: np.log2(x))
d_sin = unary(lambda x, mode: np.sin(x))
d_cos = unary(lambda x, mode: np.cos(x))
d_tanh = unary(lambda x, mode: np.tanh(x))
d_rsqrt = unary(lambda x, mode: 1.0 / np.sqrt(x))
d_sqrt = unary(rounded("sqrt"))
d_rcp = unary(rounded("rcp"))


def d_copysign(ins):
    t = type_of(ins)
    d, a, b = ins.operands
    ga, gb, put = reader(a, t), reader(b, t), writer(d, t)
    return lambda m, L: put(m, L, np.copysign(gb(m, L), ga(m, L)))


def d_testp(ins):
    kind, t = ins.opcode[1], type_of(ins)
    d, a = ins.operands
    ga, put = reader(a, t), writer(d, "pred")
    tiny = np.finfo(value_dtype(t)).tiny
    tests = {
        "finite": np.isfinite,
        "infinite": np.isinf,
        "number": lambda x: ~np.isnan(x),
        "notanumber": np.isnan,
        "normal": lambda x: np.isfinite(x) & (np.abs(x) >= tiny),
        "subnormal": lambda x: (np.abs(x) < tiny) & (x != 0),
    }
    return lambda m, L: put(m, L, tests[kind](ga(m, L)))


# -- comparison and selection -----------------------------------------------------------------


DECODERS = {
    "add": d_add,
    "sub": d_sub,
    "mul": d_mul,
    "mad": d_mad,
    "fma": d_fma,
    "div": d_div,
    "rem": d_rem,
    "min": d_min,
    "max": d_max,
    "abs": d_abs,
    "neg": d_neg,
    "and": d_and,
    "or": d_or,
    "xor": d_xor,
    "not": d_not,
    "cnot": d_cnot,
    "lop3": d_lop3,
    "shl": d_shl,
    "shr": d_shr,
    "bfe": d_bfe,
    "bfi": d_bfi,
    "prmt": d_prmt,
    "popc": d_popc,
    "clz": d_clz,
    "brev": d_brev,
    "ex2": d_ex2,
    "lg2": d_lg2,
    "sin": d_sin,
    "cos": d_cos,
    "tanh": d_tanh,
    "rsqrt": d_rsqrt,
    "sqrt": d_sqrt,
    "rcp": d_rcp,
    "copysign": d_copysign,
    "testp": d_testp,
    "mul24": d_mul,
}
