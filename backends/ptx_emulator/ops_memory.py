"""Loads, stores, atomics and the per-thread asynchronous copies (``cp.async``, sm_80).

Global accesses go through ``Memory`` (bounds and alignment checked against the launch's
buffers); shared accesses through the machine's per-CTA shared memory (bounds, alignment,
asynchronous operations in flight and, when enabled, races checked). A ``cp.async`` reads its
source when issued and lands in shared memory when a ``cp.async.wait_group`` retires its group;
until then its destination bytes are in flight and any other access to them is reported.
"""

from __future__ import annotations

import numpy as np

from .faults import PtxFault, UnsupportedPtx
from .isa import SHARED_WINDOW, STATE_SPACES, UNSIGNED, Reg, types_of, value_dtype, width
from .operands import address_reader, immediate, reader, vector_readers, vector_writers, writer
from .values import bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16


def space_of(ins) -> str:
    for part in ins.opcode:
        for space in STATE_SPACES:
            if part == space or part.startswith(space + "::"):
                return space
    return "generic"


def _vector(ins) -> int:
    return next((int(p[1:]) for p in ins.opcode if p in ("v2", "v4", "v8")), 1)


# -- byte access in a state space -------------------------------------------------------------
def load_bytes(m, space: str, addr: np.ndarray, nbytes: int, L) -> np.ndarray:
    """[lanes, nbytes] read at ``addr`` in ``space`` (generic: shared window or global)."""
    if space == "generic":
        in_shared = addr >= np.uint64(SHARED_WINDOW)
        if in_shared.all():
            return load_bytes(m, "shared", addr - np.uint64(SHARED_WINDOW), nbytes, L)
        if in_shared.any():
            idx = m.index(L)
            out = np.empty((len(idx), nbytes), dtype=np.uint8)
            out[in_shared] = load_bytes(
                m, "shared", addr[in_shared] - np.uint64(SHARED_WINDOW), nbytes, idx[in_shared]
            )
            out[~in_shared] = load_bytes(m, "global", addr[~in_shared], nbytes, idx[~in_shared])
            return out
        space = "global"
    if space in ("global", "param", "const"):
        return m.memory.load(addr, nbytes, m.where, m.who(L))
    if space == "shared":
        flat = m.shared_index(addr, nbytes, L, m.where)
        return m.shared_read(flat, nbytes, L, m.where)
    if space == "local":
        return m.local_memory(L).read(addr, nbytes, m)
    raise UnsupportedPtx(f"{m.where}: {space} loads are not emulated")


def store_bytes(m, space: str, addr: np.ndarray, data: np.ndarray, L) -> None:
    if space == "generic":
        in_shared = addr >= np.uint64(SHARED_WINDOW)
        if in_shared.all():
            return store_bytes(m, "shared", addr - np.uint64(SHARED_WINDOW), data, L)
        if in_shared.any():
            idx = m.index(L)
            store_bytes(
                m,
                "shared",
                addr[in_shared] - np.uint64(SHARED_WINDOW),
                data[in_shared],
                idx[in_shared],
            )
            return store_bytes(m, "global", addr[~in_shared], data[~in_shared], idx[~in_shared])
        space = "global"
    if space == "global":
        return m.memory.store(addr, data, m.where, m.who(L))
    if space == "shared":
        flat = m.shared_index(addr, data.shape[1], L, m.where)
        return m.shared_write(flat, data, L, m.where)
    if space == "local":
        return m.local_memory(L).write(addr, data, m)
    raise UnsupportedPtx(f"{m.where}: {space} stores are not emulated")


def _bytes_to(data: np.ndarray, t: str) -> np.ndarray:
    w = width(t) // 8
    return np.ascontiguousarray(data).view(UNSIGNED[8 * w]).reshape(len(data)).view(value_dtype(t))


