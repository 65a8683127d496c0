"""The tensor memory accelerator (sm_90, sm_100): tensor maps built by the kernel, bulk tensor
copies between global and shared memory, and bulk groups.

Tensor maps are 128-byte objects in the emulator's own encoding (``TensorMap``), built field by
field by ``tensormap.replace`` in shared (or global) memory, copied to global memory by
``tensormap.cp_fenceproxy`` and read back by address when a copy names them: a map read from
the wrong place (another program's slot, memory no kernel wrote) fails its checks.

A tensor load (``cp.async.bulk.tensor ... shared::cta.global.mbarrier::complete_tx``) reads its
box from global memory when issued (out-of-bounds elements zero-filled, never read) and lands
in shared memory, through the swizzle, only when nothing else can run; its destination is in
flight until then, and its bytes then count against the mbarrier's transaction count. A tensor
store reads its shared source when issued, which stays in flight (not to be overwritten) until
``cp.async.bulk.wait_group.read`` retires its bulk group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import mbarrier
from .faults import PtxFault, UnsupportedPtx
from .isa import SHARED_WINDOW
from .layouts import swizzle
from .operands import address_reader, immediate, reader

MAP_BYTES = 128
MAGIC = 0x50414D54  # "TMAP": set by every tensormap.replace
_FIELDS = {  # field -> (byte offset, bytes per entry, entries)
    "global_address": (0, 8, 1),
    "rank": (8, 4, 1),
    "elemtype": (12, 4, 1),
    "swizzle_mode": (16, 4, 1),
    "interleave_layout": (20, 4, 1),
    "fill_mode": (24, 4, 1),
    "magic": (28, 4, 1),
    "box_dim": (32, 4, 5),
    "global_dim": (52, 4, 5),
    "global_stride": (72, 8, 4),
    "element_stride": (104, 4, 5),
    "swizzle_atomicity": (124, 4, 1),
}
ELEMENT_BYTES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 4, 9: 8, 10: 2, 11: 4, 12: 4}
SWIZZLES = {0: 0, 1: 32, 2: 64, 3: 128}


@dataclass(frozen=True)
class TensorMap:
    """A decoded tensor map: rank, element bytes, swizzle width, and per dimension (innermost
    first) the box size, the tensor size, the byte stride (dimension 0: the element) and the
    traversal stride."""

    address: int
    rank: int
    element_bytes: int
    swizzle: int
    box: tuple[int, ...]
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    fill_nan: bool

    @classmethod
    def decode(cls, raw: np.ndarray, where: str, address: int) -> TensorMap:
        def field(name, i=0):
            off, size, _ = _FIELDS[name]
            chunk = raw[off + i * size : off + (i + 1) * size]
            return int(chunk.view(np.uint64 if size == 8 else np.uint32)[0])

        problems = []
        if field("magic") != MAGIC:
            raise PtxFault(
                f"{where}: the tensor map at {address:#x} was not built by "
                f"tensormap.replace (a wrong global-scratch offset, or a map never "
                f"copied there)"
            )
        rank = field("rank") + 1
        etype = field("elemtype")
        if etype not in ELEMENT_BYTES:
            problems.append(f"element type {etype}")
        e = ELEMENT_BYTES.get(etype, 1)
        swz = field("swizzle_mode")
        if swz not in SWIZZLES:
            problems.append(f"swizzle mode {swz}")
        if field("interleave_layout"):
            problems.append("interleaved layouts are not emulated")
        box = tuple(field("box_dim", i) for i in range(rank))
        dims = tuple(field("global_dim", i) for i in range(rank))
        strides = (e,) + tuple(field("global_stride", i) for i in range(rank - 1))
        elem_strides = tuple(field("element_stride", i) for i in range(rank))
        base = field("global_address")
        if not 1 <= rank <= 5:
            problems.append(f"rank {rank}")
        if any(b < 1 or b > 256 for b in box):
            problems.append(f"box {box} (each 1..256)")
        if any(d < 1 for d in dims):
            problems.append(f"tensor size {dims}")
        if any(s % 16 for s in strides[1:]):
            problems.append(f"byte strides {strides[1:]} (multiples of 16)")
        if base % 16:
            problems.append(f"global address {base:#x} (16-byte aligned)")
        if box and (box[0] * e) % 16:
            problems.append(f"inner box of {box[0] * e} B (a multiple of 16)")
        if any(s != 1 for s in elem_strides):
            problems.append(f"element strides {elem_strides} (only 1 is emulated)")
        if SWIZZLES.get(swz) and box[0] * e > SWIZZLES[swz]:
            problems.append(
                f"inner box of {box[0] * e} B wider than its {SWIZZLES[swz]}-byte swizzle"
            )
        if problems:
            raise PtxFault(f"{where}: invalid tensor map at {address:#x}: " + "; ".join(problems))
        return cls(base, rank, e, SWIZZLES[swz], box, dims, strides, field("fill_mode") == 1)

    def box_bytes(self) -> int:
        return int(np.prod(self.box)) * self.element_bytes

    def elements(self, coords) -> tuple[np.ndarray, np.ndarray]:
        """(global byte address of each box element, in bounds) in box order (innermost
        fastest)."""
        grids = np.meshgrid(
            *[np.arange(b) + c for b, c in zip(self.box[::-1], coords[::-1])], indexing="ij"
        )
        idx = [g.ravel() for g in grids[::-1]]  # innermost first
        inside = np.ones(idx[0].shape, dtype=bool)
        offset = np.zeros(idx[0].shape, dtype=np.int64)
        for d, i in enumerate(idx):
            inside &= (i >= 0) & (i < self.dims[d])
            offset += i * self.strides[d]
        return (np.int64(self.address) + offset), inside


def _map_fields(ins):
    field = ins.opcode[3] if ins.opcode[1] == "replace" else None
    return field


def d_tensormap(ins):
    op = ins.opcode[1]
    if op == "replace":
        field = ins.opcode[3]
        if ins.opcode[2] != "tile" or field not in _FIELDS:
            raise UnsupportedPtx(f"{ins.where()} is not emulated")
        space = "shared" if any(p.startswith("shared") for p in ins.opcode) else "global"
        mem, *rest = ins.operands
        address = address_reader(mem)
        ordinal = int(immediate(rest[0].text, "u32")) if len(rest) == 2 else 0
        value = reader(rest[-1], "b64" if _FIELDS[field][1] == 8 else "b32")
        off, size, count = _FIELDS[field]
        if ordinal >= count:
            raise PtxFault(f"{ins.where()}: ordinal {ordinal} of {field} (at most {count - 1})")

        def replace(m, L):
            idx = m.index(L)
            addr = address(m, idx)
            values = np.broadcast_to(np.asarray(value(m, idx)), (len(idx),))
            for lane, a, v in zip(idx.tolist(), addr.tolist(), values.tolist()):
                view = _map_view(m, space, a, np.asarray([lane]))
                chunk = np.asarray([v], dtype=np.uint64 if size == 8 else np.uint32).view(np.uint8)
                start = off + ordinal * size
                view[start : start + size] = chunk
                view[28:32] = np.asarray([MAGIC], dtype=np.uint32).view(np.uint8)

        return replace
    if op == "cp_fenceproxy":
        dst, src, size = ins.operands
        nbytes = int(immediate(size.text, "u32"))
        if nbytes != MAP_BYTES:
            raise PtxFault(f"{ins.where()}: copies {nbytes} bytes, a tensor map is {MAP_BYTES}")
        to_global, from_shared = address_reader(dst), address_reader(src)

        def copy(m, E, L):
            if m.count(E) == 0:
                return
            m.check_converged(E, L)
            idx = m.index(E)
            firsts = m.warp_leaders(idx)
            for lane, g, s in zip(
                firsts.tolist(), to_global(m, firsts).tolist(), from_shared(m, firsts).tolist()
            ):
                if g % 64:
                    raise PtxFault(
                        f"{m.where}: tensor map destination {g:#x} is not 64-byte aligned"
                    )
                source = _map_view(m, "shared", s, np.asarray([lane]))
                m.memory.view(g, MAP_BYTES, m.where)[:] = source

        return copy
    raise UnsupportedPtx(f"{ins.where()} is not emulated")


def _map_view(m, space: str, address: int, lanes) -> np.ndarray:
    if space == "shared":
        a = address - SHARED_WINDOW if address >= SHARED_WINDOW else address
        flat = m.shared_index(np.asarray([a], dtype=np.uint64), MAP_BYTES, lanes, m.where)
        if a % 128:
            raise PtxFault(
                f"{m.where}: a tensor map in shared memory at offset {a} is not "
                f"128-byte aligned"
            )
        return m.shared[int(flat[0]) : int(flat[0]) + MAP_BYTES]
    if address % 64:
        raise PtxFault(f"{m.where}: a tensor map at {address:#x} is not 64-byte aligned")
    return m.memory.view(address, MAP_BYTES, m.where)


def read_map(m, address: int) -> TensorMap:
    if address % 64:
        raise PtxFault(f"{m.where}: a tensor map at {address:#x} is not 64-byte aligned")
    raw = np.array(m.memory.view(address, MAP_BYTES, m.where))
    return TensorMap.decode(raw, m.where, address)


class TensorLoad:
    """A tensor (or bulk) load in flight: its destination bytes and data, and the mbarrier its
    bytes signal."""

    def __init__(self, offs: np.ndarray, data: np.ndarray, barrier: int) -> None:
        self.offs, self.data, self.barrier = offs, data, barrier

    def deliver(self, m) -> None:
        m.mark_busy(self.offs, write=True, delta=-1)
        m.shared[self.offs] = self.data
        if m.race is not None:
            m.race.async_landed(self.offs)
        mbarrier.complete_tx(m, self.barrier, len(self.offs))


class BulkRead:
    """A bulk store's shared source, in flight until its bulk group is waited on."""

    def __init__(self, offs) -> None:
        self.offs = offs

    def subset(self, rows):
        return self


