"""PTX text parsed into one kernel entry: parameters, register declarations, instructions, labels,
launch bounds and the module's shared and global symbols.

What Triton and CuTe DSL emit is accepted: ``.loc``/``.file`` debug lines (kept as each
instruction's source position), debug sections, inline-asm scopes ``{ ... }`` with their own
``.reg`` declarations and labels (renamed apart, so two scopes may both say ``waitLoop``), and
the hidden trailing parameters of Triton's entries (global and profile scratch).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .collector import collector_paused
from .faults import PtxFault
from .isa import Instr, Label, Mem, Pair, Reg, Sym, Vec, parse_operand, split_operands

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


@dataclass(frozen=True)
class Param:
    """A kernel parameter: name, PTX type, and its byte size (``.b8 name[128]`` arrays)."""

    name: str
    type: str
    size: int


@dataclass(frozen=True)
class GlobalData:
    """A module-scope ``.global`` or ``.const`` byte array and its initial bytes."""

    name: str
    data: bytes
    align: int


@dataclass
class PtxProgram:
    """One ``.entry`` of a PTX module, parsed.

    ``registers`` maps every register name (scoped ones renamed ``name@scope``) to its declared
    type; ``instrs`` are in program order with ``labels`` indexing them; ``reqntid``/``maxntid``
    are the launch bounds; ``dynamic_shared_symbol`` names the ``.extern .shared`` array (at
    shared offset 0 after the static ``shared_symbols``, whose offsets and sizes it lists);
    ``target`` is the ``.target`` architecture (sm_80, sm_90a, sm_100a)."""

    name: str
    params: list[Param]
    registers: dict[str, str]
    instrs: list[Instr]
    labels: dict[str, int]
    target: str = ""
    reqntid: tuple[int, int, int] | None = None
    maxntid: tuple[int, int, int] | None = None
    dynamic_shared_symbol: str | None = None
    shared_symbols: dict[str, tuple[int, int]] = field(default_factory=dict)
    global_data: dict[str, GlobalData] = field(default_factory=dict)

    @property
    def static_shared_bytes(self) -> int:
        """Bytes of the module's static ``.shared`` arrays (before the dynamic array)."""
        return max((o + s for o, s in self.shared_symbols.values()), default=0)

    @classmethod
    def parse(cls, ptx: str, entry: str | None = None) -> PtxProgram:
        """The entry named ``entry`` (or the module's only one) of ``ptx``."""
        with collector_paused():
            return cls._parse(ptx, entry)

    @classmethod
    def _parse(cls, ptx: str, entry: str | None) -> PtxProgram:
        files = dict(re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]*)"', ptx, re.M))
        text = _COMMENTS.sub("", ptx)
        text = re.split(r"^\s*\.section\b", text, flags=re.M)[0]
        target = re.search(r"^\s*\.target\s+(\w+)", text, re.M)
        entries = list(re.finditer(r"\.entry\s+([\w$]+)\s*\((.*?)\)\s*([^{]*)\{", text, re.S))
        if entry is not None:
            entries = [m for m in entries if m.group(1) == entry]
        if len(entries) != 1:
            raise PtxFault(
                f"expected one .entry{' named ' + entry if entry else ''} in the PTX, "
                f"found {len(entries)}"
            )
        m = entries[0]
        module = text[: m.start()]
        dyn = re.search(
            r"\.extern\s+\.shared\s+(?:\.align\s+\d+\s+)?\.b8\s+([\w$]+)\s*\[\s*\]", module
        )
        body_start = m.end()
        depth, i = 1, None
        for brace in re.finditer(r"[{}]", text[body_start:]):
            depth += 1 if brace.group(0) == "{" else -1
            if depth == 0:
                i = body_start + brace.end()
                break
        if i is None:
            raise PtxFault(f"{m.group(1)}: unbalanced braces in the kernel body")
        line0 = text.count("\n", 0, body_start) + 1
        registers, instrs, labels = _Body(text[body_start : i - 1], line0, files).parse()
        program = cls(
            m.group(1),
            _params(m.group(2)),
            registers,
            instrs,
            labels,
            target.group(1) if target else "",
            _bound(m.group(3), "reqntid"),
            _bound(m.group(3), "maxntid"),
            dyn.group(1) if dyn else None,
        )
        program.shared_symbols = _shared_symbols(module)
        program.global_data = _global_data(module)
        return program


