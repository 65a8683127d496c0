"""Blackwell's fifth-generation tensor cores (sm_100a): tensor memory and the ``tcgen05`` family.

Tensor memory (TMEM) is 128 lanes x 512 columns of 32-bit cells per CTA, allocated by columns
(``tcgen05.alloc`` writes the allocation's address, lane in the high 16 bits and column in the
low 16, to shared memory). A warp reaches only its own quarter of the lanes (warp w % 4: lanes
32(w % 4) ... + 31). TMEM starts poisoned (all bits set: NaN as fp32).

``tcgen05.mma`` is issued by one thread and is asynchronous: its result is written to TMEM
when issued but the cells stay in flight, and its shared-memory operands stay read by it,
until a ``tcgen05.commit`` of the issuing thread has arrived on its mbarrier (delivered when
nothing else can run); a ``tcgen05.ld`` of cells in flight, or a write to the operands, is a
``DataRace``. A ``tcgen05.ld`` reads its cells until ``tcgen05.wait::ld`` (an MMA or store
into them before is a ``DataRace``); its registers hold the values at once (ptxas orders their
uses after the load, as Triton's code relies on). A ``tcgen05.st`` writes until
``tcgen05.wait::st``: an MMA into its cells before is a ``DataRace``.

D layouts: M = 128 puts row r in lane r; M = 64 (one CTA) puts rows 16w ... 16w + 15 in lanes
32w + l ... 32w + l + 15 (the half data path; l, the address's lane, 0 or 16: two M = 64
accumulators share the lanes); column n of the accumulator in column ``col + n``.
"""

from __future__ import annotations

import numpy as np

from . import mbarrier
from .faults import WARP, DataRace, PtxFault, UnsupportedPtx
from .isa import Mem, Reg, Vec
from .layouts import MatrixDescriptor
from .operands import address_reader, immediate, reader, register_names, writer
from .ops_matrix import ELEMENT_BYTES, WIDEN, gather_operand

LANES, COLUMNS = 128, 512
IN_FLIGHT_MMA, IN_FLIGHT_ST, IN_FLIGHT_LD, MMA_OPERAND = 1, 2, 4, 8
_KINDS = {"f16": {0: "f16", 1: "bf16"}, "tf32": {2: "tf32"}, "f8f6f4": {0: "e4m3", 1: "e5m2"}}


class Tmem:
    """The tensor memory of a batch of CTAs and its allocations."""

    def __init__(self, nctas: int) -> None:
        self.cells = np.full((nctas, LANES, COLUMNS), 0xFFFFFFFF, dtype=np.uint32)
        self.busy = np.zeros((nctas, LANES, COLUMNS), dtype=np.uint8)
        self.allocated = np.zeros((nctas, COLUMNS), dtype=bool)


def tmem(m) -> Tmem:
    t = m.state.get("tmem")
    if t is None:
        t = m.state["tmem"] = Tmem(m.nctas)
    return t


def _split(address: int) -> tuple[int, int]:
    return (address >> 16) & 0xFFFF, address & 0xFFFF


def _check_allocated(m, cta: int, cols: np.ndarray) -> None:
    t = tmem(m)
    if cols.min() < 0 or cols.max() >= COLUMNS or not t.allocated[cta, cols].all():
        raise PtxFault(
            f"{m.where}: tensor memory columns [{int(cols.min())}, {int(cols.max()) + 1}) "
            f"are not all allocated to the CTA"
        )


def d_tcgen05(ins):
    op = ins.opcode[1]
    if any(p.startswith("cta_group::2") for p in ins.opcode):
        raise UnsupportedPtx(f"{ins.where()}: cta_group::2 (CTA pairs) is not emulated")
    return {
        "alloc": _alloc,
        "dealloc": _dealloc,
        "relinquish_alloc_permit": _permit,
        "mma": _mma,
        "commit": _commit,
        "ld": _ld,
        "st": _st,
        "wait::ld": _wait_ld,
        "wait::st": _wait_st,
        "fence::before_thread_sync": _fence,
        "fence::after_thread_sync": _fence,
    }.get(op, _unsupported)(ins)


def _unsupported(ins):
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


def _fence(ins):
    return lambda m, E, L: None


def _permit(ins):
    def permit(m, E, L):
        m.check_converged(E, L)

    return permit