def _bulk_groups(m):
    from .ops_memory import GroupedOps

    groups = m.state.get("bulk")
    if groups is None:
        groups = m.state["bulk"] = GroupedOps(m.n)
    return groups


def d_cp_bulk(ins):
    parts = ins.opcode
    if parts[:4] == ("cp", "async", "bulk", "commit_group"):
        return lambda m, L: _bulk_groups(m).commit(m.index(L))
    if parts[:4] == ("cp", "async", "bulk", "wait_group"):
        keep = int(immediate(ins.operands[0].text, "u32"))

        def wait(m, L):
            for rows, payload in _bulk_groups(m).retire(m.index(L), keep):
                if payload.offs is not None:
                    m.mark_busy(payload.offs, write=False, delta=-1)
                    payload.offs = None

        return wait
    if parts[0] == "cp" and parts[1] == "reduce":
        raise UnsupportedPtx(f"{ins.where()}: bulk reductions are not emulated")
    tensor = "tensor" in parts
    to_shared = (
        any(p.startswith("shared") for p in parts[3:5])
        if not tensor
        else parts[parts.index("tensor") + 2].startswith("shared")
    )
    if tensor and to_shared:
        return _tensor_load(ins)
    if tensor:
        return _tensor_store(ins)
    if to_shared:
        return _bulk_load(ins)
    return _bulk_store(ins)


