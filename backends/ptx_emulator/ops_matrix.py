"""Warp and warpgroup matrix instructions: ``ldmatrix``/``stmatrix``, ``mma.sync`` (sm_80) and
``wgmma`` (sm_90).

Products are computed exactly (float64) and rounded once to the accumulator type: tensor cores
accumulate in another order and with fewer guard bits, a difference this emulator does not see.

``wgmma.mma_async`` is asynchronous: its shared-memory operands are read when it is issued, and
marked in flight (a write to them before the wait that retires it is a ``DataRace``); its
accumulator registers hold the result only once ``wgmma.wait_group`` retires its group (a read
of them before is a ``DataRace``). Chained wgmmas on the same accumulator see each other's
results, as the hardware's do.
"""

from __future__ import annotations

import numpy as np

from .faults import WARP, PtxFault, UnsupportedPtx
from .isa import Reg, Vec, types_of
from .layouts import MatrixDescriptor
from .operands import address_reader, immediate, reader, register_names, writer
from .values import bf16_to_f32, f16_to_f32, f32_to_f16, fp8_to_f32, tf32

WIDEN = {
    "bf16": bf16_to_f32,
    "f16": f16_to_f32,
    "tf32": lambda b: tf32(b.view(np.float32)),
    "e4m3": lambda b: fp8_to_f32(b, "e4m3"),
    "e5m2": lambda b: fp8_to_f32(b, "e5m2"),
}
ELEMENT_BYTES = {"bf16": 2, "f16": 2, "tf32": 4, "e4m3": 1, "e5m2": 1}
_ELEM_VIEW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _full_warps(m, E, L, scope_warps: int = 1) -> np.ndarray:
    """The executing lanes as [groups, 32 * scope_warps] (every lane of each warp/warpgroup,
    in order), after the convergence check."""
    m.check_converged(E, L, scope_warps=scope_warps)
    idx = m.index(E)
    size = WARP * scope_warps
    if len(idx) % size and m.options.schedule != "skewed":
        raise PtxFault(
            f"{m.where}: executed by {len(idx)} lanes, not whole "
            f"{'warpgroups' if scope_warps > 1 else 'warps'}"
        )
    return idx.reshape(-1, size) if len(idx) % size == 0 else idx.reshape(-1, WARP)


# -- ldmatrix / stmatrix --------------------------------------------------------------------------
def _matrix_count(ins) -> int:
    return next(int(p[1:]) for p in ins.opcode if p in ("x1", "x2", "x4"))


def d_ldmatrix(ins):
    count, trans = _matrix_count(ins), "trans" in ins.opcode
    if "m8n8" not in ins.opcode or "b16" not in ins.opcode:
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    dst, mem = ins.operands
    puts = [writer(r, "b32") for r in (dst.items if isinstance(dst, Vec) else (dst,))]
    address = address_reader(mem)

    def ldmatrix(m, E, L):
        if m.count(E) == 0:
            return
        warps = _full_warps(m, E, L)
        providers = warps[:, : 8 * count].ravel()
        addr = address(m, providers)
        flat = m.shared_index(addr, 16, providers, m.where)
        rows = m.shared_read(flat, 16, providers, m.where).view(np.uint16)
        rows = rows.reshape(len(warps), count, 8, 8)  # [warp, matrix, row, col]
        lane = np.arange(WARP)
        g, t = lane // 4, lane % 4
        for j, put in enumerate(puts):
            mat = rows[:, j]
            if trans:
                lo, hi = mat[:, 2 * t, g], mat[:, 2 * t + 1, g]
            else:
                lo, hi = mat[:, g, 2 * t], mat[:, g, 2 * t + 1]
            put(m, warps.ravel(), (lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)).ravel())

    return ldmatrix


