"""PTX text parsed into instructions, and a launch over batches of CTAs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .faults import MAX_LANES_PER_BATCH, PtxFault

if TYPE_CHECKING:
    from .memory import Memory


# -- operands ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reg:
    name: str


@dataclass(frozen=True)
class Imm:
    text: str


@dataclass(frozen=True)
class Special:
    name: str


@dataclass(frozen=True)
class Sym:
    name: str


@dataclass(frozen=True)
class Mem:
    base: object    # Reg, Sym or Imm
    offset: int


@dataclass(frozen=True)
class Vec:
    items: tuple


@dataclass(frozen=True)
class Label:
    name: str


_SPECIALS = {"%tid.x", "%tid.y", "%tid.z", "%ntid.x", "%ntid.y", "%ntid.z", "%ctaid.x",
             "%ctaid.y", "%ctaid.z", "%nctaid.x", "%nctaid.y", "%nctaid.z", "%laneid",
             "%warpid"}


def _operand(text: str):
    text = text.strip()
    if text.startswith("{"):
        return Vec(tuple(_operand(p) for p in text.strip("{}").split(",")))
    if text.startswith("["):
        inner = text.strip("[]").strip()
        m = re.fullmatch(r"(.+?)\s*\+\s*(-?\w+)", inner)
        base, offset = (m.group(1), int(m.group(2), 0)) if m else (inner, 0)
        return Mem(_operand(base), offset)
    if text in _SPECIALS:
        return Special(text)
    if text.startswith("%"):
        return Reg(text)
    if text.startswith("$"):
        return Label(text)
    if re.fullmatch(r"0[fFdD][0-9a-fA-F]+|-?(0[xX][0-9a-fA-F]+|\d+)U?", text):
        return Imm(text)
    return Sym(text)


def _split_operands(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


@dataclass(frozen=True)
class Instr:
    text: str
    guard: str | None
    guard_negated: bool
    opcode: tuple[str, ...]
    operands: tuple


@dataclass
class PtxProgram:
    """One ``.entry`` of a PTX module, parsed: parameters, instructions, labels, block shape."""

    name: str
    params: list[tuple[str, str]]                 # (name, type)
    instrs: list[Instr]
    labels: dict[str, int]
    reqntid: tuple[int, int, int] | None
    dynamic_shared_symbol: str | None = None

    @classmethod
    def parse(cls, ptx: str, entry: str | None = None) -> "PtxProgram":
        text = re.sub(r"//[^\n]*", "", ptx)
        dyn = re.search(r"\.extern\s+\.shared\s+(?:\.align\s+\d+\s+)?\.b8\s+(\w+)\s*\[\s*\]", text)
        entries = list(re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)\s*([^{]*)\{", text, re.S))
        if entry is not None:
            entries = [m for m in entries if m.group(1) == entry]
        if len(entries) != 1:
            raise PtxFault(f"expected one .entry{' named ' + entry if entry else ''} in the PTX, "
                           f"found {len(entries)}")
        m = entries[0]
        params = []
        for decl in m.group(2).split(","):
            words = decl.split()
            if not words:
                continue
            if "[" in decl:
                raise PtxFault(f"byte-array kernel parameters are not emulated: {decl.strip()}")
            params.append((words[-1], words[1].lstrip(".")))
        req = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", m.group(3))
        reqntid = tuple(int(g or 1) for g in req.groups()) if req else None
        body_start = m.end()
        depth, i = 1, body_start
        while depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        body = text[body_start:i - 1]
        instrs, labels = [], {}
        for raw in body.split(";"):
            stmt = raw.strip()
            while True:
                lm = re.match(r"(\$?[\w$]+):\s*", stmt)
                if not lm:
                    break
                labels[lm.group(1)] = len(instrs)
                stmt = stmt[lm.end():]
            if not stmt or stmt.startswith((".reg", ".pragma")):
                continue
            if stmt.startswith((".local", ".shared")):
                raise PtxFault(f"kernel-scope {stmt.split()[0]} declarations are not emulated: {stmt}")
            guard, negated = None, False
            gm = re.match(r"@(!?)(%\w+)\s+", stmt)
            if gm:
                negated, guard = gm.group(1) == "!", gm.group(2)
                stmt = stmt[gm.end():]
            op, rest = (re.split(r"\s+", stmt, maxsplit=1) + [""])[:2]
            instrs.append(Instr(" ".join(stmt.split()), guard, negated, tuple(op.split(".")),
                                tuple(_operand(o) for o in _split_operands(rest))))
        return cls(m.group(1), params, instrs, labels, reqntid, dyn.group(1) if dyn else None)

    def launch(self, grid: Sequence[int], params: Sequence, memory: "Memory",
               dynamic_shared_bytes: int = 0, block: Sequence[int] | None = None) -> None:
        """Runs the kernel over ``grid`` CTAs of ``block`` threads (default: ``.reqntid``).
        ``params`` are the kernel parameters in order: ints (pointers, integers) or floats."""
        if block is None:
            if self.reqntid is None:
                raise PtxFault(f"{self.name} declares no .reqntid; pass block=")
            block = self.reqntid
        block = tuple(block) + (1,) * (3 - len(block))
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if len(params) != len(self.params):
            raise PtxFault(f"{self.name} takes {len(self.params)} parameters, got {len(params)}")
        threads = block[0] * block[1] * block[2]
        ctas = grid[0] * grid[1] * grid[2]
        per_batch = max(1, MAX_LANES_PER_BATCH // threads)
        from .machine import Machine  # machine.py imports this module's operand types
        for first in range(0, ctas, per_batch):
            Machine(self, grid, block, params, memory, dynamic_shared_bytes,
                    range(first, min(ctas, first + per_batch))).run()