def _tensor_load(ins):
    if "mbarrier::complete_tx::bytes" not in ins.opcode and not any(
        p.startswith("mbarrier") for p in ins.opcode
    ):
        raise UnsupportedPtx(f"{ins.where()}: a tensor load without an mbarrier")
    if any(p in ("multicast::cluster", "im2col") or p.startswith("cta_group") for p in ins.opcode):
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    dst, src, bar = ins.operands[:3]
    dst_addr, map_addr, bar_addr = address_reader(dst), address_reader(src), address_reader(bar)
    coords = [reader(c, "s32") for c in src.coords]

    def load(m, L):
        idx = m.index(L)
        for i, lane in enumerate(idx.tolist()):
            one = np.asarray([lane])
            tmap = read_map(m, int(map_addr(m, one)[0]))
            if len(coords) != tmap.rank:
                raise PtxFault(f"{m.where}: {len(coords)} coordinates for a rank-{tmap.rank} map")
            c = [int(np.asarray(g(m, one)).ravel()[0]) for g in coords]
            addr, inside = tmap.elements(c)
            e = tmap.element_bytes
            data = np.zeros((len(addr), e), dtype=np.uint8)
            if tmap.fill_nan:
                raise UnsupportedPtx(f"{m.where}: NaN out-of-bounds fill is not emulated")
            if inside.any():
                data[inside] = m.memory.load(
                    addr[inside].astype(np.uint64), e, m.where, lambda j: m.who(one)(0)
                )
            smem = int(dst_addr(m, one)[0])
            smem -= SHARED_WINDOW if smem >= SHARED_WINDOW else 0
            if smem % 128:
                raise PtxFault(
                    f"{m.where}: TMA destination at shared offset {smem} is not "
                    f"128-byte aligned"
                )
            linear = smem + np.arange(len(addr)) * e
            phys = swizzle(linear, tmap.swizzle)
            flat = m.shared_index(
                np.asarray(phys, dtype=np.uint64), e, np.repeat(one, len(phys)), m.where
            )
            offs = (flat[:, None] + np.arange(e)).ravel()
            m.check_async_access(offs[None], one, m.where, write=True)
            if m.race is not None:
                m.race.async_issue(m, offs, one, m.where)
            m.mark_busy(offs, write=True, delta=1)
            barrier = int(mbarrier.flat_addresses(m, bar_addr, one)[0])
            mbarrier.lookup(m, barrier)
            m.async_ops.append(TensorLoad(offs, data.ravel(), barrier))

    return load


