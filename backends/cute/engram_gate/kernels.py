"""Engram saved-state gate: the CuTe DSL kernels for sm_90a/sm_100a (fusedops.engram_gate.contract).

Rows are covered by a CTA of a few warps, each thread owning ITERS 16-byte vectors of every row
(``tiles.row_geometry``: the warps that pad the row's vector count least, not a power of two; 4 warps
of 5 vectors at D = 5120 bf16, 6 warps of 8 at D = 12288). Vectors a row does not fill are
clamped loads and predicated stores.

Forward: one CTA per token. The token's shared value stays in registers, all 3*S fp32 partial
sums (x·x, k·k, x·w·k per stream) are formed from loads issued in one unrolled sequence and
reduced across the block with one barrier, then every stream's output is written from x held
in registers when S * ITERS <= MAX_HELD_VECTORS, else from x read again (from L1/L2: the same
CTA read it just before).

Backward: CTAs (stream s, token block) of the same geometry. A stream CTA keeps its weight row
and its grad_weight partial in private shared-memory slots (``private_rows``; registers for rows
too wide for shared memory) across the block's tokens; per token it issues the g, v, x and k
loads together, reduces dgate = sum(g·v) with one barrier, and writes grad_x and grad_k. CTA
s == S writes grad_v = sum_s gate_s·g_s. A third kernel sums the fp32 partial rows in fixed order
into grad_weight (``+=`` when accumulating): no float atomics, bitwise reproducible.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from ..device import block_allreduce_sum
from .tiles import REDUCE_THREADS


def copy_atom(dtype):
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)


def vector_slot(tidx, i, THREADS, NV):
    """(j, valid) for pass i of a thread over a row of NV 16-byte vectors. When NV is not a
    multiple of THREADS, surplus threads read a clamped (valid) vector, contribute nothing to
    reductions and store nothing: every load is unconditional, so no zero-filled phi values."""
    j = tidx + i * THREADS
    if NV % THREADS == 0:
        return j, True
    return cutlass.min(j, NV - 1), j < NV


def masked(valid, value):
    return value if valid is True else Float32(cutlass.select_(valid, value, Float32(0.0)))


def row_sum(ssa):
    return ssa.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)


def gate_scalars(sxx, skk, sxwk, eps, D, SQRT_D, DOT_MIN):
    rx = Float32(1.0) / cute.math.sqrt(sxx / Float32(D) + eps)
    rk = Float32(1.0) / cute.math.sqrt(skk / Float32(D) + eps)
    dot = sxwk * rx * rk / Float32(SQRT_D)
    mag = cute.math.sqrt(cute.arch.fmax(cute.math.absf(dot), Float32(DOT_MIN)))
    r = Float32(cutlass.select_(dot > Float32(0.0), mag,
                                cutlass.select_(dot < Float32(0.0), -mag, Float32(0.0))))
    gate = Float32(1.0) / (Float32(1.0) + cute.math.exp(-r))
    return gate, dot, rx, rk


def forward_grid(N, **_):
    """One CTA per token."""
    return [N, 1, 1]


def backward_grid(S, BLOCKS, **_):
    """(stream or grad_v, token block) CTAs."""
    return [S + 1, BLOCKS, 1]


def row_layout(VEC, S, NV, N, stream_stride, token_stride):
    """(element, stream, vector, token) of a [N, S, D] tensor whose rows start 16-byte aligned:
    the strides come in units of VEC elements (runtime values, assumed multiples of VEC so the
    16-byte copies stay vectorised)."""
    return cute.make_layout((VEC, S, NV, N), stride=(1, cute.assume(stream_stride * VEC, divby=VEC),
                                                     VEC, cute.assume(token_stride * VEC, divby=VEC)))


def kv_layout(VEC, S, NV, N, D, token_stride):
    """(element, key or value, vector, token) of a [N, (S+1)·D] tensor, its token stride in
    units of VEC elements (as ``row_layout``)."""
    return cute.make_layout((VEC, S + 1, NV, N),
                            stride=(1, D, VEC, cute.assume(token_stride * VEC, divby=VEC)))


def reduce_grid(SD, **_):
    """One CTA per REDUCE_THREADS 16-byte vectors of grad_weight."""
    return [(SD // 4 + REDUCE_THREADS - 1) // REDUCE_THREADS, 1, 1]


@cute.kernel
def gate_fwd_kernel(px: cute.Pointer, pkv: cute.Pointer, pw: cute.Pointer,
                    pmask: cute.Pointer, pout: cute.Pointer, psaved: cute.Pointer,
                    N: Int32, eps: Float32, sxn: Int32, sxs: Int32, skvn: Int32, son: Int32,
                    sos: Int32, DTYPE: cutlass.Constexpr, S: cutlass.Constexpr, D: cutlass.Constexpr,
                    VEC: cutlass.Constexpr, THREADS: cutlass.Constexpr,
                    ITERS: cutlass.Constexpr, X_HELD: cutlass.Constexpr,
                    HAS_MASK: cutlass.Constexpr, SQRT_D: cutlass.Constexpr,
                    DOT_MIN: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    token, _, _ = cute.arch.block_idx()
    n = Int64(token)  # a 64-bit token coordinate keeps n * (S+1) * D exact past 2^31
    NV = D // VEC
    NWARPS = THREADS // 32
    gX = cute.make_tensor(px, row_layout(VEC, S, NV, N, sxs, sxn))[None, None, None, n]
    gO = cute.make_tensor(pout, row_layout(VEC, S, NV, N, sos, son))[None, None, None, n]
    gKV = cute.make_tensor(pkv, kv_layout(VEC, S, NV, N, D, skvn))[None, None, None, n]
    gW = cute.make_tensor(pw, cute.make_layout((VEC, S, NV), stride=(1, D, VEC)))
    gSaved = cute.make_tensor(psaved, cute.make_layout((4, S, N), stride=(1, 4, 4 * S)))
    atom, atom_w = copy_atom(DTYPE), copy_atom(Float32)
    scratch = cutlass.memory.SmemAllocator().allocate_tensor(
        Float32, cute.make_layout((3 * S, NWARPS, 1)), byte_alignment=16)

    # v for the whole row; x for every stream when held (else re-read after the reduction)
    rV = cute.make_rmem_tensor((VEC, ITERS), DTYPE)
    rX = cute.make_rmem_tensor((VEC, S if X_HELD else 1, ITERS), DTYPE)
    rK = cute.make_rmem_tensor((VEC,), DTYPE)
    rW = cute.make_rmem_tensor((VEC,), Float32)
    rO = cute.make_rmem_tensor((VEC,), DTYPE)
    sums = cute.make_rmem_tensor((3 * S,), Float32)
    for i in cutlass.range_constexpr(ITERS):
        j, _ = vector_slot(tidx, i, THREADS, NV)
        cute.copy(atom, gKV[None, S, j], rV[None, i])
    for s in cutlass.range_constexpr(S):
        hs = s if X_HELD else 0
        sxx, skk, sxwk = Float32(0.0), Float32(0.0), Float32(0.0)
        for i in cutlass.range_constexpr(ITERS):
            j, valid = vector_slot(tidx, i, THREADS, NV)
            cute.copy(atom, gX[None, s, j], rX[None, hs, i])
            cute.copy(atom, gKV[None, s, j], rK)
            cute.copy(atom_w, gW[None, s, j], rW)
            x = rX[None, hs, i].load().to(Float32)
            k = rK.load().to(Float32)
            sxx += masked(valid, row_sum(x * x))
            skk += masked(valid, row_sum(k * k))
            sxwk += masked(valid, row_sum(x * rW.load() * k))
        sums[3 * s] = sxx
        sums[3 * s + 1] = skk
        sums[3 * s + 2] = sxwk
    block_allreduce_sum(sums, scratch, Int32(0), 3 * S, NWARPS)

    keep = cutlass.Boolean(True)
    if cutlass.const_expr(HAS_MASK):
        keep = cute.make_tensor(pmask, cute.make_layout((N,)))[n] != cutlass.Uint8(0)
    for s in cutlass.range_constexpr(S):
        hs = s if X_HELD else 0
        gate, dot, rx, rk = gate_scalars(sums[3 * s], sums[3 * s + 1], sums[3 * s + 2], eps,
                                         D, SQRT_D, DOT_MIN)
        if tidx == 0:
            gSaved[0, s, n] = Float32(cutlass.select_(keep, gate, Float32(0.0)))
            gSaved[1, s, n] = dot
            gSaved[2, s, n] = rx
            gSaved[3, s, n] = rk
        for i in cutlass.range_constexpr(ITERS):
            j, valid = vector_slot(tidx, i, THREADS, NV)
            if cutlass.const_expr(not X_HELD):
                cute.copy(atom, gX[None, s, j], rX[None, 0, i])
            if keep:
                rO.store((rX[None, hs, i].load().to(Float32)
                          + gate * rV[None, i].load().to(Float32)).to(DTYPE))
            else:  # a masked token's output is x, bit for bit, whatever v holds
                rO.store(rX[None, hs, i].load())
            if valid:
                cute.copy(atom, rO, gO[None, s, j])


@cute.jit
def gate_fwd(px: cute.Pointer, pkv: cute.Pointer, pw: cute.Pointer, pmask: cute.Pointer,
             pout: cute.Pointer, psaved: cute.Pointer, N: Int32, eps: Float32, sxn: Int32,
             sxs: Int32, skvn: Int32, son: Int32, sos: Int32, stream: cuda.CUstream, DTYPE: cutlass.Constexpr, S: cutlass.Constexpr,
             D: cutlass.Constexpr, VEC: cutlass.Constexpr, THREADS: cutlass.Constexpr,
             ITERS: cutlass.Constexpr, X_HELD: cutlass.Constexpr, HAS_MASK: cutlass.Constexpr,
             SQRT_D: cutlass.Constexpr, DOT_MIN: cutlass.Constexpr):
    gate_fwd_kernel(px, pkv, pw, pmask, pout, psaved, N, eps, sxn, sxs, skvn, son, sos, DTYPE, S,
                    D, VEC, THREADS,
                    ITERS, X_HELD, HAS_MASK, SQRT_D, DOT_MIN).launch(
        grid=forward_grid(N=N), block=[THREADS, 1, 1], stream=stream)


def where(cond, value, other):
    """``value`` where the scalar ``cond`` holds, else ``other`` (a tensor or a scalar),
    element by element: a select, so a NaN in the unselected operand goes nowhere."""
    return cute.where(cute.full_like(value, cond, cutlass.Boolean), value, other)


def private_rows(SHARED, VEC, ITERS, THREADS):
    """A stream CTA's weight row and grad_weight partial row: an fp32 slot of VEC elements per
    vector a thread owns. In shared memory (SHARED) slot p belongs to the thread owning vector
    p, padding included, so no thread touches another's slots and none needs a barrier; else in
    registers (rows too wide for shared memory)."""
    if SHARED:
        allocator = cutlass.memory.SmemAllocator()
        layout = cute.make_layout((VEC, ITERS * THREADS), stride=(1, VEC))
        return [allocator.allocate_tensor(Float32, layout, byte_alignment=16) for _ in range(2)]
    return [cute.make_rmem_tensor((VEC, ITERS), Float32) for _ in range(2)]


def slot(row, i, tidx, THREADS, SHARED):
    """The slot of a private row (``private_rows``) for the thread's vector i."""
    return row[None, tidx + i * THREADS] if SHARED else row[None, i]


