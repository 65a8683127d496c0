"""Execution: every thread of a batch of CTAs as numpy lanes, lowest program counter first."""

from __future__ import annotations

import numpy as np

from .faults import MAX_STEPS, WARP, PtxFault
from .program import Imm, Instr, Mem, Reg, Special, Sym, Vec
from .values import (_FLOAT_TYPES, _INT_TYPES, _ROUNDING, _TYPE_NAMES, _UNSIGNED, _bf16_bits_to_f32,
                     _f32_op, _f32_to_bf16_bits, _flush, _from_bits, _to_bits, _width)


class Machine:
    """One batch of CTAs of a launch, run to completion."""

    def __init__(self, program, grid, block, params, memory, dynamic_shared_bytes, ctas):
        self.p = program
        self.memory = memory
        self.params = {name: (t, v) for (name, t), v in zip(program.params, params)}
        threads = block[0] * block[1] * block[2]
        cta = np.repeat(np.asarray(list(ctas), dtype=np.int64), threads)
        t = np.tile(np.arange(threads, dtype=np.int64), len(ctas))
        self.threads = threads
        self.n = len(t)
        self.cta_index = cta - ctas[0]
        self.thread = t
        self.specials = {
            "%tid.x": t % block[0], "%tid.y": (t // block[0]) % block[1],
            "%tid.z": t // (block[0] * block[1]),
            "%ctaid.x": cta % grid[0], "%ctaid.y": (cta // grid[0]) % grid[1],
            "%ctaid.z": cta // (grid[0] * grid[1]),
            "%laneid": t % WARP, "%warpid": t // WARP,
        }
        for axis, (b, g) in zip("xyz", zip(block, grid)):
            self.specials[f"%ntid.{axis}"] = np.full(self.n, b)
            self.specials[f"%nctaid.{axis}"] = np.full(self.n, g)
        self.shared_size = dynamic_shared_bytes
        # poisoned (NaN as fp32, -1 as int): a read of shared memory nobody wrote shows
        self.shared = np.full((len(ctas), max(self.shared_size, 1)), 0xFF, dtype=np.uint8)
        self.regs: dict[str, np.ndarray] = {}
        self.pc = np.zeros(self.n, dtype=np.int64)
        self.alive = np.ones(self.n, dtype=bool)
        self.ctas = ctas

    def lane_name(self, lanes: np.ndarray):
        def name(i):
            lane = int(lanes[i])
            return (f"thread {int(self.thread[lane])} of CTA "
                    f"({int(self.specials['%ctaid.x'][lane])}, {int(self.specials['%ctaid.y'][lane])}, "
                    f"{int(self.specials['%ctaid.z'][lane])})")
        return name

    # operands
    def read(self, op, t: str, lanes: np.ndarray) -> np.ndarray:
        if isinstance(op, Reg):
            bits = self.regs.get(op.name)
            if bits is None:
                bits = self.regs[op.name] = np.zeros(self.n, dtype=np.uint64)
            return _from_bits(bits[lanes], t)
        if isinstance(op, Imm):
            return _from_bits(np.full(len(lanes), self._imm_bits(op.text, t), dtype=np.uint64), t)
        if isinstance(op, Special):
            return _from_bits(self.specials[op.name][lanes].astype(np.uint64), t)
        if isinstance(op, Sym):
            return _from_bits(np.full(len(lanes), self._symbol_address(op.name), dtype=np.uint64), t)
        raise PtxFault(f"cannot read operand {op}")

    def _imm_bits(self, text: str, t: str) -> int:
        if text[:2] in ("0f", "0F", "0d", "0D"):  # the bits of an f32 / f64 value
            return int(text[2:], 16)
        value = int(text.rstrip("U"), 0)
        if t in _FLOAT_TYPES:
            return int(_to_bits(np.array([value], dtype=np.float64), t)[0])
        return value & ((1 << 64) - 1)

    def _symbol_address(self, name: str) -> int:
        if name == self.p.dynamic_shared_symbol:
            return 0
        raise PtxFault(f"unknown symbol {name}")

    def write(self, op, t: str, lanes: np.ndarray, values) -> None:
        if not isinstance(op, Reg):
            raise PtxFault(f"cannot write operand {op}")
        bits = self.regs.get(op.name)
        if bits is None:
            bits = self.regs[op.name] = np.zeros(self.n, dtype=np.uint64)
        bits[lanes] = _to_bits(np.broadcast_to(values, (len(lanes),)), t)

    # the scheduler
    def run(self) -> None:
        instrs = self.p.instrs
        steps = 0
        while self.alive.any():
            steps += 1
            if steps > MAX_STEPS:
                raise PtxFault(f"{self.p.name}: more than {MAX_STEPS} steps; an endless loop?")
            pc = int(self.pc[self.alive].min())
            if pc >= len(instrs):
                raise PtxFault(f"{self.p.name}: fell off the end of the kernel")
            lanes = np.flatnonzero(self.alive & (self.pc == pc))
            ins = instrs[pc]
            executing = lanes
            if ins.guard is not None:
                g = self.read(Reg(ins.guard), "pred", lanes)
                executing = lanes[~g if ins.guard_negated else g]
            self.pc[lanes] = pc + 1
            try:
                self.execute(ins, executing, lanes)
            except PtxFault:
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the instruction
                raise PtxFault(f"{self.p.name}: '{ins.text}' failed: {exc}") from exc

    def execute(self, ins: Instr, lanes: np.ndarray, at_pc: np.ndarray) -> None:
        op = ins.opcode[0]
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            raise PtxFault(f"{self.p.name}: instruction '{ins.text}' is not emulated")
        if op in ("bar", "barrier"):
            handler(ins, lanes, at_pc)
        elif len(lanes):
            handler(ins, lanes)

    @staticmethod
    def _type(ins: Instr) -> str:
        for part in reversed(ins.opcode):
            if part in _TYPE_NAMES:
                return part
        raise PtxFault(f"no type in '{ins.text}'")

    # control flow and synchronisation
    def op_bra(self, ins, lanes):
        self.pc[lanes] = self.p.labels[ins.operands[0].name]

    def op_ret(self, ins, lanes):
        self.alive[lanes] = False

    op_exit = op_ret

    def op_bar(self, ins, lanes, at_pc):
        if len(ins.operands) > 1:
            raise PtxFault(f"'{ins.text}': barriers with a thread count are not emulated")
        if len(lanes) != len(at_pc):
            raise PtxFault(f"'{ins.text}' is predicated off for some threads")
        arrived = np.bincount(self.cta_index[at_pc], minlength=len(self.ctas))
        live = np.bincount(self.cta_index[self.alive], minlength=len(self.ctas))
        for cta in np.flatnonzero(arrived):
            if arrived[cta] != live[cta]:
                raise PtxFault(f"'{ins.text}' reached by {arrived[cta]} of {live[cta]} live "
                               f"threads of CTA {self.ctas[cta]}: a divergent barrier")

    op_barrier = op_bar

    def op_shfl(self, ins, lanes):
        mode, t = ins.opcode[2], self._type(ins)
        if len(ins.operands) != 5 or "|" in getattr(ins.operands[0], "name", ""):
            raise PtxFault(f"'{ins.text}': only shfl.sync d, a, b, c, membermask is emulated")
        dst, src, b_op, c_op, mask_op = ins.operands
        membermask = int(self.read(mask_op, "b32", lanes[:1])[0])
        warp = (self.cta_index * self.threads + self.thread) // WARP
        warps_here = np.bincount(warp[lanes], minlength=int(warp[-1]) + 1)
        for w in np.flatnonzero(warps_here):
            first = w * WARP
            size = min(WARP, self.threads - int(self.thread[first]))
            needed = [i for i in range(size) if membermask >> i & 1]
            executing = set(self.specials["%laneid"][lanes[warp[lanes] == w]].tolist())
            if warps_here[w] != len(needed) or not executing.issuperset(needed):
                raise PtxFault(f"'{ins.text}': lanes {sorted(set(needed) - executing)} of the "
                               f"member mask are not converged here ({self.lane_name(np.array([first]))(0)})")
        lane_id = self.specials["%laneid"]
        a = self.read(src, t, np.arange(self.n))
        bval = self.read(b_op, "u32", lanes).astype(np.int64)
        cval = self.read(c_op, "u32", lanes).astype(np.int64)
        lane = lane_id[lanes]
        seg = (cval >> 8) & 0x1F
        min_lane = lane & seg
        max_lane = min_lane | ((cval & 0x1F) & ~seg)
        if mode == "idx":
            j = min_lane | (bval & ~seg)
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bval
            ok = j <= max_lane
        else:
            raise PtxFault(f"'{ins.text}': shfl mode {mode} is not emulated")
        j = np.where(ok, j, lane)
        source = lanes - lane + j
        self.write(dst, t, lanes, a[source])

    # data movement
    def op_mov(self, ins, lanes):
        t = self._type(ins)
        dst, src = ins.operands
        if isinstance(dst, Vec):  # unpack: first element takes the low bits
            w = _width(t) // len(dst.items)
            bits = self.read(src, t, lanes).astype(np.uint64)
            for i, item in enumerate(dst.items):
                self.write(item, f"b{w}", lanes, (bits >> np.uint64(i * w)) & np.uint64((1 << w) - 1))
            return
        if isinstance(src, Vec):
            w = _width(t) // len(src.items)
            bits = np.zeros(len(lanes), dtype=np.uint64)
            for i, item in enumerate(src.items):
                bits |= self.read(item, f"b{w}", lanes).astype(np.uint64) << np.uint64(i * w)
            self.write(dst, t, lanes, _from_bits(bits, t))
            return
        self.write(dst, t, lanes, self.read(src, t, lanes))

    def _address(self, mem: Mem, lanes, space: str) -> np.ndarray:
        t = "u32" if space == "shared" and not isinstance(mem.base, Sym) else "u64"
        base = self.read(mem.base, t, lanes).astype(np.uint64)
        return base + np.uint64(mem.offset & ((1 << 64) - 1))

    def _space(self, ins) -> str:
        for space in ("param", "global", "shared", "local", "const"):
            if space in ins.opcode:
                return space
        return "generic"

    def op_ld(self, ins, lanes):
        space, t = self._space(ins), self._type(ins)
        dst, mem = ins.operands
        if space == "param":
            name = mem.base.name if isinstance(mem.base, Sym) else None
            if name not in self.params or mem.offset:
                raise PtxFault(f"'{ins.text}': unknown kernel parameter")
            ptype, value = self.params[name]
            if ptype in _FLOAT_TYPES:
                return self.write(dst, ptype, lanes, np.full(len(lanes), value, dtype=_FLOAT_TYPES[ptype]))
            return self.write(dst, t, lanes, np.full(len(lanes), int(value) & ((1 << _width(t)) - 1),
                                                     dtype=np.uint64))
        items = dst.items if isinstance(dst, Vec) else (dst,)
        w = _width(t) // 8
        data = self._load(space, self._address(mem, lanes, space), w * len(items), ins, lanes)
        for i, item in enumerate(items):
            raw = data[:, i * w:(i + 1) * w].copy().view(_UNSIGNED[8 * w])[:, 0]
            self.write(item, t, lanes, _from_bits(raw.astype(np.uint64), t))

    def op_st(self, ins, lanes):
        space, t = self._space(ins), self._type(ins)
        mem, src = ins.operands
        items = src.items if isinstance(src, Vec) else (src,)
        w = _width(t) // 8
        data = np.empty((len(lanes), w * len(items)), dtype=np.uint8)
        for i, item in enumerate(items):
            bits = self.read(item, f"b{8 * w}", lanes)
            data[:, i * w:(i + 1) * w] = bits.astype(_UNSIGNED[8 * w]).view(np.uint8).reshape(len(lanes), w)
        self._store(space, self._address(mem, lanes, space), data, ins, lanes)

    def _load(self, space, addr, nbytes, ins, lanes):
        if space == "global":
            return self.memory.load(addr, nbytes, ins, self.lane_name(lanes))
        if space == "shared":
            offs = self._shared_offsets(addr, nbytes, ins, lanes)
            return self.shared[self.cta_index[lanes][:, None], offs]
        raise PtxFault(f"'{ins.text}': {space} loads are not emulated")

    def _store(self, space, addr, data, ins, lanes):
        if space == "global":
            return self.memory.store(addr, data, ins, self.lane_name(lanes))
        if space == "shared":
            offs = self._shared_offsets(addr, data.shape[1], ins, lanes)
            self.shared[self.cta_index[lanes][:, None], offs] = data
            return
        raise PtxFault(f"'{ins.text}': {space} stores are not emulated")

    def _shared_offsets(self, addr, nbytes, ins, lanes):
        a = addr.astype(np.int64)
        bad = (a < 0) | (a + nbytes > self.shared_size) | (a % nbytes != 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise PtxFault(f"shared access of {nbytes} B at offset {int(a[i])} by "
                           f"{self.lane_name(lanes)(i)} in '{ins.text}' is outside the "
                           f"{self.shared_size} B of shared memory or misaligned")
        return a[:, None] + np.arange(nbytes)

    # arithmetic
    def _read_float(self, op, t: str, lanes) -> np.ndarray:
        """A float source as float32: f32x2 as shape (2, lanes) (low element first), bf16 and
        f16 widened exactly."""
        if t == "f32x2":
            bits = self.read(op, "b64", lanes)
            return np.stack([(bits >> np.uint64(32 * i)).astype(np.uint32).view(np.float32) for i in (0, 1)])
        if t == "bf16":
            return _bf16_bits_to_f32(self.read(op, "b16", lanes))
        if t in ("f16", "f32"):
            return self.read(op, t, lanes).astype(np.float32)
        raise PtxFault(f"float operand of type {t} is not emulated")

    def _write_float(self, op, t: str, lanes, values: np.ndarray) -> None:
        if t == "f32x2":
            lo, hi = (v.astype(np.float32).view(np.uint32).astype(np.uint64) for v in values)
            return self.write(op, "b64", lanes, lo | (hi << np.uint64(32)))
        self.write(op, t, lanes, values)

    def _float_arith(self, ins, lanes, fn) -> None:
        """d = fn(mode, *sources) for f32 and packed f32x2 instructions, and the mixed forms
        (``fma.rn.f32.bf16``: the leading sources are bf16/f16, the last and d are f32)."""
        d, *sources = ins.operands
        types = [p for p in ins.opcode[1:] if p in _TYPE_NAMES]
        dt = types[0]
        if len(types) == 2:
            src_types = [types[1]] * (len(sources) - 1) + [dt]
        else:
            src_types = [dt] * len(sources)
        xs = [self._read_float(o, st, lanes) for o, st in zip(sources, src_types)]
        ftz = "ftz" in ins.opcode
        if ftz:
            xs = [_flush(x) for x in xs]
        r = fn(next((m for m in _ROUNDING if m in ins.opcode), "rn"), *xs)
        if "sat" in ins.opcode:
            r = np.where(np.isnan(r), 0, np.clip(r, 0, 1)).astype(np.float32)
        self._write_float(d, dt, lanes, _flush(r) if ftz else r)

    def _binary(self, ins, lanes, float_fn, int_fn):
        t = self._type(ins)
        if t.startswith("f32") or "f32" in ins.opcode:
            return self._float_arith(ins, lanes, lambda mode, x, y: float_fn(x, y, mode))
        d, a, b = ins.operands
        x, y = self.read(a, t, lanes), self.read(b, t, lanes)
        if t not in _INT_TYPES:
            raise PtxFault(f"'{ins.text}': type {t} is not emulated")
        with np.errstate(over="ignore"):
            self.write(d, t, lanes, int_fn(x, y).astype(_INT_TYPES[t]))

    def op_add(self, ins, lanes):
        self._binary(ins, lanes, lambda x, y, m: _f32_op("add", m, x, y), lambda x, y: x + y)

    def op_sub(self, ins, lanes):
        self._binary(ins, lanes, lambda x, y, m: _f32_op("sub", m, x, y), lambda x, y: x - y)

    def op_min(self, ins, lanes):
        self._binary(ins, lanes, lambda x, y, m: np.fmin(x, y), np.minimum)

    def op_max(self, ins, lanes):
        self._binary(ins, lanes, lambda x, y, m: np.fmax(x, y), np.maximum)

    def op_and(self, ins, lanes):
        self._bitwise(ins, lanes, np.bitwise_and)

    def op_or(self, ins, lanes):
        self._bitwise(ins, lanes, np.bitwise_or)

    def op_not(self, ins, lanes):
        t = self._type(ins)
        d, a = ins.operands
        self.write(d, t, lanes, ~self.read(a, t, lanes))

    def _bitwise(self, ins, lanes, fn):
        t = self._type(ins)
        d, a, b = ins.operands
        self.write(d, t, lanes, fn(self.read(a, t, lanes), self.read(b, t, lanes)))

    def op_mul(self, ins, lanes):
        t = self._type(ins)
        if t.startswith("f32"):
            return self._binary(ins, lanes, lambda x, y, m: _f32_op("mul", m, x, y), None)
        d, a, b = ins.operands
        x, y = self.read(a, t, lanes), self.read(b, t, lanes)
        w = _width(t)
        if "wide" in ins.opcode:
            wide = t[0].replace("b", "u") + str(2 * w)
            self.write(d, wide, lanes, x.astype(_INT_TYPES[wide]) * y.astype(_INT_TYPES[wide]))
        elif "lo" in ins.opcode:
            with np.errstate(over="ignore"):
                self.write(d, t, lanes, (x * y).astype(_INT_TYPES[t]))
        else:
            raise PtxFault(f"'{ins.text}' is not emulated")

    def op_mad(self, ins, lanes):
        t = self._type(ins)
        d, a, b, c = ins.operands
        x, y, z = (self.read(o, t, lanes) for o in (a, b, c))
        if "lo" not in ins.opcode:
            raise PtxFault(f"'{ins.text}' is not emulated")
        with np.errstate(over="ignore"):
            self.write(d, t, lanes, (x * y + z).astype(_INT_TYPES[t]))

    def op_fma(self, ins, lanes):
        if not any(p.startswith("f32") for p in ins.opcode):
            raise PtxFault(f"'{ins.text}' is not emulated")
        self._float_arith(ins, lanes, lambda mode, x, y, z: _f32_op("fma", mode, x, y, z))

    def _unary_f32(self, ins, lanes, fn):
        t = self._type(ins)
        d, a = ins.operands
        x = self.read(a, t, lanes)
        if t != "f32":
            raise PtxFault(f"'{ins.text}' is not emulated")
        if "ftz" in ins.opcode:
            x = _flush(x)
        with np.errstate(all="ignore"):
            r = np.asarray(fn(x), dtype=np.float32)
        self.write(d, t, lanes, _flush(r) if "ftz" in ins.opcode else r)

    def op_div(self, ins, lanes):  # .approx and .full are computed correctly rounded
        if not self._type(ins).startswith("f32"):
            raise PtxFault(f"'{ins.text}' is not emulated")
        self._float_arith(ins, lanes, lambda mode, x, y: _f32_op("div", mode, x, y))

    def op_sqrt(self, ins, lanes):
        mode = "rn" if "approx" in ins.opcode else next(m for m in _ROUNDING if m in ins.opcode)
        self._unary_f32(ins, lanes, lambda x: _f32_op("sqrt", mode, x))

    def op_rcp(self, ins, lanes):
        mode = "rn" if "approx" in ins.opcode else next(m for m in _ROUNDING if m in ins.opcode)
        self._unary_f32(ins, lanes, lambda x: _f32_op("rcp", mode, x))

    def op_ex2(self, ins, lanes):
        self._unary_f32(ins, lanes, lambda x: np.exp2(x.astype(np.float64)))

    def op_neg(self, ins, lanes):
        t = self._type(ins)
        d, a = ins.operands
        x = self.read(a, t, lanes)
        if t == "f32":
            self.write(d, t, lanes, (x.view(np.uint32) ^ np.uint32(0x80000000)).view(np.float32))
        else:
            with np.errstate(over="ignore"):
                self.write(d, t, lanes, -x)

    def op_abs(self, ins, lanes):
        t = self._type(ins)
        d, a = ins.operands
        x = self.read(a, t, lanes)
        if t == "f32":
            self.write(d, t, lanes, (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).view(np.float32))
        else:
            self.write(d, t, lanes, np.abs(x))

    def op_shl(self, ins, lanes):
        t = self._type(ins)
        d, a, b = ins.operands
        x = self.read(a, t, lanes).astype(np.uint64)
        n = self.read(b, "u32", lanes).astype(np.uint64)
        w = _width(t)
        r = np.where(n >= w, 0, (x << np.minimum(n, 63)) & np.uint64((1 << w) - 1 if w < 64 else (1 << 64) - 1))
        self.write(d, t, lanes, _from_bits(r.astype(np.uint64), t))

    def op_shr(self, ins, lanes):
        t = self._type(ins)
        d, a, b = ins.operands
        x = self.read(a, t, lanes)
        n = self.read(b, "u32", lanes).astype(np.int64)
        w = _width(t)
        if t.startswith("s"):
            r = x.astype(np.int64) >> np.minimum(n, 63)
        else:
            r = np.where(n >= w, 0, x.astype(np.uint64) >> np.minimum(n, 63).astype(np.uint64))
        self.write(d, t, lanes, r.astype(_INT_TYPES[t]))

    def op_setp(self, ins, lanes):
        cmp, t = ins.opcode[1], self._type(ins)
        if len(ins.opcode) != 3:
            raise PtxFault(f"'{ins.text}': combined setp forms are not emulated")
        d, a, b = ins.operands
        x, y = self.read(a, t, lanes), self.read(b, t, lanes)
        if t in ("b16", "b32", "b64"):
            x, y = x.astype(_UNSIGNED[_width(t)]), y.astype(_UNSIGNED[_width(t)])
        base = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                "gt": np.greater, "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal,
                "hi": np.greater, "hs": np.greater_equal}
        if cmp in base:
            r = base[cmp](x, y)
            if t in _FLOAT_TYPES and cmp == "ne":
                r &= ~(np.isnan(x) | np.isnan(y))
        elif cmp.endswith("u") and cmp[:-1] in base:
            r = base[cmp[:-1]](x, y) | np.isnan(x) | np.isnan(y)
        elif cmp == "num":
            r = ~(np.isnan(x) | np.isnan(y))
        elif cmp == "nan":
            r = np.isnan(x) | np.isnan(y)
        else:
            raise PtxFault(f"'{ins.text}': comparison {cmp} is not emulated")
        self.write(d, "pred", lanes, r)

    def op_selp(self, ins, lanes):
        t = self._type(ins)
        d, a, b, c = ins.operands
        self.write(d, t, lanes, np.where(self.read(c, "pred", lanes), self.read(a, t, lanes),
                                         self.read(b, t, lanes)))

    def op_cvt(self, ins, lanes):
        types = [p for p in ins.opcode[1:] if p in _TYPE_NAMES]
        if len(types) != 2:
            raise PtxFault(f"'{ins.text}' is not emulated")
        dt, st = types
        operands = ins.operands
        if dt in ("bf16x2", "f16x2"):  # d = {cvt(a) in the high half, cvt(b) in the low half}
            d, a, b = operands
            hi, lo = (self.read(o, "f32", lanes) for o in (a, b))
            if dt == "bf16x2":
                hb, lb = _f32_to_bf16_bits(hi), _f32_to_bf16_bits(lo)
            else:
                hb, lb = hi.astype(np.float16).view(np.uint16), lo.astype(np.float16).view(np.uint16)
            packed = (hb.astype(np.uint64) << np.uint64(16)) | lb.astype(np.uint64)
            return self.write(d, "b32", lanes, packed.astype(np.uint32))
        d, a = operands
        if dt == "bf16" and st == "f32":  # round to nearest even, the only mode emulated
            if ins.opcode[1:] != ("rn", "bf16", "f32"):
                raise PtxFault(f"'{ins.text}' is not emulated")
            return self.write(d, "b16", lanes, _f32_to_bf16_bits(self.read(a, "f32", lanes)))
        if st == "bf16":
            x = _bf16_bits_to_f32(self.read(a, "b16", lanes))
        else:
            x = self.read(a, st, lanes)
        if dt in _FLOAT_TYPES and (st in _FLOAT_TYPES or st == "bf16"):
            r = x.astype(_FLOAT_TYPES[dt])
            if "sat" in ins.opcode:
                r = np.where(np.isnan(r), 0, np.clip(r, 0, 1)).astype(_FLOAT_TYPES[dt])
            if "ftz" in ins.opcode and dt == "f32":
                r = _flush(r)
            return self.write(d, dt, lanes, r)
        if dt not in _INT_TYPES or st not in _INT_TYPES:
            raise PtxFault(f"'{ins.text}' is not emulated")
        # integer -> integer: sign- or zero-extend from the source type, then truncate
        self.write(d, dt, lanes, x.astype(np.int64 if st.startswith("s") else np.uint64).astype(_INT_TYPES[dt]))