def _params(text: str) -> list[Param]:
    params = []
    for decl in split_operands(text):
        words = decl.split()
        if not words:
            continue
        array = re.search(r"([\w$]+)\s*\[\s*(\d+)\s*\]", decl)
        if array:
            params.append(Param(array.group(1), words[1].lstrip("."), int(array.group(2))))
            continue
        ptype = words[1].lstrip(".")
        params.append(Param(words[-1], ptype, max(1, int(re.sub(r"\D", "", ptype) or 8) // 8)))
    return params


def _bound(text: str, name: str) -> tuple[int, int, int] | None:
    m = re.search(rf"\.{name}\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", text)
    return tuple(int(g or 1) for g in m.groups()) if m else None


def _shared_symbols(module: str) -> dict[str, tuple[int, int]]:
    out, offset = {}, 0
    for m in re.finditer(
        r"^\s*(?:\.visible\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+"
        r"([\w$]+)\s*\[\s*(\d+)\s*\]",
        module,
        re.M,
    ):
        align, elem, name, count = int(m.group(1) or 1), m.group(2), m.group(3), int(m.group(4))
        offset = -(-offset // align) * align
        size = count * max(1, int(re.sub(r"\D", "", elem) or 8) // 8)
        out[name] = (offset, size)
        offset += size
    return out


def _global_data(module: str) -> dict[str, GlobalData]:
    out = {}
    for m in re.finditer(
        r"^\s*(?:\.visible\s+)?\.(?:global|const)\s+(?:\.align\s+(\d+)\s+)?"
        r"\.(\w+)\s+([\w$]+)\s*\[\s*(\d+)\s*\](?:\s*=\s*\{([^}]*)\})?",
        module,
        re.M,
    ):
        elem_bytes = max(1, int(re.sub(r"\D", "", m.group(2)) or 8) // 8)
        values = [int(v, 0) for v in m.group(5).split(",")] if m.group(5) else []
        data = b"".join(v.to_bytes(elem_bytes, "little", signed=v < 0) for v in values)
        size = int(m.group(4)) * elem_bytes
        out[m.group(3)] = GlobalData(m.group(3), data.ljust(size, b"\0"), int(m.group(1) or 1))
    return out


class _Body:
    """The statements of a kernel body, with inline-asm scopes renamed apart."""

    def __init__(self, body: str, first_line: int, files: dict[str, str]) -> None:
        self.items = self._items(body, first_line, files)

    @staticmethod
    def _items(body: str, line: int, files: dict[str, str]) -> list[tuple]:
        """('open'|'close'|'label'|'stmt', text, line, loc) in order."""
        items, loc, pos, counted = [], None, 0, 0
        token = re.compile(
            r"\s*(?:(\{)|(\})|([\w$@]+):(?!:)|(\.loc\s+(\d+)\s+(\d+)[^\n]*)|"
            r"([^;{}]*?(?:\{[^{}]*\}[^;{}]*?)*);)",
            re.S,
        )
        end = len(body.rstrip())
        while pos < end:
            m = token.match(body, pos)
            if m is None:
                raise PtxFault(
                    f"cannot parse the kernel body at line "
                    f"{line + body.count(chr(10), counted, pos)}: {body[pos:pos + 80]!r}"
                )
            start = m.start() + len(m.group(0)) - len(m.group(0).lstrip())
            line += body.count("\n", counted, start)
            counted = start
            if m.group(1):
                items.append(("open", "", line, loc))
            elif m.group(2):
                items.append(("close", "", line, loc))
            elif m.group(3):
                items.append(("label", m.group(3), line, loc))
            elif m.group(4):
                name = files.get(m.group(5), f"file {m.group(5)}").rsplit("/", 1)[-1]
                loc = f"{name}:{m.group(6)}" if m.group(6) != "0" else loc
            else:
                stmt = " ".join(m.group(7).split())
                if stmt:
                    items.append(("stmt", stmt, line, loc))
            pos = m.end()
        return items

    def parse(self) -> tuple[dict[str, str], list[Instr], dict[str, int]]:
        # pass 1: what each scope declares (registers and labels), scopes numbered in order
        scope_names: list[set[str]] = [set()]
        scoped_registers: set[str] = set()
        stack, counter = [0], 0
        for kind, text, _, _ in self.items:
            if kind == "open":
                counter += 1
                scope_names.append(set())
                stack.append(counter)
            elif kind == "close":
                stack.pop()
            elif kind == "label":
                scope_names[stack[-1]].add(text)
            elif text.startswith(".reg"):
                names = [n for n, _ in _declared(text)]
                scope_names[stack[-1]].update(names)
                if stack[-1]:
                    scoped_registers.update(names)
        # pass 2: instructions with scoped names renamed
        registers: dict[str, str] = {}
        instrs: list[Instr] = []
        labels: dict[str, int] = {}
        stack, counter = [0], 0

        def rename(name: str) -> str:
            for scope in reversed(stack):
                if name in scope_names[scope]:
                    return name if scope == 0 else f"{name}@{scope}"
            return name

        for kind, text, line, loc in self.items:
            if kind == "open":
                counter += 1
                stack.append(counter)
            elif kind == "close":
                stack.pop()
            elif kind == "label":
                labels[rename(text)] = len(instrs)
            elif text.startswith(".reg"):
                for name, rtype in _declared(text):
                    registers[rename(name)] = rtype
            elif text.startswith((".local", ".shared")):
                raise PtxFault(
                    f"kernel-scope {text.split()[0]} declarations are not emulated: "
                    f"{text} (PTX line {line})"
                )
            elif not text.startswith((".pragma", ".loc", ".file")):
                instrs.append(_instruction(text, line, loc, rename, scoped_registers))
        return registers, instrs, labels


def _declared(stmt: str) -> list[tuple[str, str]]:
    """(name, type) of each register a ``.reg`` statement declares."""
    m = re.match(r"\.reg\s+(?:\.v\d\s+)?\.(\w+)\s+(.*)", stmt)
    if not m:
        raise PtxFault(f"cannot parse register declaration {stmt!r}")
    out = []
    for item in m.group(2).split(","):
        item = item.strip()
        ranged = re.fullmatch(r"([%\w$]+)<(\d+)>", item)
        if ranged:
            out += [(f"{ranged.group(1)}{i}", m.group(1)) for i in range(int(ranged.group(2)))]
        elif item:
            out.append((item, m.group(1)))
    return out


def _instruction(stmt: str, line: int, loc: str | None, rename, scoped: set[str]) -> Instr:
    guard, negated = None, False
    gm = re.match(r"@(!?)([%\w$@]+)\s+", stmt)
    if gm:
        negated, guard = gm.group(1) == "!", rename(gm.group(2))
        stmt = stmt[gm.end() :]
    op, rest = (re.split(r"\s+", stmt, maxsplit=1) + [""])[:2]
    try:
        operands = tuple(_renamed(parse_operand(o), rename, scoped) for o in split_operands(rest))
        if op.split(".")[0] == "bra" and isinstance(operands[0], Sym):  # a label without '$'
            operands = (Label(rename(operands[0].name)),) + operands[1:]
    except ValueError as exc:
        raise PtxFault(f"cannot parse '{stmt}' (PTX line {line}): {exc}") from exc
    return Instr(stmt, guard, negated, tuple(op.split(".")), operands, line, loc)


def _renamed(op, rename, scoped: set[str]):
    """``op`` with scoped names renamed; a scoped register named without '%' (``complete``)
    parses as a symbol and becomes a register here."""
    if isinstance(op, Reg):
        return Reg(rename(op.name), op.negated)
    if isinstance(op, Label):
        return Label(rename(op.name))
    if isinstance(op, Sym) and op.name in scoped:
        return Reg(rename(op.name))
    if isinstance(op, Vec):
        return Vec(tuple(_renamed(i, rename, scoped) for i in op.items))
    if isinstance(op, Pair):
        return Pair(_renamed(op.value, rename, scoped), _renamed(op.pred, rename, scoped))
    if isinstance(op, Mem):
        return Mem(
            _renamed(op.base, rename, scoped),
            op.offset,
            tuple(_renamed(c, rename, scoped) for c in op.coords),
        )
    return op