@cute.jit
def grad_v_rows(gG: cute.Tensor, gGKV: cute.Tensor, gSaved: cute.Tensor, tidx: Int32,
                start: Int32, count: Int32, DTYPE: cutlass.Constexpr, S: cutlass.Constexpr,
                VEC: cutlass.Constexpr, THREADS: cutlass.Constexpr,
                ITERS: cutlass.Constexpr, NV: cutlass.Constexpr):
    """grad_v = sum_s gate_s * g_s of each token, summed in fp32 and rounded once; a masked
    stream (gate 0) adds nothing, even a NaN g. Every g load of a token is issued together."""
    atom = copy_atom(DTYPE)
    rG = cute.make_rmem_tensor((VEC, S, ITERS), DTYPE)
    rGV = cute.make_rmem_tensor((VEC,), DTYPE)
    gates = cute.make_rmem_tensor((S,), Float32)
    for t in cutlass.range(count):
        n = Int64(start + t)  # 64-bit token coordinate, see the forward
        for s in cutlass.range_constexpr(S):
            for i in cutlass.range_constexpr(ITERS):
                j, _ = vector_slot(tidx, i, THREADS, NV)
                cute.copy(atom, gG[None, s, j, n], rG[None, s, i])
        for s in cutlass.range_constexpr(S):
            gates[s] = gSaved[0, s, n]
        for i in cutlass.range_constexpr(ITERS):
            j, valid = vector_slot(tidx, i, THREADS, NV)
            acc = cute.full((VEC,), 0.0, Float32)
            for s in cutlass.range_constexpr(S):
                acc = acc + where(gates[s] != Float32(0.0),
                                  gates[s] * rG[None, s, i].load().to(Float32), Float32(0.0))
            rGV.store(acc.to(DTYPE))
            if valid:
                cute.copy(atom, rGV, gGKV[None, S, j, n])


