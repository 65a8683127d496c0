"""Control flow, barriers and warp-level collectives.

Collectives marked ``.sync.aligned`` (and ``bar.sync``) must be executed by every live lane of
the warp (or, for the warpgroup instructions, of the warpgroup): the machine checks it. Shuffles
and reductions exchange values between the lanes of one warp; a source lane that does not
execute the instruction is a fault.
"""

from __future__ import annotations

import numpy as np

from .faults import WARP, PtxFault, UnsupportedPtx
from .isa import Imm, Label, types_of
from .operands import immediate, pair_writers, reader, writer


def d_ret(ins):
    return lambda m, L: m.exit_lanes(L)


def d_trap(ins):
    def trap(m, L):
        raise PtxFault(f"{m.where}: the kernel trapped ({m.who(L)(0)})")

    return trap


def d_bar(ins):
    """bar.sync / barrier.sync / bar.arrive (id, optional thread count)."""
    parts = ins.opcode
    if parts[0] == "bar" and len(parts) > 1 and parts[1] == "warp":
        return _warp_sync(ins)
    if "red" in parts:
        raise UnsupportedPtx(f"{ins.where()}: reduction barriers are not emulated")
    arrive_only = "arrive" in parts
    aligned = parts[0] == "bar" or "aligned" in parts
    bar_id = reader(ins.operands[0], "u32") if ins.operands else (lambda m, L: np.uint32(0))
    count = reader(ins.operands[1], "u32") if len(ins.operands) > 1 else None

    def barrier(m, E, L):
        if aligned:
            m.check_converged(E, L)
        if m.count(E) == 0:
            return
        idx = m.index(E)
        ids = np.broadcast_to(np.asarray(bar_id(m, idx)), (len(idx),)).astype(np.int64)
        for b in np.unique(ids).tolist():
            lanes = idx[ids == b]
            arrivals = m.barrier_arrivals.get(b)
            if arrivals is None:
                arrivals = m.barrier_arrivals[b] = np.zeros(m.nctas, dtype=np.int64)
            arrivals += np.bincount(m.cta_index[lanes], minlength=m.nctas)
            if aligned:
                m.state[("bar_aligned", b)] = True
                _same_instruction(m, b, lanes)
            if count is not None:
                expected = int(np.asarray(count(m, lanes)).ravel()[0])
                if expected % WARP:
                    raise PtxFault(
                        f"{m.where}: barrier thread count {expected} is not a "
                        f"multiple of the warp size"
                    )
                m.state[("bar_count", b)] = np.full(m.nctas, expected)
            if not arrive_only:
                m.park(("bar", b), lanes)
        m.complete_barriers()

    return barrier


def _same_instruction(m, bar_id: int, lanes: np.ndarray) -> None:
    """Threads of a CTA meeting at an aligned barrier must all execute the same instruction."""
    key = ("bar_pc", bar_id)
    pcs = m.state.get(key)
    if pcs is None:
        pcs = m.state[key] = np.full(m.nctas, -1, dtype=np.int64)
    ctas = m.cta_index[lanes]
    first = m.barrier_arrivals[bar_id][ctas] == np.bincount(ctas, minlength=m.nctas)[ctas]
    here = int(m.pc[lanes[0]]) if not m.uniform else m.upc
    pcs[ctas[first]] = here
    if (pcs[ctas] != here).any():
        cta = int(ctas[np.argmax(pcs[ctas] != here)])
        raise PtxFault(
            f"{m.where}: threads of CTA {m.ctas[cta]} meet at aligned barrier "
            f"{bar_id} from different instructions (PTX lines "
            f"{m.p.instrs[int(pcs[cta]) - 1].line} and {m.p.instrs[here - 1].line}): "
            f"a divergent barrier"
        )


def _warp_sync(ins):
    mask = ins.operands[0]

    def warp_sync(m, E, L):
        membermask = int(immediate(mask.text, "b32")) if isinstance(mask, Imm) else None
        m.check_converged(E, L, membermask=membermask)

    return warp_sync