def _to_bytes(values, t: str, count: int) -> np.ndarray:
    w = max(1, width(t) // 8)
    v = np.broadcast_to(np.asarray(values), (count,)).astype(value_dtype(t))
    return np.ascontiguousarray(v.view(UNSIGNED[8 * w])).view(np.uint8).reshape(count, w)


def d_ld(ins):
    space, t, k = space_of(ins), types_of(ins.opcode)[-1], _vector(ins)
    dst, mem = ins.operands[0], ins.operands[1]
    puts = vector_writers(dst, t)
    address = address_reader(mem)
    w = max(1, width(t) // 8)

    def handler(m, L):
        data = load_bytes(m, space, address(m, L), w * k, L)
        for i, put in enumerate(puts):
            put(m, L, _bytes_to(data[:, i * w : (i + 1) * w], t))

    return handler


d_ldu = d_ld


def d_st(ins):
    space, t = space_of(ins), types_of(ins.opcode)[-1]
    mem, src = ins.operands[0], ins.operands[1]
    bt = f"b{width(t)}" if t not in ("b8", "u8", "s8") else t
    gets = vector_readers(src, bt)
    address = address_reader(mem)

    def handler(m, L):
        count = m.count(L)
        data = (
            np.concatenate([_to_bytes(g(m, L), bt, count) for g in gets], axis=1)
            if len(gets) > 1
            else _to_bytes(gets[0](m, L), bt, count)
        )
        store_bytes(m, space, address(m, L), data, L)

    return handler


# -- atomics ----------------------------------------------------------------------------------
def _atomic_fn(op: str, t: str):
    if t in ("f16x2", "bf16x2", "f16", "bf16"):
        widen, narrow = (
            (bf16_to_f32, f32_to_bf16) if t.startswith("bf") else (f16_to_f32, f32_to_f16)
        )
        if op not in ("add", "min", "max"):
            raise UnsupportedPtx(f"atomic .{op}.{t}")
        fn = {"add": np.add, "min": np.fmin, "max": np.fmax}[op]
        if t.endswith("x2"):

            def packed(old, b, c):
                lo = narrow(fn(widen(old & 0xFFFF), widen(b & 0xFFFF))).astype(np.uint32)
                hi = narrow(fn(widen(old >> 16), widen(b >> 16))).astype(np.uint32)
                return lo | (hi << np.uint32(16))

            return packed
        return lambda old, b, c: narrow(fn(widen(old), widen(b)))
    table = {
        "add": lambda o, b, c: o + b,
        "or": lambda o, b, c: o | b,
        "and": lambda o, b, c: o & b,
        "xor": lambda o, b, c: o ^ b,
        "min": lambda o, b, c: np.minimum(o, b),
        "max": lambda o, b, c: np.maximum(o, b),
        "exch": lambda o, b, c: b,
        "cas": lambda o, b, c: np.where(o == b, c, o),
        "inc": lambda o, b, c: np.where(o >= b, 0, o + 1).astype(o.dtype),
        "dec": lambda o, b, c: np.where((o == 0) | (o > b), b, o - 1).astype(o.dtype),
    }
    if op not in table:
        raise UnsupportedPtx(f"atomic .{op}")
    return table[op]


def _atomic(ins, returns: bool):
    space = space_of(ins)
    t = types_of(ins.opcode)[-1]
    op = next(
        p
        for p in ins.opcode[1:]
        if p in ("add", "or", "and", "xor", "min", "max", "exch", "cas", "inc", "dec")
    )
    if returns:
        dst, mem, *srcs = ins.operands
        put = writer(dst, t)
    else:
        mem, *srcs = ins.operands
        put = None
    address = address_reader(mem)
    gets = [reader(s, t) for s in srcs]
    fn = _atomic_fn(op, t)
    w = width(t) // 8
    vt = "b" + str(width(t)) if t in ("f16x2", "bf16x2", "f16", "bf16") else t

    def handler(m, L):
        idx = m.index(L)
        addr = address(m, L)
        b = np.broadcast_to(np.asarray(gets[0](m, L)), (len(idx),))
        c = np.broadcast_to(np.asarray(gets[1](m, L)), (len(idx),)) if len(gets) > 1 else b
        old_all = np.empty(len(idx), dtype=value_dtype(vt))
        order = np.argsort(addr, kind="stable")
        sorted_addr = addr[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = sorted_addr[1:] != sorted_addr[:-1]
        rank = np.empty(len(order), dtype=np.int64)
        starts = np.flatnonzero(first)
        group = np.cumsum(first) - 1
        rank[order] = np.arange(len(order)) - starts[group]
        for r in range(int(rank.max()) + 1 if len(rank) else 0):
            sel = np.flatnonzero(rank == r)
            lanes = idx[sel]
            old = _bytes_to(load_bytes(m, space, addr[sel], w, lanes), vt)
            new = np.asarray(
                fn(
                    old,
                    b[sel].view(old.dtype) if b.dtype != old.dtype else b[sel],
                    c[sel].view(old.dtype) if c.dtype != old.dtype else c[sel],
                )
            )
            store_bytes(m, space, addr[sel], _to_bytes(new.astype(old.dtype), vt, len(sel)), lanes)
            old_all[sel] = old
        if put is not None:
            put(
                m,
                L,
                (
                    old_all.view(value_dtype(t))
                    if value_dtype(t) != old_all.dtype
                    and np.dtype(value_dtype(t)).itemsize == old_all.itemsize
                    else old_all
                ),
            )

    return handler


def d_atom(ins):
    return _atomic(ins, True)


def d_red(ins):
    return _atomic(ins, False)


# -- no-ops ------------------------------------------------------------------------------------
def d_nothing(ins):
    """Instructions with no effect the emulator can observe (fences order memory that the
    emulator keeps sequentially consistent; prefetches; scheduling hints)."""
    return lambda m, L: None


# -- cp.async: per-thread asynchronous copies into shared memory -------------------------------
class GroupedOps:
    """Asynchronous operations issued per lane and retired by commit/wait groups: an op
    belongs to the group its lane commits next; ``wait_group(keep)`` retires every op of a lane
    older than its ``keep`` most recent committed groups."""

    def __init__(self, n: int) -> None:
        self.committed = np.zeros(n, dtype=np.int64)
        self.ops: list[list] = []  # [lanes, group of each lane, payload]

    def issue(self, lanes: np.ndarray, payload) -> None:
        self.ops.append([lanes, self.committed[lanes].copy(), payload])

    def commit(self, lanes) -> None:
        self.committed[lanes] += 1

    def retire(self, lanes: np.ndarray, keep: int, committed_only: bool = True):
        """Yields (row selector, payload) of the ops' rows that ``lanes`` retire now."""
        waiting = np.zeros(len(self.committed), dtype=bool)
        waiting[lanes] = True
        remaining = []
        for op in self.ops:
            op_lanes, groups, payload = op
            limit = self.committed[op_lanes] - keep
            done = waiting[op_lanes] & (groups < limit)
            if not committed_only:
                done = waiting[op_lanes]
            if done.any():
                yield done, payload
            if not done.all():
                op[0], op[1] = op_lanes[~done], groups[~done]
                op[2] = payload.subset(~done)
                remaining.append(op)
        self.ops = remaining

    def pending(self, lanes: np.ndarray) -> bool:
        waiting = np.zeros(len(self.committed), dtype=bool)
        waiting[lanes] = True
        return any(waiting[op[0]].any() for op in self.ops)


class SharedCopy:
    """Rows of bytes bound for shared memory: flat destination indices and data per lane."""

    def __init__(self, lanes: np.ndarray, offs: np.ndarray, data: np.ndarray) -> None:
        self.lanes, self.offs, self.data = lanes, offs, data

    def subset(self, rows):
        return SharedCopy(self.lanes[rows], self.offs[rows], self.data[rows])

    def land(self, m, rows, where: str) -> None:
        lanes, offs, data = self.lanes[rows], self.offs[rows], self.data[rows]
        m.mark_busy(offs, write=True, delta=-1)
        if m.race is not None:
            m.race.write(m, offs, lanes, where, data)
        m.shared[offs] = data


def _cp_groups(m) -> GroupedOps:
    groups = m.state.get("cp.async")
    if groups is None:
        groups = m.state["cp.async"] = GroupedOps(m.n)
    return groups


def d_cp(ins):
    parts = ins.opcode
    if parts[1] == "async" and len(parts) > 2 and parts[2] in ("bulk",):
        raise UnsupportedPtx("cp.async.bulk is decoded by the TMA module")
    if parts[1:3] == ("async", "commit_group"):
        return lambda m, L: _cp_groups(m).commit(m.index(L))
    if parts[1:3] == ("async", "wait_group"):
        keep = int(immediate(ins.operands[0].text, "u32"))
        return lambda m, L: _cp_wait(m, L, keep)
    if parts[1:3] == ("async", "wait_all"):

        def wait_all(m, L):
            _cp_groups(m).commit(m.index(L))
            _cp_wait(m, L, 0)

        return wait_all
    if parts[1] == "async" and parts[2] in ("ca", "cg"):
        return _cp_async(ins)
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


def _cp_wait(m, L, keep: int) -> None:
    for rows, payload in _cp_groups(m).retire(m.index(L), keep):
        payload.land(m, rows, m.where)


def _cp_async(ins):
    dst, src, size, *rest = ins.operands
    cp_size = int(immediate(size.text, "u32"))
    if cp_size not in (4, 8, 16):
        raise PtxFault(f"{ins.where()}: cp.async copies 4, 8 or 16 bytes, not {cp_size}")
    dst_addr, src_addr = address_reader(dst), address_reader(src)
    src_size = ignore = None
    if rest and isinstance(rest[0], Reg) and rest[0].name.startswith("%p"):
        ignore = reader(rest[0], "pred")  # the ignore-src predicate: zero-fill, no read
    elif rest:
        src_size = reader(rest[0], "u32")  # bytes read; the rest zero-filled

    def handler(m, L):
        idx = m.index(L)
        n = len(idx)
        sizes = np.full(n, cp_size, dtype=np.int64)
        if src_size is not None:
            sizes = np.minimum(
                np.broadcast_to(np.asarray(src_size(m, L)), (n,)).astype(np.int64), cp_size
            )
        if ignore is not None:
            sizes = np.where(np.broadcast_to(ignore(m, L), (n,)), 0, sizes)
        data = np.zeros((n, cp_size), dtype=np.uint8)
        reading = np.flatnonzero(sizes > 0)
        if len(reading):
            a = src_addr(m, L)
            full = reading[sizes[reading] == cp_size]
            if len(full):
                data[full] = m.memory.load(a[full], cp_size, m.where, m.who(idx[full]))
            for b in range(cp_size):  # partial copies, byte by byte
                sel = reading[(sizes[reading] > b) & (sizes[reading] < cp_size)]
                if len(sel):
                    data[sel, b] = m.memory.load(
                        a[sel] + np.uint64(b), 1, m.where, m.who(idx[sel])
                    )[:, 0]
        flat = m.shared_index(dst_addr(m, L), cp_size, idx, m.where)
        offs = flat[:, None] + np.arange(cp_size)
        m.check_async_access(offs, idx, m.where, write=True)
        if m.race is not None:
            m.race.async_issue(m, offs, idx, m.where)
        m.mark_busy(offs, write=True, delta=1)
        _cp_groups(m).issue(idx, SharedCopy(idx, offs, data))

    return handler


DECODERS = {
    "ld": d_ld,
    "ldu": d_ldu,
    "st": d_st,
    "atom": d_atom,
    "red": d_red,
    "cp": d_cp,
    "fence": d_nothing,
    "membar": d_nothing,
    "prefetch": d_nothing,
    "prefetchu": d_nothing,
    "nanosleep": d_nothing,
    "discard": d_nothing,
    "applypriority": d_nothing,
}
