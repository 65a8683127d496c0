"""The PTX the emulator knows: operand kinds, a parsed instruction, value types and their widths.

Both the parser (text -> ``Instr``) and the machine (``Instr`` -> effect) import this module and
nothing of each other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np


# -- operands ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reg:
    """A register (``%r12``, a scoped ``complete@3``); ``negated`` for ``!%p`` sources."""

    name: str
    negated: bool = False


@dataclass(frozen=True)
class Imm:
    """An immediate: an integer, or the raw bits of a float (``0f3F800000``, ``0d...``)."""

    text: str


@dataclass(frozen=True)
class Special:
    """A special register (``%tid.x``, ``%laneid``...)."""

    name: str


@dataclass(frozen=True)
class Sym:
    """A module-scope symbol (the dynamic shared array, a global byte array)."""

    name: str


@dataclass(frozen=True)
class Sink:
    """``_``: a destination whose value is discarded."""


@dataclass(frozen=True)
class Mem:
    """``[base + offset]``; ``coords`` for a tensor access ``[tensormap, {c0, c1...}]``."""

    base: object  # Reg, Sym or Imm
    offset: int
    coords: tuple = ()


@dataclass(frozen=True)
class Vec:
    """``{a, b, ...}``."""

    items: tuple


@dataclass(frozen=True)
class Pair:
    """``d|p``: a value and a predicate destination (``elect.sync %r|%p``, ``shfl.sync``)."""

    value: object
    pred: object


@dataclass(frozen=True)
class Label:
    name: str


@dataclass(frozen=True)
class Instr:
    """One PTX instruction: ``opcode`` split at its dots, operands parsed, an optional guard
    predicate; ``line`` is its line in the PTX text and ``loc`` the source position the
    compiler attached (``.loc``), for fault messages."""

    text: str
    guard: str | None
    guard_negated: bool
    opcode: tuple[str, ...]
    operands: tuple
    line: int = 0
    loc: str | None = None

    def where(self) -> str:
        """``'text' (PTX line N, file.py:L)`` for messages."""
        place = f"PTX line {self.line}" + (f", {self.loc}" if self.loc else "")
        return f"'{self.text}' ({place})"


SPECIAL_REGISTERS = frozenset(
    [
        f"%{n}.{a}"
        for n in ("tid", "ntid", "ctaid", "nctaid", "cluster_ctaid", "cluster_nctaid")
        for a in "xyz"
    ]
    + [
        "%laneid",
        "%warpid",
        "%nwarpid",
        "%smid",
        "%nsmid",
        "%cluster_ctarank",
        "%cluster_nctarank",
        "%dynamic_smem_size",
        "%total_smem_size",
        "%lanemask_eq",
        "%lanemask_lt",
        "%lanemask_le",
        "%lanemask_gt",
        "%lanemask_ge",
    ]
)

_INT_IMMEDIATE = re.compile(r"-?(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9]\d*)U?")
_FLOAT_IMMEDIATE = re.compile(r"0[fF][0-9a-fA-F]{8}|0[dD][0-9a-fA-F]{16}")


def parse_operand(text: str):
    """One operand's text -> its operand object."""
    text = text.strip()
    if text.startswith("{"):
        return Vec(tuple(parse_operand(p) for p in split_operands(text[1:-1])))
    if text.startswith("["):
        return _memory(text[1:-1].strip())
    if "|" in text:
        value, pred = text.split("|")
        return Pair(parse_operand(value), parse_operand(pred))
    if text == "_":
        return Sink()
    if text.startswith("!"):
        inner = parse_operand(text[1:])
        if not isinstance(inner, Reg):
            raise ValueError(f"negation of a non-register operand {text!r}")
        return Reg(inner.name, True)
    if text in SPECIAL_REGISTERS:
        return Special(text)
    if text.startswith("%"):
        return Reg(text)
    if text.startswith("$"):
        return Label(text)
    if _FLOAT_IMMEDIATE.fullmatch(text) or _INT_IMMEDIATE.fullmatch(text):
        return Imm(text)
    return Sym(text)


def _memory(inner: str) -> Mem:
    coords = ()
    if "," in inner:  # [tensormap, {c0, c1, ...}]
        base_text, coord_text = inner.split(",", 1)
        coords = parse_operand(coord_text.strip()).items
        inner = base_text.strip()
    m = re.fullmatch(r"(.+?)\s*(\+\s*-|\+|-)\s*(\w+)", inner)
    if m and not inner.startswith("-"):
        offset = int(m.group(3), 0) * (1 if m.group(2) == "+" else -1)
        return Mem(parse_operand(m.group(1)), offset, coords)
    return Mem(parse_operand(inner), 0, coords)


def split_operands(text: str) -> list[str]:
    """Splits at the commas that are not inside braces or brackets."""
    if "{" not in text and "[" not in text:
        return [p.strip() for p in text.split(",") if p.strip()]
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


# -- value types ---------------------------------------------------------------------------------
INT_TYPES = {
    "b8": np.uint8,
    "u8": np.uint8,
    "s8": np.int8,
    "b16": np.uint16,
    "u16": np.uint16,
    "s16": np.int16,
    "b32": np.uint32,
    "u32": np.uint32,
    "s32": np.int32,
    "b64": np.uint64,
    "u64": np.uint64,
    "s64": np.int64,
}
FLOAT_TYPES = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
PACKED_TYPES = {
    "bf16": 16,
    "bf16x2": 32,
    "f16x2": 32,
    "f32x2": 64,
    "s16x2": 32,
    "u16x2": 32,
    "e4m3x2": 16,
    "e5m2x2": 16,
    "e4m3x4": 32,
    "e5m2x4": 32,
    "tf32": 32,
}
TYPE_NAMES = frozenset(INT_TYPES) | frozenset(FLOAT_TYPES) | frozenset(PACKED_TYPES) | {"pred"}
ROUNDING = ("rn", "rm", "rp", "rz", "rna")
SHARED_WINDOW = 1 << 60  # generic addresses of a CTA's shared memory start here
STATE_SPACES = ("param", "global", "shared", "local", "const")


def width(t: str) -> int:
    """Bits of a value of type ``t`` (1 for pred)."""
    if t == "pred":
        return 1
    if t in PACKED_TYPES:
        return PACKED_TYPES[t]
    return int(re.sub(r"\D", "", t))


def storage_dtype(t: str):
    """The numpy dtype a register declared ``.t`` is stored as (bits; bool for predicates)."""
    return np.bool_ if t == "pred" else UNSIGNED[width(t)]


def value_dtype(t: str):
    """The numpy dtype values of type ``t`` are computed in (raw unsigned bits for the packed
    and bf16 types)."""
    if t == "pred":
        return np.bool_
    if t in FLOAT_TYPES:
        return FLOAT_TYPES[t]
    if t in INT_TYPES:
        return INT_TYPES[t]
    return UNSIGNED[width(t)]


def types_of(opcode: tuple[str, ...]) -> list[str]:
    """The type suffixes of an opcode, in order (``cvt.rn.bf16.f32`` -> [bf16, f32])."""
    return [p for p in opcode[1:] if p in TYPE_NAMES]