@cute.jit
def stream_rows(gX: cute.Tensor, gG: cute.Tensor, gGX: cute.Tensor, gKV: cute.Tensor,
                gGKV: cute.Tensor, gW: cute.Tensor, gSaved: cute.Tensor, gPartial: cute.Tensor,
                s: Int32, block: Int32, tidx: Int32, start: Int32, count: Int32,
                DTYPE: cutlass.Constexpr, S: cutlass.Constexpr, D: cutlass.Constexpr,
                VEC: cutlass.Constexpr, THREADS: cutlass.Constexpr, ITERS: cutlass.Constexpr,
                NV: cutlass.Constexpr, SHARED: cutlass.Constexpr, SQRT_D: cutlass.Constexpr,
                DOT_MIN: cutlass.Constexpr):
    """grad_x and grad_k of stream s for the block's tokens, and the block's grad_weight
    partial row. The weight row and the partial row are private rows (``private_rows``); per
    token the g, v, x and k loads are issued together and dgate = sum(g·v) is reduced with one
    barrier."""
    atom, atom_w = copy_atom(DTYPE), copy_atom(Float32)
    NWARPS = THREADS // 32
    scratch = cutlass.memory.SmemAllocator().allocate_tensor(
        Float32, cute.make_layout((1, NWARPS, 2)), byte_alignment=16)
    weight, partial_row = private_rows(SHARED, VEC, ITERS, THREADS)
    rW = cute.make_rmem_tensor((VEC,), Float32)
    for i in cutlass.range_constexpr(ITERS):
        j, _ = vector_slot(tidx, i, THREADS, NV)
        cute.copy(atom_w, gW[None, s, j], rW)
        slot(weight, i, tidx, THREADS, SHARED).store(rW.load())
        slot(partial_row, i, tidx, THREADS, SHARED).store(cute.full((VEC,), 0.0, Float32))
    rG = cute.make_rmem_tensor((VEC, ITERS), DTYPE)
    rV = cute.make_rmem_tensor((VEC, ITERS), DTYPE)
    rX = cute.make_rmem_tensor((VEC, ITERS), DTYPE)
    rK = cute.make_rmem_tensor((VEC, ITERS), DTYPE)
    rGX = cute.make_rmem_tensor((VEC,), DTYPE)
    rGK = cute.make_rmem_tensor((VEC,), DTYPE)
    dgate = cute.make_rmem_tensor((1,), Float32)
    for t in cutlass.range(count):
        n = Int64(start + t)  # 64-bit token coordinate, see the forward
        for i in cutlass.range_constexpr(ITERS):
            j, _ = vector_slot(tidx, i, THREADS, NV)
            cute.copy(atom, gG[None, s, j, n], rG[None, i])
            cute.copy(atom, gKV[None, S, j, n], rV[None, i])
            cute.copy(atom, gX[None, s, j, n], rX[None, i])
            cute.copy(atom, gKV[None, s, j, n], rK[None, i])
        partial = Float32(0.0)
        for i in cutlass.range_constexpr(ITERS):
            _, valid = vector_slot(tidx, i, THREADS, NV)
            partial += masked(valid, row_sum(rG[None, i].load().to(Float32)
                                             * rV[None, i].load().to(Float32)))
        dgate[0] = partial
        block_allreduce_sum(dgate, scratch, t % 2, 1, NWARPS)
        token, coef, c_x, c_k = token_coefs(gSaved, s, n, dgate[0], D, SQRT_D, DOT_MIN)
        if token:
            for i in cutlass.range_constexpr(ITERS):
                j, valid = vector_slot(tidx, i, THREADS, NV)
                acc = slot(partial_row, i, tidx, THREADS, SHARED)
                w = slot(weight, i, tidx, THREADS, SHARED).load()
                x = rX[None, i].load().to(Float32)
                k = rK[None, i].load().to(Float32)
                # g is read again (from L1): kept from before the barrier, it stays converted
                # to fp32 for the dgate sum, twice the registers
                cute.copy(atom, gG[None, s, j, n], rG[None, i])
                rGX.store((rG[None, i].load().to(Float32) + coef * w * k - c_x * x).to(DTYPE))
                rGK.store((coef * w * x - c_k * k).to(DTYPE))
                acc.store(acc.load() + coef * x * k)
                if valid:
                    cute.copy(atom, rGX, gGX[None, s, j, n])
                    cute.copy(atom, rGK, gGKV[None, s, j, n])
        else:  # a masked token is isolated: grad_x = g, grad_k = 0, nothing to grad_weight
            rGK.fill(0.0)
            for i in cutlass.range_constexpr(ITERS):
                j, valid = vector_slot(tidx, i, THREADS, NV)
                if valid:
                    cute.copy(atom, rG[None, i], gGX[None, s, j, n])
                    cute.copy(atom, rGK, gGKV[None, s, j, n])
    for i in cutlass.range_constexpr(ITERS):
        j, valid = vector_slot(tidx, i, THREADS, NV)
        if valid:
            rW.store(slot(partial_row, i, tidx, THREADS, SHARED).load())
            cute.copy(atom_w, rW, gPartial[None, s, j, block])