def _alloc(ins):
    dst, ncols = ins.operands
    address, get_cols = address_reader(dst), reader(ncols, "u32")

    def alloc(m, E, L):
        if m.count(E) == 0:
            return
        m.check_converged(E, L)
        idx = m.index(E)
        t = tmem(m)
        firsts = m.warp_leaders(idx)
        for lane in firsts.tolist():
            one = np.asarray([lane])
            n = int(np.asarray(get_cols(m, one)).ravel()[0])
            if n < 32 or n > COLUMNS or n & (n - 1):
                raise PtxFault(f"{m.where}: tcgen05.alloc of {n} columns (a power of 2, 32..512)")
            cta = int(m.cta_index[lane])
            free = [c for c in range(0, COLUMNS, n) if not t.allocated[cta, c : c + n].any()]
            if not free:
                raise PtxFault(
                    f"{m.where}: tcgen05.alloc of {n} columns: tensor memory is full "
                    f"(on a GPU the warp would wait forever)"
                )
            t.allocated[cta, free[0] : free[0] + n] = True
            flat = m.shared_index(address(m, one), 4, one, m.where)
            m.shared_write(
                flat, np.asarray([[free[0]]], dtype=np.uint32).view(np.uint8), one, m.where
            )

    return alloc


def _dealloc(ins):
    taddr, ncols = ins.operands
    get_addr, get_cols = reader(taddr, "u32"), reader(ncols, "u32")

    def dealloc(m, E, L):
        if m.count(E) == 0:
            return
        m.check_converged(E, L)
        idx = m.index(E)
        t = tmem(m)
        firsts = m.warp_leaders(idx)
        for lane in firsts.tolist():
            one = np.asarray([lane])
            _, col = _split(int(np.asarray(get_addr(m, one)).ravel()[0]))
            n = int(np.asarray(get_cols(m, one)).ravel()[0])
            cta = int(m.cta_index[lane])
            _check_allocated(m, cta, np.arange(col, col + n))
            if t.busy[cta, :, col : col + n].any():
                raise DataRace(
                    f"{m.where}: tensor memory deallocated while an operation on it "
                    f"is in flight"
                )
            t.allocated[cta, col : col + n] = False

    return dealloc


# -- the MMA ------------------------------------------------------------------------------------
class MmaInFlight:
    """An issued tcgen05.mma: its accumulator cells, its A cells when A is in tensor memory,
    and the shared bytes of its descriptor operands."""

    def __init__(self, cta: int, region, a_region, operand_offs: np.ndarray):
        self.cta, self.region, self.a_region = cta, region, a_region
        self.operand_offs = operand_offs
        self.done = False

    def complete(self, m) -> None:
        if self.done:
            return
        self.done = True
        t = tmem(m)
        t.busy[self.cta][self.region] &= ~np.uint8(IN_FLIGHT_MMA)
        if self.a_region is not None:
            t.busy[self.cta][self.a_region] &= ~np.uint8(MMA_OPERAND)
        m.mark_busy(self.operand_offs, write=False, delta=-1)


class CommitArrive:
    """A ``tcgen05.commit``: when delivered, the MMAs it tracks complete and it arrives once
    on its mbarrier."""

    def __init__(self, mmas: list, barrier: int) -> None:
        self.mmas, self.barrier = mmas, barrier

    def deliver(self, m) -> None:
        for mma in self.mmas:
            mma.complete(m)
        mbarrier.arrive(m, self.barrier)


def _issued(m) -> dict:
    issued = m.state.get("tcgen05.issued")
    if issued is None:
        issued = m.state["tcgen05.issued"] = {}
    return issued


def _decode_idesc(idesc: int, kind: str, where: str):
    if idesc & 0b111:
        raise UnsupportedPtx(f"{where}: sparse or saturating tcgen05.mma (idesc {idesc:#x})")
    c_fmt = (idesc >> 4) & 3
    a_fmt, b_fmt = (idesc >> 7) & 7, (idesc >> 10) & 7
    neg_a, neg_b = (idesc >> 13) & 1, (idesc >> 14) & 1
    a_mn, b_mn = (idesc >> 15) & 1, (idesc >> 16) & 1
    n, mm = ((idesc >> 17) & 0x3F) << 3, ((idesc >> 24) & 0x1F) << 4
    types = _KINDS.get(kind)
    if types is None or a_fmt not in types or b_fmt not in types:
        raise UnsupportedPtx(
            f"{where}: tcgen05.mma kind::{kind} with operand formats " f"{a_fmt}, {b_fmt}"
        )
    if c_fmt not in (0, 1):
        raise UnsupportedPtx(f"{where}: accumulator format {c_fmt}")
    if mm not in (64, 128) or not 8 <= n <= 256 or n % (16 if mm == 128 else 8):
        raise PtxFault(f"{where}: tcgen05.mma shape M = {mm}, N = {n} is not valid for one CTA")
    return (
        types[a_fmt],
        types[b_fmt],
        c_fmt == 1,
        bool(neg_a),
        bool(neg_b),
        bool(a_mn),
        bool(b_mn),
        mm,
        n,
    )