def d_stmatrix(ins):
    count, trans = _matrix_count(ins), "trans" in ins.opcode
    mem, src = ins.operands
    gets = [reader(r, "b32") for r in (src.items if isinstance(src, Vec) else (src,))]
    address = address_reader(mem)

    def stmatrix(m, E, L):
        if m.count(E) == 0:
            return
        warps = _full_warps(m, E, L)
        lanes = warps.ravel()
        rows = np.zeros((len(warps), count, 8, 8), dtype=np.uint16)
        lane = np.arange(WARP)
        g, t = lane // 4, lane % 4
        for j, get in enumerate(gets):
            v = np.broadcast_to(np.asarray(get(m, lanes)), (len(lanes),)).reshape(len(warps), WARP)
            lo, hi = (v & 0xFFFF).astype(np.uint16), (v >> 16).astype(np.uint16)
            if trans:
                rows[:, j, 2 * t, g], rows[:, j, 2 * t + 1, g] = lo, hi
            else:
                rows[:, j, g, 2 * t], rows[:, j, g, 2 * t + 1] = lo, hi
        providers = warps[:, : 8 * count].ravel()
        flat = m.shared_index(address(m, providers), 16, providers, m.where)
        m.shared_write(flat, rows.reshape(-1, 8).view(np.uint8).reshape(-1, 16), providers, m.where)

    return stmatrix


