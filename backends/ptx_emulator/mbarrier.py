"""mbarriers: shared-memory objects that count arrivals and transaction bytes per phase.

An mbarrier is initialised with an expected arrival count; a phase completes when that many
arrivals have come and its transaction count (raised by ``expect_tx``, lowered by the bytes of
asynchronous copies that signal it) is back at zero. ``try_wait.parity p`` succeeds once the
phase of parity ``p`` has completed; a thread that waits on an incomplete phase parks until it
completes. The objects live beside shared memory, keyed by their flat shared address; a use
before ``init`` or after ``inval`` is a fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .faults import PtxFault, UnsupportedPtx
from .operands import address_reader, reader, writer


@dataclass
class MBarrier:
    expected: int
    pending: int
    tx: int = 0
    phase: int = 0  # completed phases
    arrivals_log: list = field(default_factory=list)


def barriers(m) -> dict[int, MBarrier]:
    table = m.state.get("mbarriers")
    if table is None:
        table = m.state["mbarriers"] = {}
    return table


def flat_addresses(m, get_address, L) -> np.ndarray:
    addr = get_address(m, L)
    return m.shared_index(addr, 8, L, m.where)


def lookup(m, flat: int) -> MBarrier:
    bar = barriers(m).get(flat)
    if bar is None:
        raise PtxFault(
            f"{m.where}: mbarrier at shared offset {flat % max(m.shared_size, 1)} is "
            f"used before mbarrier.init (or after mbarrier.inval)"
        )
    return bar


def arrive(m, flat: int, count: int = 1, tx: int = 0) -> None:
    """``count`` arrivals and ``tx`` more expected transaction bytes at the mbarrier ``flat``."""
    bar = lookup(m, flat)
    bar.tx += tx
    bar.pending -= count
    if bar.pending < 0:
        raise PtxFault(
            f"{m.where}: mbarrier at shared offset {flat % max(m.shared_size, 1)} "
            f"receives more arrivals than its count {bar.expected} in phase {bar.phase}"
        )
    _maybe_complete(m, flat, bar)


def complete_tx(m, flat: int, nbytes: int) -> None:
    """An asynchronous operation's ``nbytes`` have landed; they count against the mbarrier's
    transaction count."""
    bar = lookup(m, flat)
    bar.tx -= nbytes
    _maybe_complete(m, flat, bar)


def _maybe_complete(m, flat: int, bar: MBarrier) -> None:
    if bar.pending == 0 and bar.tx == 0:
        bar.phase += 1
        bar.pending = bar.expected
        m.release(("mbarrier", flat))


def describe(m) -> str:
    """The incomplete mbarriers (the first few), for a deadlock report."""
    waiting = [(flat, b) for flat, b in barriers(m).items() if b.pending != b.expected or b.tx]
    text = "; ".join(
        f"CTA {m.ctas[flat // max(m.shared_size, 1)]} offset "
        f"{flat % max(m.shared_size, 1)}: phase {b.phase}, {b.pending} of "
        f"{b.expected} arrivals missing, tx-count {b.tx}"
        for flat, b in waiting[:4]
    )
    return text + (f"; and {len(waiting) - 4} more" if len(waiting) > 4 else "")


def _per_barrier(m, flat: np.ndarray):
    """(flat address, how many lanes) for each distinct mbarrier the lanes name."""
    values, counts = np.unique(flat, return_counts=True)
    return zip(values.tolist(), counts.tolist())


def d_mbarrier(ins):
    op = ins.opcode[1]
    if op == "init":
        mem, count = ins.operands
        address, get_count = address_reader(mem), reader(count, "u32")

        def init(m, L):
            flat = flat_addresses(m, address, L)
            counts = np.broadcast_to(np.asarray(get_count(m, L)), (len(flat),))
            for f, c in zip(flat.tolist(), counts.tolist()):
                if c < 1:
                    raise PtxFault(f"{m.where}: mbarrier.init with count {c}")
                barriers(m)[f] = MBarrier(int(c), int(c))

        return init
    if op == "inval":
        address = address_reader(ins.operands[0])

        def inval(m, L):
            for f in np.unique(flat_addresses(m, address, L)).tolist():
                lookup(m, f)
                del barriers(m)[f]

        return inval
    if op in ("arrive", "arrive_drop"):
        expect = "expect_tx" in ins.opcode
        if "noComplete" in ins.opcode:
            raise UnsupportedPtx(f"{ins.where()}: mbarrier.arrive.noComplete is not emulated")
        state, mem, *rest = ins.operands
        address = address_reader(mem)
        put_state = writer(state, "b64")
        get_extra = reader(rest[0], "u32") if rest else None

        def do_arrive(m, L):
            flat = flat_addresses(m, address, L)
            extra = (
                np.broadcast_to(np.asarray(get_extra(m, L)), (len(flat),)) if get_extra else None
            )
            phases = np.zeros(len(flat), dtype=np.uint64)
            for f in np.unique(flat).tolist():
                sel = flat == f
                phases[sel] = lookup(m, f).phase
                lanes = int(sel.sum())
                if expect:
                    arrive(m, f, lanes, int(extra[sel].astype(np.int64).sum()))
                else:
                    arrive(m, f, lanes * (int(extra[sel][0]) if extra is not None else 1))
            put_state(m, L, phases)

        return do_arrive
    if op in ("expect_tx", "complete_tx"):
        mem, tx = ins.operands
        address, get_tx = address_reader(mem), reader(tx, "u32")

        def transaction(m, L):
            flat = flat_addresses(m, address, L)
            txs = np.broadcast_to(np.asarray(get_tx(m, L)), (len(flat),)).astype(np.int64)
            for f in np.unique(flat).tolist():
                nbytes = int(txs[flat == f].sum())
                if op == "expect_tx":
                    bar = lookup(m, f)
                    bar.tx += nbytes
                else:
                    complete_tx(m, f, nbytes)

        return transaction
    if op in ("try_wait", "test_wait"):
        parity = "parity" in ins.opcode
        done, mem, token = ins.operands[:3]
        address, put = address_reader(mem), writer(done, "pred")
        get_token = reader(token, "u32" if parity else "b64")

        def wait(m, E, L):
            if m.count(E) == 0:
                return
            idx = m.index(E)
            flat = flat_addresses(m, address, idx)
            tokens = np.broadcast_to(np.asarray(get_token(m, idx)), (len(idx),)).astype(np.int64)
            complete = np.zeros(len(idx), dtype=bool)
            for f in np.unique(flat).tolist():
                sel = flat == f
                phase = lookup(m, f).phase
                if parity:  # the phase of parity p has completed once the current differs
                    complete[sel] = (phase % 2) != (tokens[sel] % 2)
                else:  # a token from arrive: the phase it was taken in has completed
                    complete[sel] = phase > tokens[sel]
            put(m, idx[complete], True)
            for f in np.unique(flat[~complete]).tolist():
                m.park(("mbarrier", f), idx[(~complete) & (flat == f)], retry=True)

        return wait
    if op == "pending_count":
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


DECODERS = {"mbarrier": d_mbarrier}
COLLECTIVES = {("mbarrier", "try_wait"), ("mbarrier", "test_wait")}
