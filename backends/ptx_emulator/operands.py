"""Operand access compiled once per instruction: ``reader(op, t)`` returns ``get(m, L)`` (the
values of ``op`` as PTX type ``t`` for lanes ``L``), ``writer(op, t)`` returns ``put(m, L, v)``.

Registers hold raw bits in an array of their declared width (bool for predicates); a value is
read through a view of its type. ``L`` is ``slice(None)`` (every lane of the batch) or an
index array.
"""

from __future__ import annotations

import numpy as np

from .faults import PtxFault, UnsupportedPtx
from .isa import (
    FLOAT_TYPES,
    UNSIGNED,
    Imm,
    Mem,
    Pair,
    Reg,
    Sink,
    Special,
    Sym,
    Vec,
    value_dtype,
    width,
)


def convert_bits(v: np.ndarray, dt, bits: int) -> np.ndarray:
    """Register bits ``v`` read as ``dt`` (``bits`` wide): a view when the widths match, else
    truncated or zero-extended."""
    if v.dtype == dt:
        return v
    if dt == np.bool_ or v.dtype == np.bool_:
        return v.astype(dt)
    if v.dtype.itemsize * 8 == bits:
        return v.view(dt)
    return v.astype(UNSIGNED[bits]).view(dt)


def immediate(text: str, t: str):
    """The value of an immediate operand as type ``t`` (a numpy scalar)."""
    dt = value_dtype(t)
    if text[:2] in ("0f", "0F"):
        value = np.uint32(int(text[2:], 16)).view(np.float32)
        return (
            np.asarray(value).astype(dt)[()]
            if dt in FLOAT_TYPES.values()
            else np.asarray(np.uint32(int(text[2:], 16)))
            .astype(UNSIGNED[max(8, width(t))])
            .view(dt)[()]
        )
    if text[:2] in ("0d", "0D"):
        value = np.uint64(int(text[2:], 16)).view(np.float64)
        return np.asarray(value).astype(dt)[()]
    if t == "pred":
        return np.bool_(int(text.rstrip("U"), 0) != 0)
    value = int(text.rstrip("U"), 0)
    if dt in (np.float16, np.float32, np.float64):
        return dt(value)
    bits = width(t)
    return np.asarray(value & ((1 << bits) - 1), dtype=UNSIGNED[bits]).view(dt)[()]


def reader(op, t: str):
    """``get(m, L)`` for source operand ``op`` read as type ``t``."""
    dt, bits = value_dtype(t), width(t)
    if isinstance(op, Reg):
        name, negated = op.name, op.negated

        def get(m, L):
            arr = m.regs.get(name)
            if arr is None:
                arr = m.new_register(name, t)
            if m.poisoned and name in m.poisoned:
                m.check_poisoned(name, L)
            v = convert_bits(arr[L], dt, bits)
            return ~v if negated else v

        return get
    if isinstance(op, Imm):
        value = immediate(op.text, t)
        return lambda m, L: value
    if isinstance(op, Special):
        name = op.name
        return lambda m, L: m.special(name)[L].astype(dt)
    if isinstance(op, Sym):
        name = op.name

        def symbol(m, L):
            return np.asarray(m.symbol_address(name)).astype(UNSIGNED[max(bits, 8)]).view(dt)[()]

        return symbol
    raise UnsupportedPtx(f"cannot read operand {op} as .{t}")


def writer(op, t: str):
    """``put(m, L, values)`` for destination operand ``op`` of type ``t``."""
    if isinstance(op, Sink):
        return lambda m, L, v: None
    if not isinstance(op, Reg):
        raise UnsupportedPtx(f"cannot write operand {op}")
    name, dt = op.name, value_dtype(t)

    def put(m, L, v):
        arr = m.regs.get(name)
        if arr is None:
            arr = m.new_register(name, t)
        if m.guarded and name in m.guarded:
            m.check_guarded(name, L)
        v = np.asarray(v)
        if v.dtype != dt:
            if v.dtype.kind == "f" and np.dtype(dt).kind != "f" and dt != np.bool_:
                raise PtxFault(f"internal: float values written to .{t} register {name}")
            v = v.astype(dt)
        if arr.dtype == v.dtype:
            arr[L] = v
        elif arr.dtype.itemsize == v.dtype.itemsize and arr.dtype != np.bool_:
            arr[L] = v.view(arr.dtype)
        elif arr.dtype == np.bool_:
            arr[L] = v != 0
        elif v.dtype.kind == "i":  # sign-extended (or truncated)
            arr[L] = v.astype(np.int64).astype(arr.dtype)
        else:
            arr[L] = v.view(UNSIGNED[v.dtype.itemsize * 8]).astype(arr.dtype)

    return put


def pair_writers(op, t: str):
    """(value writer, predicate writer or None) for a ``d|p`` destination."""
    if isinstance(op, Pair):
        return writer(op.value, t), writer(op.pred, "pred")
    return writer(op, t), None


def vector_readers(op, t: str) -> list:
    """Readers of each element of a ``{a, b, ...}`` operand (or of a single operand)."""
    items = op.items if isinstance(op, Vec) else (op,)
    return [reader(item, t) for item in items]


def vector_writers(op, t: str) -> list:
    items = op.items if isinstance(op, Vec) else (op,)
    return [writer(item, t) for item in items]


def register_names(op) -> list[str]:
    """The register names of a vector (or single register) operand."""
    items = op.items if isinstance(op, Vec) else (op,)
    return [item.name for item in items]


def address_reader(mem: Mem):
    """``get(m, L) -> uint64 addresses`` of ``[base + offset]`` (base a register, symbol or
    immediate)."""
    if not isinstance(mem, Mem):
        raise UnsupportedPtx(f"expected a memory operand, got {mem}")
    offset = np.uint64(mem.offset & ((1 << 64) - 1))
    base = mem.base
    if isinstance(base, Reg):
        get = reader(base, "u64")
        return lambda m, L: get(m, L).astype(np.uint64) + offset
    if isinstance(base, Sym):
        name = base.name
        return lambda m, L: np.full(m.count(L), m.symbol_address(name), dtype=np.uint64) + offset
    if isinstance(base, Imm):
        value = np.uint64(int(base.text, 0) & ((1 << 64) - 1))
        return lambda m, L: np.full(m.count(L), value, dtype=np.uint64) + offset
    raise UnsupportedPtx(f"cannot address through {base}")


def scalar_of(op, t: str = "u32") -> int:
    """The value of an immediate operand (an instruction's compile-time field)."""
    if not isinstance(op, Imm):
        raise UnsupportedPtx(f"expected an immediate, got {op}")
    return int(immediate(op.text, t))
