"""Every instruction of a program compiled once into the handler the machine calls.

Instructions the emulator does not model get a handler that raises ``UnsupportedPtx`` naming
them when (and only when) they execute.
"""

from __future__ import annotations

from . import (
    mbarrier,
    ops_control,
    ops_convert,
    ops_matrix,
    ops_memory,
    ops_scalar,
    ops_tcgen05,
    ops_tma,
)
from .faults import PtxFault, UnsupportedPtx
from .isa import Instr

BRANCH, COLLECTIVE, PLAIN = 1, 2, 0

_DECODERS = {}
for _module in (
    ops_scalar,
    ops_convert,
    ops_memory,
    ops_control,
    mbarrier,
    ops_matrix,
    ops_tma,
    ops_tcgen05,
):
    _DECODERS.update(_module.DECODERS)
_COLLECTIVES = set()
for _module in (ops_control, mbarrier, ops_matrix, ops_tma, ops_tcgen05):
    _COLLECTIVES |= set(_module.COLLECTIVES)


def _decoder(ins: Instr):
    root = ins.opcode[0]
    if root == "cp" and ("bulk" in ins.opcode or ins.opcode[1] == "reduce"):
        return ops_tma.d_cp_bulk
    return _DECODERS.get(root)


def decode_instruction(ins: Instr, labels: dict[str, int]):
    """(handler, kind) of one instruction."""
    if ins.opcode[0] == "bra":
        target = ops_control.d_bra(ins)
        if target not in labels:
            raise PtxFault(f"{ins.where()}: unknown label {target}")
        return labels[target], BRANCH
    decoder = _decoder(ins)
    collective = ins.opcode[0] in _COLLECTIVES or tuple(ins.opcode[:2]) in _COLLECTIVES
    try:
        if decoder is None:
            raise UnsupportedPtx(f"instruction {ins.where()} is not emulated")
        handler = decoder(ins)
    except UnsupportedPtx as exc:
        return _refuse(exc), PLAIN
    return handler, COLLECTIVE if collective else PLAIN


def _refuse(exc: UnsupportedPtx):
    message = str(exc)

    def refuse(m, *lanes):
        raise UnsupportedPtx(message)

    return refuse


def decode_program(program) -> list:
    """The program's handler table (cached on it)."""
    table = getattr(program, "_decoded", None)
    if table is None:
        table = [decode_instruction(ins, program.labels) for ins in program.instrs]
        program._decoded = table
    return table


def unsupported(program) -> list[str]:
    """The instructions of ``program`` the emulator would refuse."""
    table = decode_program(program)
    return [
        ins.where()
        for ins, (handler, _) in zip(program.instrs, table)
        if getattr(handler, "__name__", "") == "refuse"
    ]