d_barrier = d_bar


def d_bra(ins):
    target = ins.operands[0]
    if not isinstance(target, Label):
        raise UnsupportedPtx(f"{ins.where()}: indirect branches are not emulated")
    return target.name


def d_call(ins):
    callee = next((o.name for o in ins.operands if hasattr(o, "name")), "?")

    def call(m, L):
        if callee == "__assertfail":
            raise PtxFault(f"{m.where}: a device-side assertion failed ({m.who(L)(0)})")
        if callee == "vprintf":
            return
        raise UnsupportedPtx(f"{m.where}: calls ({callee}) are not emulated")

    return call


def d_param_decl(ins):
    return lambda m, L: None


# -- warp collectives -------------------------------------------------------------------------
def _warp_values(m, idx: np.ndarray, values) -> np.ndarray:
    """A full-batch array holding ``values`` at lanes ``idx`` (for exchanges between lanes)."""
    values = np.broadcast_to(np.asarray(values), (len(idx),))
    full = np.zeros(m.n, dtype=values.dtype)
    full[idx] = values
    return full


def _member_mask(m, mask_reader, idx) -> int:
    masks = np.unique(np.broadcast_to(np.asarray(mask_reader(m, idx)), (len(idx),)))
    if len(masks) != 1:
        raise UnsupportedPtx(f"{m.where}: per-warp member masks that differ are not emulated")
    return int(masks[0]) & 0xFFFFFFFF


def d_shfl(ins):
    mode, t = ins.opcode[2], types_of(ins.opcode)[-1]
    dst, src, b_op, c_op, mask_op = ins.operands
    put, put_p = pair_writers(dst, t)
    get_a, get_b, get_c = reader(src, t), reader(b_op, "u32"), reader(c_op, "u32")
    get_mask = reader(mask_op, "b32")

    def shfl(m, E, L):
        if m.count(E) == 0:
            return
        idx = m.index(E)
        m.check_converged(idx, L, membermask=_member_mask(m, get_mask, idx))
        executing = np.zeros(m.n, dtype=bool)
        executing[idx] = True
        a = _warp_values(m, idx, get_a(m, idx))
        bval = np.broadcast_to(np.asarray(get_b(m, idx)), (len(idx),)).astype(np.int64)
        cval = np.broadcast_to(np.asarray(get_c(m, idx)), (len(idx),)).astype(np.int64)
        lane = m.lane_id[idx]
        seg = (cval >> 8) & 0x1F
        clamp = cval & 0x1F
        min_lane = lane & seg
        max_lane = min_lane | (clamp & ~seg)
        if mode == "up":
            j = lane - bval
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bval
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        elif mode == "idx":
            j = min_lane | (bval & ~seg)
            ok = j <= max_lane
        else:
            raise UnsupportedPtx(f"{m.where}: shfl mode {mode}")
        j = np.where(ok, j, lane)
        source = idx - lane + j
        if not executing[source].all():
            i = int(np.argmin(executing[source]))
            raise PtxFault(
                f"{m.where}: {m.who(idx)(i)} reads lane {int(j[i])}, which does not "
                f"execute the shuffle"
            )
        put(m, idx, a[source])
        if put_p is not None:
            put_p(m, idx, ok)

    return shfl


_REDUX = {
    "add": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
}