# -- mma.sync (sm_80 warp MMA) -------------------------------------------------------------------
def d_mma(ins):
    shape = next(p for p in ins.opcode if p.startswith("m") and "n" in p and "k" in p)
    types = types_of(ins.opcode)
    if len(types) != 4 or "row" not in ins.opcode or "col" not in ins.opcode:
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    dtype, atype, btype, ctype = types
    if (
        atype not in ("bf16", "f16", "tf32")
        or shape not in ("m16n8k16", "m16n8k8")
        or dtype != ctype
        or dtype not in ("f32", "f16")
    ):
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    k = int(shape.split("k")[1])
    d_op, a_op, b_op, c_op = ins.operands
    get_a = [reader(r, "b32") for r in a_op.items]
    get_b = [reader(r, "b32") for r in b_op.items]
    get_c = [reader(r, "b32" if dtype == "f16" else "f32") for r in c_op.items]
    puts = [writer(r, "b32" if dtype == "f16" else "f32") for r in d_op.items]
    widen = WIDEN[atype]
    lane = np.arange(WARP)
    g, t = lane // 4, lane % 4

    def unpack(get, m, lanes, nw):
        v = np.broadcast_to(np.asarray(get(m, lanes)), (len(lanes),)).reshape(nw, WARP)
        if atype == "tf32":
            return widen(v.astype(np.uint32))[..., None]
        return np.stack(
            [widen((v & 0xFFFF).astype(np.uint16)), widen((v >> 16).astype(np.uint16))], -1
        )

    def mma(m, E, L):
        if m.count(E) == 0:
            return
        warps = _full_warps(m, E, L)
        lanes, nw = warps.ravel(), len(warps)
        A = np.zeros((nw, 16, k))
        B = np.zeros((nw, k, 8))
        if atype == "tf32":  # a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4)
            for i, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
                A[:, g + dr, t + dk] = unpack(get_a[i], m, lanes, nw)[..., 0]
            for i, dk in enumerate((0, 4)[: len(get_b)]):
                B[:, t + dk, g] = unpack(get_b[i], m, lanes, nw)[..., 0]
        else:  # a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
            blocks = ((0, 0), (8, 0), (0, 8), (8, 8)) if k == 16 else ((0, 0), (8, 0))
            for i, (dr, dk) in enumerate(blocks):
                pair = unpack(get_a[i], m, lanes, nw)
                A[:, g + dr, 2 * t + dk], A[:, g + dr, 2 * t + dk + 1] = pair[..., 0], pair[..., 1]
            for i, dk in enumerate((0, 8)[: k // 8]):
                pair = unpack(get_b[i], m, lanes, nw)
                B[:, 2 * t + dk, g], B[:, 2 * t + dk + 1, g] = pair[..., 0], pair[..., 1]
        C = np.zeros((nw, 16, 8))
        if dtype == "f32":
            for i, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                C[:, g + dr, 2 * t + dc] = np.broadcast_to(
                    np.asarray(get_c[i](m, lanes)), (len(lanes),)
                ).reshape(nw, WARP)
        else:
            for i, dr in enumerate((0, 8)):
                v = np.broadcast_to(np.asarray(get_c[i](m, lanes)), (len(lanes),)).reshape(nw, WARP)
                C[:, g + dr, 2 * t] = f16_to_f32((v & 0xFFFF).astype(np.uint16))
                C[:, g + dr, 2 * t + 1] = f16_to_f32((v >> 16).astype(np.uint16))
        D = np.matmul(A, B) + C
        if dtype == "f32":
            for i, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
                puts[i](m, lanes, D[:, g + dr, 2 * t + dc].astype(np.float32).ravel())
        else:
            for i, dr in enumerate((0, 8)):
                lo = f32_to_f16(D[:, g + dr, 2 * t].astype(np.float32)).astype(np.uint32)
                hi = f32_to_f16(D[:, g + dr, 2 * t + 1].astype(np.float32)).astype(np.uint32)
                puts[i](m, lanes, (lo | (hi << 16)).ravel())

    return mma


# -- wgmma (sm_90 warpgroup MMA) ----------------------------------------------------------------
class WgmmaOp:
    """One wgmma in flight: the lanes it wrote, its accumulator registers, the shared bytes it
    read and the A registers it reads."""

    def __init__(self, lanes, dest, operand_offs, a_regs):
        self.lanes, self.dest, self.operand_offs, self.a_regs = lanes, dest, operand_offs, a_regs

    def subset(self, rows):
        return WgmmaOp(self.lanes[rows], self.dest, self.operand_offs, self.a_regs)


def _wgmma_groups(m):
    from .ops_memory import GroupedOps

    groups = m.state.get("wgmma")
    if groups is None:
        groups = m.state["wgmma"] = GroupedOps(m.n)
    return groups


def read_registers(m, names, lanes) -> np.ndarray:
    """[lanes, len(names)] raw 32-bit register values, an accumulator in flight read as its
    pending result (the async proxy's own view of it)."""
    out = np.empty((len(lanes), len(names)), dtype=np.uint32)
    for i, name in enumerate(names):
        arr = m.regs.get(name)
        value = (
            np.zeros(len(lanes), dtype=np.uint32) if arr is None else arr[lanes].astype(np.uint32)
        )
        entry = m.poisoned.get(name)
        if entry is not None:
            busy = entry[0][lanes] > 0
            if busy.any():
                value = np.where(busy, m.pending_values[name][lanes], value)
        out[:, i] = value
    return out


def write_async_result(m, names, lanes, values: np.ndarray, reason: str) -> None:
    """Stores an asynchronous instruction's results as pending in ``names`` for ``lanes`` (they
    land when the instruction is retired: ``land_async_result``)."""
    for i, name in enumerate(names):
        pending = m.pending_values.get(name)
        if pending is None:
            pending = m.pending_values[name] = np.zeros(m.n, dtype=np.uint32)
        pending[lanes] = values[:, i]
        if name not in m.regs:
            m.new_register(name, "b32")
    m.hold(m.poisoned, names, lanes, reason)


def land_async_result(m, names, lanes) -> None:
    for name in names:
        entry = m.poisoned[name]
        entry[0][lanes] -= 1
        done = lanes[entry[0][lanes] == 0]
        m.regs[name][done] = m.pending_values[name][done].astype(m.regs[name].dtype)
        if not entry[0].any():
            del m.poisoned[name]


def gather_operand(
    m, ctas, desc: MatrixDescriptor, rows: int, k: int, kind: str, mn_major: bool, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(values [groups, rows, k] as float64, the flat shared byte indices read) of a
    descriptor-described operand for each group (CTA of ``ctas``)."""
    e = ELEMENT_BYTES[kind]
    addr = desc.offsets(rows, k, e, mn_major)
    if addr.min() < 0 or addr.max() + e > m.shared_size:
        raise PtxFault(
            f"{where}: a matrix operand at shared [{int(addr.min())}, "
            f"{int(addr.max()) + e}) lies outside the {m.shared_size} B of shared memory"
        )
    if (addr % e).any():
        raise PtxFault(f"{where}: a matrix operand element is misaligned")
    base = ctas[:, None, None] * max(m.shared_size, 1)
    flat = base + addr[None]
    offs = flat[..., None] + np.arange(e)
    _check_operand(m, offs, where)
    raw = m.shared.view(_ELEM_VIEW[e])[flat // e]
    return WIDEN[kind](raw).astype(np.float64), offs.reshape(len(ctas), -1)


def _check_operand(m, offs, where):
    busy = m.smem_busy
    if busy is not None and ((busy[offs] & 0x8000) != 0).any():
        raise PtxFault(
            f"{where}: a matrix operand reads shared bytes whose asynchronous copy "
            f"has not landed (its wait or mbarrier phase has not completed)"
        )


def _lane_layout():
    """(row, column) of each of a warpgroup's accumulator registers: register r of lane l of
    warp w holds D[16w + l//4 + 8((r//2)%2)][8(r//4) + 2(l%4) + r%2]."""
    lane = np.arange(128)
    w, g, t = lane // 32, (lane % 32) // 4, lane % 4
    return w, g, t


def d_wgmma(ins):
    op = ins.opcode[1]
    if op == "fence":
        return _wgmma_check_only()
    if op == "commit_group":

        def commit(m, E, L):
            m.check_converged(E, L, scope_warps=4)
            _wgmma_groups(m).commit(m.index(E))

        return commit
    if op == "wait_group":
        keep = int(immediate(ins.operands[0].text, "u32"))

        def wait(m, E, L):
            m.check_converged(E, L, scope_warps=4)
            for rows, payload in _wgmma_groups(m).retire(m.index(E), keep):
                _retire_wgmma(m, payload, rows)

        return wait
    if op != "mma_async":
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    return _decode_wgmma(ins)


def _wgmma_check_only():
    def fence(m, E, L):
        m.check_converged(E, L, scope_warps=4)

    return fence


def _retire_wgmma(m, payload: WgmmaOp, rows) -> None:
    lanes = payload.lanes[rows]
    land_async_result(m, payload.dest, lanes)
    if payload.a_regs:
        m.hold(m.guarded, payload.a_regs, lanes, "a wgmma", delta=-1)
    if payload.operand_offs is not None:
        # the warpgroup's operand bytes: released with its first retired row
        offs, payload.operand_offs = payload.operand_offs, None
        m.mark_busy(offs, write=False, delta=-1)


def _decode_wgmma(ins):
    shape = next(p for p in ins.opcode if p.startswith("m64"))
    n, k = int(shape[4:].split("k")[0]), int(shape.split("k")[1])
    types = types_of(ins.opcode)
    dtype, atype, btype = types[0], types[1], types[2]
    if atype != btype and not (atype in ("e4m3", "e5m2") and btype in ("e4m3", "e5m2")):
        raise UnsupportedPtx(f"{ins.where()}: mixed operand types")
    if dtype not in ("f32", "f16") or atype not in WIDEN:
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    ops = ins.operands
    d_op = ops[0]
    a_from_regs = isinstance(ops[1], Vec)
    dest = register_names(d_op)
    if dtype == "f32" and len(dest) != n // 2 or dtype == "f16" and len(dest) != n // 4:
        raise PtxFault(f"{ins.where()}: {len(dest)} accumulator registers for n = {n}")
    get_b = reader(ops[2], "b64")
    get_scale_d = (
        reader(ops[3], "pred")
        if isinstance(ops[3], Reg)
        else (lambda m, L, v=int(immediate(ops[3].text, "u32")) != 0: np.bool_(v))
    )
    scale_a = int(immediate(ops[4].text, "s32"))
    scale_b = int(immediate(ops[5].text, "s32"))
    if a_from_regs:
        a_regs = register_names(ops[1])
        trans_a, trans_b = 0, int(immediate(ops[6].text, "u32")) if len(ops) > 6 else 0
        get_a = None
    else:
        a_regs = []
        get_a = reader(ops[1], "b64")
        trans_a = int(immediate(ops[6].text, "u32")) if len(ops) > 6 else 0
        trans_b = int(immediate(ops[7].text, "u32")) if len(ops) > 7 else 0
    if atype in ("e4m3", "e5m2", "tf32") and (trans_a or trans_b):
        raise PtxFault(f"{ins.where()}: .{atype} operands must be K-major")
    w, g, t = _lane_layout()
    regs = np.arange(len(dest) if dtype == "f32" else len(dest) * 2)
    row = 16 * w[:, None] + g[:, None] + 8 * ((regs[None] // 2) % 2)
    col = 8 * (regs[None] // 4) + 2 * t[:, None] + regs[None] % 2

    def wgmma(m, E, L):
        if m.count(E) == 0:
            return
        m.check_converged(E, L, scope_warps=4)
        idx = m.index(E)
        group_of = m.warp_global[idx] // 4
        keys, inverse = np.unique(group_of, return_inverse=True)
        ngroups = len(keys)
        slots = np.full((ngroups, 128), -1, dtype=np.int64)  # the warpgroups' lanes present
        slots[inverse, m.thread[idx] % 128] = idx
        groups = np.where(slots >= 0, slots, slots.max(axis=1, keepdims=True))
        lanes = idx
        where = m.where
        ctas = m.cta_index[groups[:, 0]]
        descs_b = np.asarray(get_b(m, groups[:, 0])).astype(np.uint64).reshape(-1)
        descs_b = np.broadcast_to(descs_b, (ngroups,))
        A = np.zeros((ngroups, 64, k))
        B = np.empty((ngroups, n, k))
        offs_read = []
        for i in range(ngroups):
            bdesc = MatrixDescriptor.sm90(int(descs_b[i]))
            B[i], off = gather_operand(m, ctas[i : i + 1], bdesc, n, k, btype, bool(trans_b), where)
            offs_read.append(off[0])
            if not a_from_regs:
                adesc = MatrixDescriptor.sm90(
                    int(np.asarray(get_a(m, groups[i : i + 1, 0])).ravel()[0])
                )
                A[i], off = gather_operand(
                    m, ctas[i : i + 1], adesc, 64, k, atype, bool(trans_a), where
                )
                offs_read.append(off[0])
        if a_from_regs:
            values = read_registers(m, a_regs, groups.ravel()).reshape(ngroups, 128, len(a_regs))
            widen = WIDEN[atype]
            if atype not in ("bf16", "f16"):
                raise UnsupportedPtx(f"{where}: wgmma with .{atype} A in registers")
            # a0 (r, 2t..), a1 (r+8, 2t..), a2 (r, 2t+8..), a3 (r+8, 2t+8..), r = 16w + l//4
            for j, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
                v = values[..., j]
                r = 16 * w + g + dr
                A[:, r, 2 * t + dk] = widen((v & 0xFFFF).astype(np.uint16))
                A[:, r, 2 * t + dk + 1] = widen((v >> 16).astype(np.uint16))
            m.hold(m.guarded, a_regs, lanes, "a wgmma")
        if scale_a < 0:
            A = -A
        if scale_b < 0:
            B = -B
        product = np.einsum("gmk,gnk->gmn", A, B)
        acc = read_registers(m, dest, groups.ravel()).reshape(ngroups, 128, -1)
        scale_d = np.broadcast_to(np.asarray(get_scale_d(m, groups[:, 0])), (ngroups,))
        if dtype == "f32":
            C = acc.view(np.float32).astype(np.float64)
            D = product[:, row, col] + np.where(scale_d[:, None, None], C, 0.0)
            result = D.astype(np.float32).view(np.uint32)
        else:
            halves = np.stack(
                [
                    f16_to_f32((acc & 0xFFFF).astype(np.uint16)),
                    f16_to_f32((acc >> 16).astype(np.uint16)),
                ],
                -1,
            )
            halves = halves.reshape(ngroups, 128, -1)
            D = product[:, row, col] + np.where(scale_d[:, None, None], halves, 0.0)
            h = f32_to_f16(D.astype(np.float32)).reshape(ngroups, 128, -1, 2).astype(np.uint32)
            result = h[..., 0] | (h[..., 1] << 16)
        present = slots >= 0
        write_async_result(m, dest, slots[present], result[present], "a wgmma")
        offs = np.concatenate(offs_read) if offs_read else None
        if offs is not None:
            m.mark_busy(offs, write=False, delta=1)
        _wgmma_groups(m).issue(lanes, WgmmaOp(lanes, dest, offs, a_regs))

    return wgmma


DECODERS = {"ldmatrix": d_ldmatrix, "stmatrix": d_stmatrix, "mma": d_mma, "wgmma": d_wgmma}
COLLECTIVES = {"ldmatrix", "stmatrix", "mma", "wgmma"}