def _d_lanes(mm: int) -> np.ndarray:
    """TMEM lane of each accumulator row."""
    rows = np.arange(mm)
    return rows if mm == 128 else 32 * (rows // 16) + rows % 16


def _mma(ins):
    kind = next(p.split("::")[1] for p in ins.opcode if p.startswith("kind::"))
    ops = ins.operands
    d_mem = ops[0]
    a_tmem = isinstance(ops[1], Mem)
    if len(ops) != 5:
        raise UnsupportedPtx(f"{ins.where()}: tcgen05.mma with an output-lane mask or a scale")
    get_d = address_reader(d_mem)
    get_a = address_reader(ops[1]) if a_tmem else reader(ops[1], "b64")
    get_b = reader(ops[2], "b64")
    get_idesc = reader(ops[3], "b32")
    get_enable = (
        reader(ops[4], "pred")
        if isinstance(ops[4], Reg)
        else (lambda m, L, v=int(immediate(ops[4].text, "u32")) != 0: np.bool_(v))
    )
    kbytes = 32

    def mma(m, L):
        t = tmem(m)
        for lane in m.index(L).tolist():
            one = np.asarray([lane])
            cta = int(m.cta_index[lane])
            idesc = int(np.asarray(get_idesc(m, one)).ravel()[0])
            atype, btype, f32acc, neg_a, neg_b, a_mn, b_mn, mm, n = _decode_idesc(
                idesc, kind, m.where
            )
            if not f32acc:
                raise UnsupportedPtx(f"{m.where}: tcgen05.mma with an f16 accumulator")
            k = kbytes // ELEMENT_BYTES[atype]
            rows = _d_lanes(mm)
            ctas = np.asarray([cta])
            bdesc = MatrixDescriptor.sm100(int(np.asarray(get_b(m, one)).ravel()[0]))
            B, offs_b = gather_operand(m, ctas, bdesc, n, k, btype, b_mn, m.where)
            a_region = None
            if a_tmem:
                A, a_region = _tmem_operand(m, t, cta, int(get_a(m, one)[0]), rows, k, atype)
                offs = offs_b.ravel()
            else:
                adesc = MatrixDescriptor.sm100(int(np.asarray(get_a(m, one)).ravel()[0]))
                A, offs_a = gather_operand(m, ctas, adesc, mm, k, atype, a_mn, m.where)
                A = A[0]
                offs = np.concatenate([offs_a.ravel(), offs_b.ravel()])
            product = (-1 if neg_a else 1) * (-1 if neg_b else 1) * (A @ B[0].T)
            lane0, col0 = _split(int(get_d(m, one)[0]))
            if lane0 not in ((0, 16) if mm == 64 else (0,)):
                raise PtxFault(
                    f"{m.where}: the accumulator's address names lane {lane0}; an "
                    f"M = {mm} accumulator starts at lane 0{' or 16' if mm == 64 else ''}"
                )
            rows = rows + lane0
            cols = col0 + np.arange(n)
            _check_allocated(m, cta, cols)
            region = np.ix_(rows, cols)
            busy = t.busy[cta][region]
            if (busy & IN_FLIGHT_ST).any():
                raise DataRace(
                    f"{m.where}: tcgen05.mma accumulates into tensor memory a "
                    f"tcgen05.st has not finished writing (no tcgen05.wait::st)"
                )
            if (busy & (IN_FLIGHT_LD | MMA_OPERAND)).any():
                raise DataRace(
                    f"{m.where}: tcgen05.mma writes tensor memory that is still read "
                    f"(by a tcgen05.ld without its wait, or an MMA in flight)"
                )
            enable = bool(np.asarray(get_enable(m, one)).ravel()[0])
            acc = t.cells[cta][region].view(np.float32).astype(np.float64) if enable else 0.0
            t.cells[cta][region] = (product + acc).astype(np.float32).view(np.uint32)
            t.busy[cta][region] |= IN_FLIGHT_MMA
            m.mark_busy(offs, write=False, delta=1)
            _issued(m).setdefault(lane, []).append(MmaInFlight(cta, region, a_region, offs))

    return mma


def _tmem_operand(m, t: Tmem, cta: int, address: int, rows: np.ndarray, k: int, kind: str):
    """(A [rows, k] as float64, its cells) of an operand in tensor memory: row r in the
    accumulator's lane for r (offset by the address's lane), elements packed along the columns
    (two 16-bit elements, or one 32-bit, per cell, the lower element in the low half)."""
    lane0, col0 = _split(address)
    per_cell = 4 // ELEMENT_BYTES[kind]
    if lane0 not in ((0, 16) if len(rows) == 64 else (0,)):
        raise PtxFault(
            f"{m.where}: an A operand in tensor memory at lane {lane0}; for M = "
            f"{len(rows)} it starts at lane 0{' or 16' if len(rows) == 64 else ''}"
        )
    rows = rows + lane0
    cols = col0 + np.arange(k // per_cell)
    _check_allocated(m, cta, cols)
    region = np.ix_(rows, cols)
    if (t.busy[cta][region] & (IN_FLIGHT_ST | IN_FLIGHT_MMA)).any():
        raise DataRace(
            f"{m.where}: tcgen05.mma reads an A operand in tensor memory that is "
            f"still being written"
        )
    cells = t.cells[cta][region]
    if per_cell == 2:
        raw = np.stack([(cells & 0xFFFF).astype(np.uint16), (cells >> 16).astype(np.uint16)], -1)
        raw = raw.reshape(len(rows), k)
    else:
        raw = cells
    t.busy[cta][region] |= MMA_OPERAND
    return WIDEN[kind](raw).astype(np.float64), region


def _commit(ins):
    if "mbarrier::arrive::one" not in ins.opcode or any("multicast" in p for p in ins.opcode):
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    address = address_reader(ins.operands[0])

    def commit(m, L):
        for lane in m.index(L).tolist():
            one = np.asarray([lane])
            barrier = int(mbarrier.flat_addresses(m, address, one)[0])
            mbarrier.lookup(m, barrier)
            pending = [op for op in _issued(m).get(lane, []) if not op.done]
            _issued(m)[lane] = pending
            m.async_ops.append(CommitArrive(list(pending), barrier))

    return commit


# -- tcgen05.ld / tcgen05.st ---------------------------------------------------------------------
def _shape(ins):
    shape = next(p for p in ins.opcode if "x" in p and p[0].isdigit())
    num = next(int(p[1:]) for p in ins.opcode if p.startswith("x") and p[1:].isdigit())
    if any(p.startswith("pack") or p.startswith("unpack") for p in ins.opcode):
        raise UnsupportedPtx(f"{ins.where()}: packed tcgen05 transfers are not emulated")
    return shape, num


def _cells(shape: str, num: int, splitoff: int):
    """(lane offset [32, regs], column offset [32, regs]) of each thread's registers."""
    t = np.arange(WARP)[:, None]
    r = np.arange(num)[None, :]
    if shape == "32x32b":
        return np.broadcast_to(t, (WARP, num)), np.broadcast_to(r, (WARP, num))
    if shape == "16x32bx2":
        return np.broadcast_to(t % 16, (WARP, num)), (t // 16) * splitoff + r
    raise UnsupportedPtx(f"tcgen05 shape .{shape} is not emulated")


def _warp_cells(m, idx, taddr: np.ndarray, shape, num, splitoff):
    """(cta, lane, column) index arrays [warps, 32, regs] of a warp-collective transfer."""
    warps = idx.reshape(-1, WARP)
    base = taddr.reshape(-1, WARP)[:, 0].astype(np.int64)
    lane0, col0 = (base >> 16) & 0xFFFF, base & 0xFFFF
    quarter = 32 * (m.warp_in_cta[warps[:, 0]] % 4)
    lanes_off, cols_off = _cells(shape, num, splitoff)
    span = 16 if shape.startswith("16") else 32
    bad = (lane0 < quarter) | (lane0 + span > quarter + 32)
    if bad.any():
        w = int(np.argmax(bad))
        raise PtxFault(
            f"{m.where}: warp {int(m.warp_in_cta[warps[w, 0]])} addresses tensor "
            f"memory lane {int(lane0[w])}, outside its lanes [{int(quarter[w])}, "
            f"{int(quarter[w]) + 32})"
        )
    lanes = lane0[:, None, None] + lanes_off[None]
    cols = col0[:, None, None] + cols_off[None]
    ctas = np.broadcast_to(m.cta_index[warps[:, 0]][:, None, None], lanes.shape)
    for w in range(len(warps)):
        _check_allocated(m, int(ctas[w, 0, 0]), np.unique(cols[w]))
    return warps, ctas, lanes, cols


def _ld(ins):
    shape, num = _shape(ins)
    dst, mem = ins.operands[:2]
    names = register_names(dst)
    if len(names) != num:
        raise PtxFault(f"{ins.where()}: {len(names)} registers for .x{num}")
    puts = [writer(Reg(name), "b32") for name in names]
    get_addr = address_reader(mem)
    splitoff = int(immediate(ins.operands[2].text, "u32")) if len(ins.operands) > 2 else 0

    def load(m, E, L):
        if m.count(E) == 0:
            return
        m.check_converged(E, L)
        idx = m.index(E)
        warps, ctas, lanes, cols = _warp_cells(m, idx, get_addr(m, idx), shape, num, splitoff)
        t = tmem(m)
        if (t.busy[ctas, lanes, cols] & IN_FLIGHT_MMA).any():
            raise DataRace(
                f"{m.where}: tcgen05.ld reads tensor memory a tcgen05.mma is still "
                f"writing (its commit's mbarrier phase has not completed)"
            )
        values = t.cells[ctas, lanes, cols].reshape(-1, num)
        lanes_of_warps = warps.ravel()
        for i, put in enumerate(puts):
            put(m, lanes_of_warps, values[:, i])
        t.busy[ctas, lanes, cols] |= IN_FLIGHT_LD
        m.state.setdefault("tcgen05.ld", []).append((warps[:, 0].copy(), ctas, lanes, cols))

    return load


def _st(ins):
    shape, num = _shape(ins)
    mem = ins.operands[0]
    splitoff = int(immediate(ins.operands[1].text, "u32")) if shape == "16x32bx2" else 0
    src = ins.operands[-1]
    gets = [reader(r, "b32") for r in (src.items if isinstance(src, Vec) else (src,))]
    get_addr = address_reader(mem)

    def store(m, E, L):
        if m.count(E) == 0:
            return
        m.check_converged(E, L)
        idx = m.index(E)
        warps, ctas, lanes, cols = _warp_cells(m, idx, get_addr(m, idx), shape, num, splitoff)
        t = tmem(m)
        if (t.busy[ctas, lanes, cols] & IN_FLIGHT_MMA).any():
            raise DataRace(
                f"{m.where}: tcgen05.st writes tensor memory a tcgen05.mma is still " f"writing"
            )
        if (t.busy[ctas, lanes, cols] & (IN_FLIGHT_LD | MMA_OPERAND)).any():
            raise DataRace(
                f"{m.where}: tcgen05.st writes tensor memory still read (by a "
                f"tcgen05.ld without its wait, or an MMA in flight)"
            )
        values = np.stack([np.broadcast_to(np.asarray(g(m, idx)), (len(idx),)) for g in gets], -1)
        t.cells[ctas, lanes, cols] = values.reshape(ctas.shape)
        t.busy[ctas, lanes, cols] |= IN_FLIGHT_ST
        m.state.setdefault("tcgen05.st", []).append((warps[:, 0].copy(), ctas, lanes, cols))

    return store


def _wait_ld(ins):
    return _wait(IN_FLIGHT_LD, "tcgen05.ld")


def _wait_st(ins):
    return _wait(IN_FLIGHT_ST, "tcgen05.st")


def _wait(bit: int, key: str):
    """``tcgen05.wait::ld``/``::st``: the executing warps' transfers of that kind are done."""

    def wait(m, E, L):
        m.check_converged(E, L)
        warps = np.unique(m.warp_global[m.index(E)])
        remaining = []
        t = tmem(m)
        for first_lanes, ctas, lanes, cols in m.state.get(key, []):
            mine = np.isin(m.warp_global[first_lanes], warps)
            if mine.any():
                t.busy[ctas[mine], lanes[mine], cols[mine]] &= ~np.uint8(bit)
            if not mine.all():
                remaining.append((first_lanes[~mine], ctas[~mine], lanes[~mine], cols[~mine]))
        m.state[key] = remaining

    return wait


DECODERS = {"tcgen05": d_tcgen05}
COLLECTIVES = {
    ("tcgen05", op)
    for op in (
        "alloc",
        "dealloc",
        "relinquish_alloc_permit",
        "ld",
        "st",
        "wait::ld",
        "wait::st",
        "fence::before_thread_sync",
        "fence::after_thread_sync",
    )
}