def _tensor_store(ins):
    if any(p in ("im2col",) for p in ins.opcode):
        raise UnsupportedPtx(f"{ins.where()} is not emulated")
    dst, src = ins.operands[:2]
    map_addr, src_addr = address_reader(dst), address_reader(src)
    coords = [reader(c, "s32") for c in dst.coords]

    def store(m, L):
        idx = m.index(L)
        for lane in idx.tolist():
            one = np.asarray([lane])
            tmap = read_map(m, int(map_addr(m, one)[0]))
            c = [int(np.asarray(g(m, one)).ravel()[0]) for g in coords]
            addr, inside = tmap.elements(c)
            e = tmap.element_bytes
            smem = int(src_addr(m, one)[0])
            smem -= SHARED_WINDOW if smem >= SHARED_WINDOW else 0
            if smem % 128:
                raise PtxFault(
                    f"{m.where}: TMA source at shared offset {smem} is not " f"128-byte aligned"
                )
            phys = swizzle(smem + np.arange(len(addr)) * e, tmap.swizzle)
            flat = m.shared_index(
                np.asarray(phys, dtype=np.uint64), e, np.repeat(one, len(phys)), m.where
            )
            offs = flat[:, None] + np.arange(e)
            m.check_async_access(offs, np.repeat(one, len(phys)), m.where, write=False)
            data = m.shared[offs]
            if inside.any():
                m.memory.store(
                    addr[inside].astype(np.uint64), data[inside], m.where, lambda j: m.who(one)(0)
                )
            m.mark_busy(offs.ravel(), write=False, delta=1)
            _bulk_groups(m).issue(one, BulkRead(offs.ravel()))

    return store


def _bulk_load(ins):
    dst, src, size, bar = ins.operands[:4]
    dst_addr, src_addr, bar_addr = address_reader(dst), address_reader(src), address_reader(bar)
    get_size = reader(size, "u32")

    def load(m, L):
        for lane in m.index(L).tolist():
            one = np.asarray([lane])
            n = int(np.asarray(get_size(m, one)).ravel()[0])
            if n % 16:
                raise PtxFault(f"{m.where}: bulk copy of {n} bytes (a multiple of 16)")
            data = (
                m.memory.load(src_addr(m, one), n, m.where, m.who(one))[0]
                if n <= 16
                else np.array(m.memory.view(int(src_addr(m, one)[0]), n, m.where))
            )
            smem = int(dst_addr(m, one)[0])
            smem -= SHARED_WINDOW if smem >= SHARED_WINDOW else 0
            flat = m.shared_index(np.asarray([smem], dtype=np.uint64), 16, one, m.where)
            offs = int(flat[0]) + np.arange(n)
            if smem + n > m.shared_size:
                raise PtxFault(f"{m.where}: bulk copy past the end of shared memory")
            m.check_async_access(offs[None], one, m.where, write=True)
            if m.race is not None:
                m.race.async_issue(m, offs, one, m.where)
            m.mark_busy(offs, write=True, delta=1)
            barrier = int(mbarrier.flat_addresses(m, bar_addr, one)[0])
            m.async_ops.append(TensorLoad(offs, data, barrier))

    return load


def _bulk_store(ins):
    dst, src, size = ins.operands[:3]
    dst_addr, src_addr, get_size = address_reader(dst), address_reader(src), reader(size, "u32")

    def store(m, L):
        for lane in m.index(L).tolist():
            one = np.asarray([lane])
            n = int(np.asarray(get_size(m, one)).ravel()[0])
            smem = int(src_addr(m, one)[0])
            smem -= SHARED_WINDOW if smem >= SHARED_WINDOW else 0
            flat = int(m.shared_index(np.asarray([smem], dtype=np.uint64), 16, one, m.where)[0])
            offs = flat + np.arange(n)
            m.check_async_access(offs[None], one, m.where, write=False)
            m.memory.view(int(dst_addr(m, one)[0]), n, m.where)[:] = m.shared[offs]
            m.mark_busy(offs, write=False, delta=1)
            _bulk_groups(m).issue(one, BulkRead(offs))

    return store


DECODERS = {"tensormap": d_tensormap}
COLLECTIVES = {("tensormap", "cp_fenceproxy")}