def d_redux(ins):
    op, t = ins.opcode[2], types_of(ins.opcode)[-1]
    dst, src, mask_op = ins.operands
    get, put, get_mask = reader(src, t), writer(dst, t), reader(mask_op, "b32")
    fn = _REDUX[op]
    if t == "f32":
        nan = "NaN" in ins.opcode
        absolute = "abs" in ins.opcode
        fn = {"min": np.minimum if nan else np.fmin, "max": np.maximum if nan else np.fmax}[op]

    def redux(m, E, L):
        if m.count(E) == 0:
            return
        idx = m.index(E)
        m.check_converged(idx, L, membermask=_member_mask(m, get_mask, idx))
        v = np.broadcast_to(np.asarray(get(m, idx)), (len(idx),))
        if t == "f32" and absolute:
            v = np.abs(v)
        warp = m.warp_global[idx]
        order = np.argsort(warp, kind="stable")
        w_sorted = warp[order]
        starts = np.flatnonzero(np.r_[True, w_sorted[1:] != w_sorted[:-1]])
        reduced = fn.reduceat(
            v[order].astype(np.int64) if op == "add" and t != "f32" else v[order], starts
        )
        group = np.searchsorted(w_sorted[starts], warp)
        put(m, idx, np.asarray(reduced[group]).astype(v.dtype))

    return redux


def d_vote(ins):
    mode = ins.opcode[2]
    dst, src, mask_op = ins.operands
    get, get_mask = reader(src, "pred"), reader(mask_op, "b32")
    put = writer(dst, "b32" if mode == "ballot" else "pred")

    def vote(m, E, L):
        if m.count(E) == 0:
            return
        idx = m.index(E)
        m.check_converged(idx, L, membermask=_member_mask(m, get_mask, idx))
        p = np.broadcast_to(np.asarray(get(m, idx)), (len(idx),))
        warp = m.warp_global[idx]
        nwarps = int(warp.max()) + 1
        ones = np.bincount(warp, weights=p, minlength=nwarps)
        total = np.bincount(warp, minlength=nwarps)
        if mode == "ballot":
            bits = np.zeros(nwarps, dtype=np.uint64)
            np.bitwise_or.at(bits, warp, (p.astype(np.uint64) << m.lane_id[idx].astype(np.uint64)))
            return put(m, idx, bits[warp].astype(np.uint32))
        result = {"all": ones == total, "any": ones > 0, "uni": (ones == 0) | (ones == total)}[mode]
        put(m, idx, result[warp])

    return vote


def d_activemask(ins):
    put = writer(ins.operands[0], "b32")

    def activemask(m, E, L):
        idx = m.index(E)
        if not len(idx):
            return
        warp = m.warp_global[idx]
        bits = np.zeros(int(warp.max()) + 1, dtype=np.uint64)
        np.bitwise_or.at(bits, warp, np.uint64(1) << m.lane_id[idx].astype(np.uint64))
        put(m, idx, bits[warp].astype(np.uint32))

    return activemask


def d_elect(ins):
    dst, mask_op = ins.operands
    put, put_p = pair_writers(dst, "b32")
    get_mask = reader(mask_op, "b32")

    def elect(m, E, L):
        if m.count(E) == 0:
            return
        idx = m.index(E)
        mask = _member_mask(m, get_mask, idx)
        m.check_converged(idx, L, membermask=mask)
        lane = m.lane_id[idx]
        warp = m.warp_global[idx]
        candidates = np.where((mask >> lane) & 1 == 1, lane, WARP)
        leader = np.full(int(warp.max()) + 1, WARP, dtype=np.int64)
        np.minimum.at(leader, warp, candidates)
        put(m, idx, leader[warp].astype(np.uint32))
        if put_p is not None:
            put_p(m, idx, lane == leader[warp])

    return elect


def d_setmaxnreg(ins):
    def setmaxnreg(m, E, L):
        m.check_converged(E, L, scope_warps=4)

    return setmaxnreg


DECODERS = {
    "ret": d_ret,
    "exit": d_ret,
    "trap": d_trap,
    "brkpt": d_trap,
    "bar": d_bar,
    "barrier": d_barrier,
    "call": d_call,
    "shfl": d_shfl,
    "redux": d_redux,
    "vote": d_vote,
    "activemask": d_activemask,
    "elect": d_elect,
    "setmaxnreg": d_setmaxnreg,
    "griddepcontrol": lambda ins: (lambda m, L: None),
    ".param": d_param_decl,
}
COLLECTIVES = {"bar", "barrier", "shfl", "redux", "vote", "activemask", "elect", "setmaxnreg"}
