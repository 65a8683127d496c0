"""Execution of one batch of CTAs: every thread a lane of numpy arrays.

Scheduling: each step runs the instruction at the lowest program counter among the runnable
lanes, for the lanes at that counter, which reconverges structured control flow at its join
points and keeps the warps of a CTA in lockstep ("lockstep"). The "skewed" schedule instead
runs one warp (of every CTA of the batch) at a time, in a random order, from barrier to
barrier, so a missing barrier shows as wrong values as well as a race report.

Threads that wait park: at a barrier until every expected thread arrives, at an mbarrier wait
until its phase completes. When no thread can run, asynchronous work in flight is delivered
(TMA copies, tensor-core commits), which may release waiters; if nothing is in flight either,
the batch is deadlocked and the waiters are reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .faults import MAX_STEPS, WARP, DataRace, Deadlock, PtxFault, UnsupportedPtx
from . import mbarrier
from .decode import BRANCH, COLLECTIVE
from .isa import storage_dtype

RUN, PARK, EXIT = 0, 1, 2


@dataclass(frozen=True)
class Options:
    """How a launch is emulated: ``schedule`` "lockstep" or "skewed" (with ``seed``);
    ``race_check`` tracks which warp last wrote and read every shared byte between barriers
    and reports conflicting accesses with no barrier between them."""

    schedule: str = "lockstep"
    seed: int = 0
    race_check: bool = False
    max_steps: int = MAX_STEPS


class Machine:
    """One batch of CTAs of a launch, run to completion."""

    def __init__(self, program, table, grid, block, params, memory, shared_bytes, ctas, options):
        self.p, self.table, self.memory, self.options = program, table, memory, options
        self.grid, self.block = grid, block
        self.params = params  # name -> (address, bytes) of its buffer
        threads = block[0] * block[1] * block[2]
        self.threads, self.nctas = threads, len(ctas)
        self.ctas = ctas
        self.warps_per_cta = -(-threads // WARP)
        n = self.n = threads * self.nctas
        cta = np.repeat(np.arange(self.nctas, dtype=np.int64), threads)
        t = np.tile(np.arange(threads, dtype=np.int64), self.nctas)
        self.cta_index, self.thread = cta, t
        self.lane_id = t % WARP
        self.warp_in_cta = t // WARP
        self.warp_global = cta * self.warps_per_cta + self.warp_in_cta
        linear = np.asarray(list(ctas), dtype=np.int64)[cta]
        self._specials = {
            "%tid.x": t % block[0],
            "%tid.y": (t // block[0]) % block[1],
            "%tid.z": t // (block[0] * block[1]),
            "%ctaid.x": linear % grid[0],
            "%ctaid.y": (linear // grid[0]) % grid[1],
            "%ctaid.z": linear // (grid[0] * grid[1]),
            "%laneid": self.lane_id,
            "%warpid": self.warp_in_cta,
        }
        self.shared_size = shared_bytes
        # poisoned (NaN as fp32, -1 as int): a read of shared memory nobody wrote shows
        self.shared = np.full(self.nctas * max(shared_bytes, 1), 0xFF, dtype=np.uint8)
        self.cta_base = cta * max(shared_bytes, 1)
        self.regs: dict[str, np.ndarray] = {}
        self.poisoned: dict[str, list] = {}  # register -> [count per lane, reason]
        self.guarded: dict[str, list] = {}  # register -> [count per lane, reason]
        self.pending_values: dict[str, np.ndarray] = {}
        self.pc = np.zeros(n, dtype=np.int64)
        self.status = np.zeros(n, dtype=np.int8)
        self.parked_at = np.zeros(n, dtype=np.int64)  # the instruction a lane waits at
        self.parked: dict[tuple, list] = {}  # key -> [lane index arrays]
        self.barrier_arrivals: dict[int, np.ndarray] = {}
        self.epoch = np.zeros(self.nctas, dtype=np.int64)  # CTA-wide barriers passed
        self.state: dict[str, object] = {}  # per-feature state (mbarriers, groups...)
        self.async_ops: list = []  # deliverable asynchronous work in flight
        self.smem_busy = None  # per shared byte: async writers/readers
        self.race = None
        self.steps = 0
        self.rng = np.random.default_rng(options.seed)
        self.current_warp = None
        self.uniform, self.upc = True, 0
        self.run_lanes, self.nrun = slice(None), n
        self.dirty = True

    # -- lanes ---------------------------------------------------------------------------------
    def count(self, L) -> int:
        """How many lanes ``L`` holds."""
        return self.n if isinstance(L, slice) else len(L)

    def warp_leaders(self, L) -> np.ndarray:
        """The first lane of each warp in ``L`` (an instruction a warp executes once)."""
        idx = self.index(L)
        warp = self.warp_global[idx]
        return idx[np.r_[True, warp[1:] != warp[:-1]]] if len(idx) else idx

    def index(self, L) -> np.ndarray:
        """``L`` as an index array."""
        return np.arange(self.n) if isinstance(L, slice) else L

    def who(self, L):
        """``who(i)``: the i-th lane of ``L`` in words, for fault messages."""
        idx = self.index(L)

        def name(i):
            lane = int(idx[i])
            cta = int(np.asarray(list(self.ctas))[self.cta_index[lane]])
            g = self.grid
            return (
                f"thread {int(self.thread[lane])} of CTA "
                f"({cta % g[0]}, {(cta // g[0]) % g[1]}, {cta // (g[0] * g[1])})"
            )

        return name

    def special(self, name: str) -> np.ndarray:
        value = self._specials.get(name)
        if value is not None:
            return value
        scalars = {
            "%nwarpid": self.warps_per_cta,
            "%smid": 0,
            "%nsmid": 1,
            "%dynamic_smem_size": self.shared_size - self.p.static_shared_bytes,
            "%total_smem_size": self.shared_size,
            "%cluster_ctarank": 0,
            "%cluster_nctarank": 1,
        }
        for axis, b, g in zip("xyz", self.block, self.grid):
            scalars[f"%ntid.{axis}"] = b
            scalars[f"%nctaid.{axis}"] = g
            scalars[f"%cluster_ctaid.{axis}"] = 0
            scalars[f"%cluster_nctaid.{axis}"] = 1
        if name in scalars:
            value = np.full(self.n, scalars[name], dtype=np.int64)
        elif name.startswith("%lanemask_"):
            lane = self.lane_id
            value = {
                "eq": 1 << lane,
                "lt": (1 << lane) - 1,
                "le": (2 << lane) - 1,
                "gt": 0xFFFFFFFF ^ ((2 << lane) - 1),
                "ge": 0xFFFFFFFF ^ ((1 << lane) - 1),
            }[name.rsplit("_", 1)[1]]
            value = np.asarray(value, dtype=np.int64)
        else:
            raise UnsupportedPtx(f"special register {name} is not emulated")
        self._specials[name] = value
        return value

    def symbol_address(self, name: str) -> int:
        if name == self.p.dynamic_shared_symbol:
            return self.p.static_shared_bytes
        if name in self.p.shared_symbols:
            return self.p.shared_symbols[name][0]
        if name in self.params:
            return self.params[name][0]
        data = self.state.get(("global", name))
        if data is None and name in self.p.global_data:
            g = self.p.global_data[name]
            data = self.state[("global", name)] = self.memory.add_array(
                np.frombuffer(g.data, dtype=np.uint8).copy(), name
            )
        if data is None:
            raise UnsupportedPtx(f"{self.p.name}: unknown symbol {name}")
        return data

    # -- registers -----------------------------------------------------------------------------
    def new_register(self, name: str, t: str) -> np.ndarray:
        declared = self.p.registers.get(name)
        if declared is None:
            raise PtxFault(f"{self.where}: register {name} is not declared")
        arr = self.regs[name] = np.zeros(self.n, dtype=storage_dtype(declared))
        return arr

    def check_poisoned(self, name: str, L) -> None:
        count, reason = self.poisoned[name]
        hit = count[L] > 0
        if np.any(hit):
            i = int(np.argmax(np.atleast_1d(hit)))
            raise DataRace(
                f"{self.where}: register {name} of {self.who(L)(i)} is read while "
                f"{reason} is in flight (not yet retired by its wait)"
            )

    def check_guarded(self, name: str, L) -> None:
        for table, what in ((self.guarded, "an operand of"), (self.poisoned, "the result of")):
            entry = table.get(name)
            if entry is not None and np.any(entry[0][L] > 0):
                i = int(np.argmax(np.atleast_1d(entry[0][L] > 0)))
                raise DataRace(
                    f"{self.where}: register {name} of {self.who(L)(i)} is written "
                    f"while it is {what} {entry[1]} in flight"
                )

    def hold(self, table: dict, names, lanes, reason: str, delta: int = 1) -> None:
        """Counts ``lanes``' copies of ``names`` in (delta 1) or out of (-1) flight in
        ``table`` (``poisoned``: an asynchronous result; ``guarded``: an asynchronous
        operand)."""
        for name in names:
            entry = table.get(name)
            if entry is None:
                entry = table[name] = [np.zeros(self.n, dtype=np.int32), reason]
            entry[0][lanes] += delta
            if delta > 0:
                entry[1] = reason
            elif not entry[0].any():
                del table[name]

    # -- shared memory -------------------------------------------------------------------------
    def shared_index(self, addr: np.ndarray, nbytes: int, L, where: str) -> np.ndarray:
        """Flat byte indices (into ``self.shared``) of the first byte of each lane's access of
        ``nbytes`` at shared address ``addr``, after bounds and alignment checks."""
        a = (np.asarray(addr).astype(np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.int64)  # 32-bit
        bad = (a + nbytes > self.shared_size) | (a % min(nbytes, 16) != 0)
        if np.any(bad):
            i = int(np.argmax(bad))
            raise PtxFault(
                f"shared access of {nbytes} B at offset {int(a[i])} by "
                f"{self.who(L)(i)} in {where} is outside the {self.shared_size} B "
                f"of shared memory or misaligned"
            )
        return self.cta_base[L] + a

    def shared_read(
        self, flat: np.ndarray, nbytes: int, L, where: str, *, check=True
    ) -> np.ndarray:
        """[lanes, nbytes] bytes at flat shared indices ``flat`` (generic-proxy read)."""
        offs = flat[:, None] + np.arange(nbytes)
        if check:
            self.check_async_access(offs, L, where, write=False)
            if self.race is not None:
                self.race.read(self, offs, L, where)
        return self.shared[offs]

    def shared_write(
        self, flat: np.ndarray, data: np.ndarray, L, where: str, *, check=True
    ) -> None:
        offs = flat[:, None] + np.arange(data.shape[1])
        if check:
            self.check_async_access(offs, L, where, write=True)
            if self.race is not None:
                self.race.write(self, offs, L, where, data)
        self.shared[offs] = data

    def busy_map(self) -> np.ndarray:
        """Per shared byte: count of asynchronous readers (low 15 bits) and an asynchronous
        write in flight (bit 15)."""
        if self.smem_busy is None:
            self.smem_busy = np.zeros(self.shared.shape, dtype=np.uint16)
        return self.smem_busy

    def check_async_access(self, offs: np.ndarray, L, where: str, write: bool) -> None:
        busy = self.smem_busy
        if busy is None or not self.async_ops and not self.state.get("smem_busy_count"):
            return
        b = busy[offs]
        bad = (b & 0x8000) != 0
        if write:
            bad |= (b & 0x7FFF) != 0
        if bad.any():
            i = int(np.argmax(bad.any(axis=-1)))
            kind = "written by" if (b[i] & 0x8000).any() else "read by"
            raise DataRace(
                f"{where}: {self.who(L)(i)} {'writes' if write else 'reads'} shared "
                f"bytes at offset {int(offs[i][0] % max(self.shared_size, 1))} that are "
                f"being {kind} an asynchronous operation still in flight"
            )

    def mark_busy(self, offs: np.ndarray, write: bool, delta: int) -> None:
        """Marks the flat shared byte indices ``offs`` (unique) as the destination (``write``)
        or an operand of an asynchronous operation (delta +1), or releases them (-1)."""
        busy = self.busy_map()
        flat = np.unique(offs.ravel())
        if write:
            busy[flat] = (
                busy[flat] | np.uint16(0x8000) if delta > 0 else busy[flat] & np.uint16(0x7FFF)
            )
        else:
            busy[flat] = (busy[flat].astype(np.int32) + delta).astype(np.uint16)
        self.state["smem_busy_count"] = int(self.state.get("smem_busy_count", 0)) + delta

    # -- scheduling ----------------------------------------------------------------------------
    def sync_pc(self) -> None:
        """Materialises the shared program counter of a uniform run into every runnable lane
        (before lanes change status or diverge)."""
        if self.uniform:
            self.pc[self.run_lanes] = self.upc
            self.uniform = False

    def set_status(self, lanes, status: int) -> None:
        self.sync_pc()
        self.status[lanes] = status
        self.dirty = True

    def park(self, key: tuple, lanes: np.ndarray, retry: bool = False) -> None:
        """Parks ``lanes`` until ``release(key)``; with ``retry`` they re-execute the current
        instruction when released."""
        self.sync_pc()
        lanes = self.index(lanes)
        if retry:
            self.pc[lanes] -= 1
        self.parked_at[lanes] = self.pc[lanes] - (0 if retry else 1)
        self.status[lanes] = PARK
        self.parked.setdefault(key, []).append(lanes)
        self.dirty = True

    def release(self, key: tuple, cta_mask: np.ndarray | None = None) -> None:
        """Makes the lanes parked on ``key`` runnable (only those of CTAs in ``cta_mask``)."""
        groups = self.parked.pop(key, None)
        if not groups:
            return
        lanes = np.concatenate(groups)
        if cta_mask is not None:
            keep = ~cta_mask[self.cta_index[lanes]]
            if keep.any():
                self.parked[key] = [lanes[keep]]
            lanes = lanes[~keep]
        self.sync_pc()
        self.status[lanes] = RUN
        self.dirty = True

    def refresh(self) -> None:
        self.sync_pc()
        runnable = self.status == RUN
        if self.options.schedule == "skewed":
            runnable = self._skew(runnable)
        self.nrun = int(np.count_nonzero(runnable))
        self.run_lanes = slice(None) if self.nrun == self.n else np.flatnonzero(runnable)
        pcs = self.pc[self.run_lanes]
        self.uniform = self.nrun > 0 and bool((pcs == pcs[0]).all())
        if self.uniform:
            self.upc = int(pcs[0])
        self.dirty = False

    def _skew(self, runnable: np.ndarray) -> np.ndarray:
        warp = self.warp_in_cta
        if self.current_warp is not None and runnable[warp == self.current_warp].any():
            return runnable & (warp == self.current_warp)
        candidates = np.unique(warp[runnable])
        if len(candidates) == 0:
            return runnable
        self.current_warp = int(self.rng.choice(candidates))
        return runnable & (warp == self.current_warp)

    def run(self) -> None:
        instrs, table = self.p.instrs, self.table
        limit = self.options.max_steps
        while True:
            if self.dirty:
                self.refresh()
            if self.nrun == 0:
                if not (self.status != EXIT).any():
                    return
                self.unblock()
                continue
            if self.uniform:
                pc, L = self.upc, self.run_lanes
            else:
                lanes = self.run_lanes
                pcs = self.pc[lanes]
                pc = int(pcs.min())
                at = pcs == pc
                if at.all():
                    self.uniform, self.upc, L = True, pc, lanes
                else:
                    L = np.flatnonzero(at) if isinstance(lanes, slice) else lanes[at]
            self.steps += 1
            if self.steps > limit:
                raise PtxFault(f"{self.p.name}: more than {limit} steps; an endless loop?")
            if pc >= len(instrs):
                raise PtxFault(f"{self.p.name}: fell off the end of the kernel")
            ins = instrs[pc]
            handler, kind = table[pc]
            E = L
            if ins.guard is not None:
                g = self.regs.get(ins.guard)
                g = np.zeros(self.n, dtype=bool) if g is None else g
                g = g[L] if not ins.guard_negated else ~g[L]
                E = np.flatnonzero(g) if isinstance(L, slice) else L[g]
            if self.uniform and L is self.run_lanes:
                self.upc = pc + 1
            else:
                self.pc[L] = pc + 1
            self.where = f"{self.p.name}: {ins.where()}"
            try:
                if kind == BRANCH:
                    self._branch(handler, E, L)
                elif kind == COLLECTIVE:
                    handler(self, E, L)
                elif self.count(E):
                    handler(self, E)
            except PtxFault as fault:
                if self.where not in str(fault):
                    raise type(fault)(f"{self.where}: {fault}") from fault
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the instruction
                raise PtxFault(f"{self.where} failed: {type(exc).__name__}: {exc}") from exc

    def _branch(self, target: int, E, L) -> None:
        taken = self.count(E)
        if taken == 0:
            return
        if taken == self.count(L):
            if self.uniform and L is self.run_lanes:
                self.upc = target
            else:
                self.pc[L] = target
            return
        self.sync_pc()
        self.pc[E] = target
        self.uniform = False

    def exit_lanes(self, E) -> None:
        self.set_status(E, EXIT)

    def unblock(self) -> None:
        """Called when no lane can run: delivers asynchronous work in flight and completes
        barriers whose missing threads have exited; a deadlock if neither releases a lane."""
        released = False
        if self.async_ops:
            ops, self.async_ops = self.async_ops, []
            for op in ops:
                op.deliver(self)
            released = True
        released |= self.complete_barriers()
        if self.dirty and (self.status == RUN).any():
            return
        if self.options.schedule == "skewed" and (self.status == RUN).any():
            self.current_warp = None
            self.dirty = True
            return
        if not released or not (self.status == RUN).any():
            raise Deadlock(self.deadlock_report())

    def complete_barriers(self) -> bool:
        """Completes CTA-wide barriers all of whose live threads have arrived (threads that
        exit count as arrived)."""
        done = False
        for bar_id, arrivals in list(self.barrier_arrivals.items()):
            expected = self.expected_threads(bar_id)
            complete = (arrivals >= expected) & (arrivals > 0)
            if complete.any():
                self.finish_barrier(bar_id, complete)
                done = True
        return done

    def expected_threads(self, bar_id: int) -> np.ndarray:
        count = self.state.get(("bar_count", bar_id))
        if count is not None:
            return count
        return np.bincount(self.cta_index[self.status != EXIT], minlength=self.nctas)

    def finish_barrier(self, bar_id: int, complete: np.ndarray) -> None:
        arrivals = self.barrier_arrivals[bar_id]
        if self.state.get(("bar_aligned", bar_id)) and (arrivals[complete] < self.threads).any():
            cta = int(np.flatnonzero(complete & (arrivals < self.threads))[0])
            raise PtxFault(
                f"{self.where}: aligned barrier {bar_id} completed by "
                f"{int(arrivals[cta])} of the {self.threads} threads of CTA "
                f"{self.ctas[cta]} (the others exited without reaching it): a "
                f"divergent barrier"
            )
        arrivals[complete] = 0
        if ("bar_count", bar_id) not in self.state:
            self.epoch[complete] += 1
        self.release(("bar", bar_id), complete)

    def deadlock_report(self) -> str:
        waits: dict[tuple, list] = {}
        for key, groups in self.parked.items():
            lanes = np.concatenate(groups)
            for pc in np.unique(self.parked_at[lanes]).tolist():
                at = lanes[self.parked_at[lanes] == pc]
                waits.setdefault((key[0], pc), []).append(at)
        lines = []
        for (kind, pc), groups in waits.items():
            lanes = np.concatenate(groups)
            ins = self.p.instrs[min(pc, len(self.p.instrs) - 1)]
            lines.append(
                f"{len(lanes)} threads of {len(np.unique(self.cta_index[lanes]))} CTAs "
                f"wait ({kind}) at {ins.where()}"
            )
        barriers = mbarrier.describe(self)
        return (
            f"{self.p.name}: deadlock: every live thread waits and nothing in flight can "
            f"release one: "
            + " | ".join(lines)
            + (f"; the mbarriers: {barriers}" if barriers else "")
        )

    # -- collectives ---------------------------------------------------------------------------
    def check_converged(self, E, L, scope_warps: int = 1, membermask: int | None = None) -> None:
        """Every warp (``scope_warps`` 4: warpgroup) with a lane executing an ``.aligned``
        collective must execute it with all its live lanes (and, with ``membermask``, with
        every lane of the mask)."""
        idx = self.index(E)
        if len(idx) == 0:
            return
        group = self.warp_global[idx] // scope_warps
        live = self.status != EXIT
        executing = np.bincount(group, minlength=int(group.max()) + 1)
        total = np.bincount(self.warp_global[live] // scope_warps, minlength=len(executing))
        present = np.flatnonzero(executing)
        if self.options.schedule == "skewed" and scope_warps > 1:
            return  # warps run one at a time; the lockstep runs check warpgroups
        short = present[executing[present] != total[present]]
        if len(short):
            g = int(short[0])
            first = int(np.flatnonzero(self.warp_global // scope_warps == g)[0])
            missing = np.flatnonzero(live & (self.warp_global // scope_warps == g))
            missing = missing[~np.isin(missing, idx)]
            where = sorted(
                set(
                    self.p.instrs[min(int(p), len(self.p.instrs) - 1)].line
                    for p in self.pc[missing][:8]
                )
            )
            raise PtxFault(
                f"{self.where}: {'warpgroup' if scope_warps > 1 else 'warp'} of "
                f"{self.who([first])(0)} executes a converged collective with "
                f"{int(executing[g])} of {int(total[g])} live threads (the others are "
                f"at PTX lines {where})"
            )
        if membermask is not None and membermask != 0xFFFFFFFF:
            lanes = self.lane_id[idx]
            if np.any((membermask >> lanes) & 1 == 0):
                raise PtxFault(
                    f"{self.where}: a lane outside the member mask " f"{membermask:#x} executes it"
                )