def token_coefs(gSaved, s, n, dgate, D, SQRT_D, DOT_MIN):
    """(token, coef, c_x, c_k) of stream s of token n from its saved statistics and dgate;
    token is false for a masked token (gate 0), whose statistics callers select away."""
    gate = gSaved[0, s, n]
    dot = gSaved[1, s, n]
    rx = gSaved[2, s, n]
    rk = gSaved[3, s, n]
    mag = cute.math.absf(dot)
    slope = Float32(0.5) / cute.math.sqrt(cute.arch.fmax(mag, Float32(DOT_MIN)))
    live = (mag >= Float32(DOT_MIN)) & (gate != Float32(0.0))
    ddot = Float32(cutlass.select_(live, dgate * gate * (Float32(1.0) - gate) * slope,
                                  Float32(0.0)))
    return (gate != Float32(0.0), ddot * rx * rk / Float32(SQRT_D),
            ddot * dot * rx * rx / Float32(D), ddot * dot * rk * rk / Float32(D))


@cute.kernel
def gate_bwd_kernel(px: cute.Pointer, pkv: cute.Pointer, pw: cute.Pointer,
                    psaved: cute.Pointer, pg: cute.Pointer, pgx: cute.Pointer,
                    pgkv: cute.Pointer, ppartial: cute.Pointer, N: Int32,
                    TOKENS_PER_BLOCK: Int32, sxn: Int32, sxs: Int32, skvn: Int32, sgn: Int32,
                    sgs: Int32, sgxn: Int32, sgxs: Int32, sgkvn: Int32,
                    DTYPE: cutlass.Constexpr, S: cutlass.Constexpr, D: cutlass.Constexpr,
                    VEC: cutlass.Constexpr, THREADS: cutlass.Constexpr,
                    ITERS: cutlass.Constexpr, SHARED: cutlass.Constexpr,
                    SQRT_D: cutlass.Constexpr, DOT_MIN: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    stream_id, block, _ = cute.arch.block_idx()
    NV = D // VEC
    gG = cute.make_tensor(pg, row_layout(VEC, S, NV, N, sgs, sgn))
    gGKV = cute.make_tensor(pgkv, kv_layout(VEC, S, NV, N, D, sgkvn))
    gSaved = cute.make_tensor(psaved, cute.make_layout((4, S, N), stride=(1, 4, 4 * S)))
    start = block * TOKENS_PER_BLOCK
    count = cutlass.min(start + TOKENS_PER_BLOCK, N) - start
    if stream_id == S:
        grad_v_rows(gG, gGKV, gSaved, tidx, start, count, DTYPE, S, VEC, THREADS, ITERS, NV)
    else:
        gX = cute.make_tensor(px, row_layout(VEC, S, NV, N, sxs, sxn))
        gGX = cute.make_tensor(pgx, row_layout(VEC, S, NV, N, sgxs, sgxn))
        gKV = cute.make_tensor(pkv, kv_layout(VEC, S, NV, N, D, skvn))
        gW = cute.make_tensor(pw, cute.make_layout((VEC, S, NV), stride=(1, D, VEC)))
        gPartial = cute.make_tensor(ppartial, cute.make_layout(
            (VEC, S, NV, 1 + block), stride=(1, D, VEC, S * D)))
        stream_rows(gX, gG, gGX, gKV, gGKV, gW, gSaved, gPartial, stream_id, block, tidx, start,
                    count, DTYPE, S, D, VEC, THREADS, ITERS, NV, SHARED, SQRT_D, DOT_MIN)


@cute.jit
def gate_bwd(px: cute.Pointer, pkv: cute.Pointer, pw: cute.Pointer, psaved: cute.Pointer,
             pg: cute.Pointer, pgx: cute.Pointer, pgkv: cute.Pointer, ppartial: cute.Pointer,
             N: Int32, TOKENS_PER_BLOCK: Int32, BLOCKS: Int32, sxn: Int32, sxs: Int32,
             skvn: Int32, sgn: Int32, sgs: Int32, sgxn: Int32, sgxs: Int32, sgkvn: Int32,
             stream: cuda.CUstream,
             DTYPE: cutlass.Constexpr, S: cutlass.Constexpr, D: cutlass.Constexpr,
             VEC: cutlass.Constexpr, THREADS: cutlass.Constexpr, ITERS: cutlass.Constexpr,
             SHARED: cutlass.Constexpr, SQRT_D: cutlass.Constexpr, DOT_MIN: cutlass.Constexpr):
    gate_bwd_kernel(px, pkv, pw, psaved, pg, pgx, pgkv, ppartial, N, TOKENS_PER_BLOCK, sxn, sxs,
                    skvn, sgn, sgs, sgxn, sgxs, sgkvn, DTYPE, S, D, VEC, THREADS, ITERS, SHARED,
                    SQRT_D, DOT_MIN).launch(
        grid=backward_grid(S=S, BLOCKS=BLOCKS), block=[THREADS, 1, 1], stream=stream)


@cute.kernel
def grad_weight_reduce_kernel(ppartial: cute.Pointer, pgw: cute.Pointer, NUM_PARTIALS: Int32,
                              SD: cutlass.Constexpr, ACCUMULATE: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    NV = SD // 4
    j = bidx * REDUCE_THREADS + tidx
    gP = cute.make_tensor(ppartial, cute.make_layout((4, NV, NUM_PARTIALS), stride=(1, 4, SD)))
    gW = cute.make_tensor(pgw, cute.make_layout((4, NV), stride=(1, 4)))
    atom = copy_atom(Float32)
    rP = cute.make_rmem_tensor((4,), Float32)
    acc = cute.make_rmem_tensor((4,), Float32)
    if j < NV:
        acc.fill(0.0)
        for p in cutlass.range(NUM_PARTIALS):   # fixed order: bitwise reproducible
            cute.copy(atom, gP[None, j, p], rP)
            acc.store(acc.load() + rP.load())
        if cutlass.const_expr(ACCUMULATE):
            cute.copy(atom, gW[None, j], rP)
            acc.store(acc.load() + rP.load())
        cute.copy(atom, acc, gW[None, j])


@cute.jit
def grad_weight_reduce(ppartial: cute.Pointer, pgw: cute.Pointer, NUM_PARTIALS: Int32,
                       stream: cuda.CUstream, SD: cutlass.Constexpr, ACCUMULATE: cutlass.Constexpr):
    grad_weight_reduce_kernel(ppartial, pgw, NUM_PARTIALS, SD, ACCUMULATE).launch(
        grid=reduce_grid(SD=SD), block=[REDUCE_THREADS, 1, 1], stream=stream)
