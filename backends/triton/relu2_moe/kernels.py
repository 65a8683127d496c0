"""Triton kernels of the routed ReLU2 experts: device-side dispatch, one grouped GEMM with four
epilogues, the per-expert weight-gradient GEMM, and the fixed-order sums.

Dispatch (no host synchronisation; buffers sized for the plan's t):
  count    per block of BLOCK_A assignments, tokens per expert        part [NB, E_PAD]
  scan     per expert, exclusive prefix of part over the blocks; counts [E]
  offsets  padded to the row tile: offsets [E + 1] (offsets[E] = rows in use)
  scatter  sorted[offsets[e] + rank] = assignment index t·k + j, ranks in assignment order
Rows [offsets[e] + counts[e], offsets[e + 1]) are padding; every kernel masks them, so they are
never initialised. Dropped assignments (id outside [0, E)) get no row, so no GEMM reads or
writes anything for them; count (forward) and the routing-weight gradient's sum (backward) OR
Status.EXPERT_ID into the optional status word for the ids outside [0, E) other than -1. Every
index the later kernels use comes from the dispatch (rows < offsets[E] <= the sized bound,
assignments < t·k), never from topk_ids directly; the combines read topk_ids only to skip the
dropped assignments' rows, which nothing wrote.

Grouped GEMM: program (row tile, column tile); the row tile's expert is found by binary search in
offsets; tiles past offsets[E] exit at once (experts without tokens cost nothing). Row r of
expert e holds assignment a = sorted[r] of token a // k. The operand A is read by token (x,
d_out: gathered), by assignment (u, turned into a = relu(u)² in registers on its way to the
MMA: no a buffer) or by row (d_u); B is W[e] through strides, so one kernel serves
    forward up      x[token]      · W_up[e]ᵀ     epilogue UP:        u[a] (and relu(u[a])²)
    forward down    relu(u[a])²   · W_down[e]ᵀ   epilogue SCATTER:   w_a · y -> rows[a]
    backward down   d_out[token]  · W_down[e]    epilogue DGRAD_ACT: d_u[r] and <g, a> partials
    backward up     d_u[r]        · W_up[e]      epilogue SCATTER:   rows[a]
with every result rounded to x's dtype; and, with ROUTED = False (one expert, row = token =
assignment), the shared expert, whose down and backward-up GEMMs end in epilogue COMBINE:
out[t] = the sum over j (in order) of rows[t·k + j] of the kept assignments plus its own fp32
product, rounded once, written through out's (or d_x's) row stride. Without a shared expert the
combine kernel does that sum.

Weight gradients: grad[e] (+)= the sum over e's rows of A[r]ᵀ ⊗ B[token_r] with A on the
intermediate side (d_u by row; or a = relu(u)² times the routing weight, rounded, by
assignment: its transform happens on the register operand, so the wgmma stays asynchronous) and
B = x or d_out gathered by token; d_W_down [H, I] is stored transposed. An expert holding more
rows than the split-K chunk is summed chunk by chunk (moe_wgrad_split_kernel's work table: the
chunks past its first into fp32 slots, then added to the first in chunk order), so no program
walks more than a chunk of rows and the sums keep one fixed order. The shared expert's two weight
gradients (one expert, every token a row) can share one launch, the first's tiles then the
second's (moe_dense_wgrad_pair_kernel), so the second fills the first's last wave.

Strided activations: x, d_out (read by token), out and d_x (the combines' stores) are addressed
through a row stride taken at launch in units of VEC elements (a 16-byte vector; 1 where a row
is not a whole number of vectors and the plan takes them contiguous), so every row starts
16-byte aligned for the compiler and the loads stay vectorised. The buffers the kernels pass to
each other (u, d_u, the per-assignment rows) are the plan's own, contiguous, with constexpr
widths.

Operands a launch does not have are constexpr None (the dispatch of a dense GEMM, the routing
weights of an unweighted one, the <g, a> partials outside the routed dgrad, the rows and ids
outside a combining epilogue): each kernel touches a pointer only under the flag that says it is
present (ROUTED, WEIGHTED / A_WEIGHTED, EPILOGUE).
"""

import triton
import triton.language as tl

from fusedops.core.status import Status

from ..primitives import last_at_most, mm, report
from ..rounding import round_to

EPI_UP = tl.constexpr(0)
EPI_SCATTER = tl.constexpr(1)
EPI_DGRAD_ACT = tl.constexpr(2)
EPI_COMBINE = tl.constexpr(3)
BY_ROW = tl.constexpr(0)
BY_TOKEN = tl.constexpr(1)
BY_ASSIGNMENT = tl.constexpr(2)
EXPERT_ID = tl.constexpr(int(Status.EXPERT_ID))


# -- dispatch ------------------------------------------------------------------------------------
@triton.jit
def _invalid_id(ex, E: tl.constexpr):
    """An id outside [0, E) other than -1 (padding): what Status.EXPERT_ID reports."""
    return ((ex < 0) | (ex >= E)) & (ex != -1)


@triton.jit
def _block_experts(ids_ptr, A, E: tl.constexpr, BLOCK_A: tl.constexpr):
    """(assignments, their expert ids with every dropped one -1, the raw ids)."""
    a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    raw = tl.load(ids_ptr + a, mask=a < A, other=-1)
    return a, tl.where((raw >= 0) & (raw < E), raw, -1), raw


@triton.jit
def moe_count_kernel(ids_ptr, part_ptr, status_ptr, A, E: tl.constexpr, E_PAD: tl.constexpr,
                     EC: tl.constexpr, BLOCK_A: tl.constexpr, HAS_STATUS: tl.constexpr):
    _, ex, raw = _block_experts(ids_ptr, A, E, BLOCK_A)
    report(status_ptr, _invalid_id(raw, E), EXPERT_ID, HAS_STATUS)
    for c in range(0, E_PAD, EC):
        cols = c + tl.arange(0, EC)
        hits = (ex[:, None] == cols[None, :]).to(tl.int32)
        tl.store(part_ptr + tl.program_id(0) * E_PAD + cols, tl.sum(hits, axis=0))


@triton.jit
def moe_scan_kernel(part_ptr, counts_ptr, NB, E: tl.constexpr, E_PAD: tl.constexpr,
                    EC: tl.constexpr, BB: tl.constexpr):
    cols = tl.program_id(0) * EC + tl.arange(0, EC)
    carry = tl.zeros([EC], dtype=tl.int32)
    for b0 in range(0, NB, BB):
        b = b0 + tl.arange(0, BB)
        ptrs = part_ptr + b[:, None] * E_PAD + cols[None, :]
        ok = (b < NB)[:, None]
        tile = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(tile, axis=0) - tile + carry[None, :], mask=ok)
        carry += tl.sum(tile, axis=0)
    tl.store(counts_ptr + cols, carry, mask=cols < E)


@triton.jit
def moe_offsets_kernel(counts_ptr, offsets_ptr, E: tl.constexpr, EP: tl.constexpr,
                       TILE: tl.constexpr):
    e = tl.arange(0, EP)
    padded = (tl.load(counts_ptr + e, mask=e < E, other=0) + TILE - 1) // TILE * TILE
    ends = tl.cumsum(padded, axis=0)
    tl.store(offsets_ptr + e, ends - padded, mask=e < E)
    tl.store(offsets_ptr + 1 + e, ends, mask=e == E - 1)


@triton.jit
def moe_scatter_kernel(ids_ptr, part_ptr, offsets_ptr, sorted_ptr, A, E: tl.constexpr,
                       E_PAD: tl.constexpr, EC: tl.constexpr, BLOCK_A: tl.constexpr):
    a, ex, _ = _block_experts(ids_ptr, A, E, BLOCK_A)
    row = tl.zeros([BLOCK_A], dtype=tl.int32)
    for c in range(0, E_PAD, EC):
        cols = c + tl.arange(0, EC)
        hits = (ex[:, None] == cols[None, :]).to(tl.int32)
        rank = tl.cumsum(hits, axis=0) - hits
        base = (tl.load(part_ptr + tl.program_id(0) * E_PAD + cols)
                + tl.load(offsets_ptr + cols, mask=cols < E, other=0))
        row += tl.sum(hits * (rank + base[None, :]), axis=1)
    tl.store(sorted_ptr + row, a, mask=(a < A) & (ex >= 0))


# -- grouped GEMM --------------------------------------------------------------------------------
@triton.jit
def expert_rows(row0, offsets_ptr, counts_ptr, sorted_ptr, T, K_TOP: tl.constexpr,
                E: tl.constexpr, BM: tl.constexpr, ROUTED: tl.constexpr, STEPS: tl.constexpr):
    """(expert, rows [BM], valid [BM], assignment [BM], token [BM], any row in use)."""
    r = row0 + tl.arange(0, BM)
    if ROUTED:
        used = row0 < tl.load(offsets_ptr + E)
        e = last_at_most(offsets_ptr, row0, E, STEPS)     # the expert holding row0
        valid = r < tl.load(offsets_ptr + e) + tl.load(counts_ptr + e)
        assign = tl.load(sorted_ptr + r, mask=valid, other=0)
        token = assign // K_TOP
    else:
        used = row0 < T
        e = row0 * 0
        valid = r < T
        assign = r
        token = r
    return e, r, valid, assign, token, used


@triton.jit
def _operand_rows(source: tl.constexpr, r, token, assign, width: tl.constexpr, stride,
                  VEC: tl.constexpr):
    """Element offsets of the rows an operand reads: by token (x, d_out: a view, ``stride``
    vectors a row), by assignment (u) or by dispatch row (d_u), ``width`` a row."""
    if source == BY_TOKEN:
        return token.to(tl.int64) * (stride * VEC)
    elif source == BY_ASSIGNMENT:
        return assign.to(tl.int64) * width
    else:
        return r.to(tl.int64) * width


@triton.jit
def relu2(u, DTYPE: tl.constexpr, EXACT: tl.constexpr):
    """a = relu(u)² of a tile of u, in fp32 and rounded to DTYPE (the contract's a)."""
    v = tl.maximum(u.to(tl.float32), 0.0)
    return round_to(v * v, DTYPE, EXACT)


@triton.jit
def moe_gemm_kernel(a_ptr, b_ptr, sorted_ptr, offsets_ptr, counts_ptr, weight_ptr, u_ptr,
                    out_ptr, act_ptr, part_ptr, rows_ptr, ids_ptr, T, M_TILES, stride_a,
                    stride_out,
                    K_TOP: tl.constexpr, E: tl.constexpr, KDIM: tl.constexpr, NDIM: tl.constexpr,
                    STRIDE_BE: tl.constexpr, STRIDE_BK: tl.constexpr, STRIDE_BN: tl.constexpr,
                    ROUTED: tl.constexpr, A_SOURCE: tl.constexpr, A_RELU2: tl.constexpr,
                    EPILOGUE: tl.constexpr, WEIGHTED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    STEPS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                    EXACT: tl.constexpr, VEC: tl.constexpr, SWAP: tl.constexpr,
                    QUARTERS: tl.constexpr):
    """One (row tile, column tile) of a grouped or dense GEMM (the module docstring). SWAP (row
    tiles below wgmma's and tcgen05's 64 rows: decode-sized batches): the product is computed
    transposed, Cᵀ [BN, BM] += W[e]ᵀ·Aᵀ with the column tile as M, and turned back in registers
    before the epilogue. act_ptr (EPI_UP; None elsewhere): a = relu(u)² by assignment written
    beside u, for a down GEMM that cannot form it on its register operand (SWAP puts A on the
    shared-memory side). QUARTERS: the DGRAD_ACT and COMBINE epilogues, which read a second
    tile (u, or the k rows), run on a quarter of the columns at a time (``_column_quarters``)."""
    # grouped ordering: GROUP_M row tiles run through every column tile before the next group,
    # so a group's rows and its experts' weight columns stay in L2
    pid = tl.program_id(0)
    n_tiles: tl.constexpr = (NDIM + BN - 1) // BN
    per_group = GROUP_M * n_tiles
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(M_TILES - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    e, r, valid, assign, token, used = expert_rows(pid_m * BM, offsets_ptr, counts_ptr,
                                                   sorted_ptr, T, K_TOP, E, BM, ROUTED, STEPS)
    if used:
        dtype = a_ptr.dtype.element_ty
        kk = tl.arange(0, BK)
        n = pid_n * BN + tl.arange(0, BN)
        a_ptrs = a_ptr + _operand_rows(A_SOURCE, r, token, assign, KDIM, stride_a, VEC)[:, None] \
            + kk[None, :]
        b_ptrs = (b_ptr + e.to(tl.int64) * STRIDE_BE + kk[:, None] * STRIDE_BK
                  + n[None, :] * STRIDE_BN)
        if SWAP:
            acc_t = tl.zeros([BN, BM], dtype=tl.float32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, KDIM, BK):
            a = tl.load(a_ptrs, mask=valid[:, None] & (k0 + kk < KDIM)[None, :], other=0.0)
            if A_RELU2:                     # a = relu(u)² in registers: the MMA's A operand
                a = relu2(a, dtype, EXACT)
            b = tl.load(b_ptrs, mask=(k0 + kk < KDIM)[:, None] & (n < NDIM)[None, :], other=0.0)
            if SWAP:
                acc_t = mm(tl.trans(b), tl.trans(a), acc_t, UPCAST, IEEE)  # [BN, BK] @ [BK, BM]
            else:
                acc = mm(a, b, acc, UPCAST, IEEE)                            # [BM, BK] @ [BK, BN]
            a_ptrs += BK
            b_ptrs += BK * STRIDE_BK
        if SWAP:
            acc = tl.trans(acc_t)
        ok = valid[:, None] & (n < NDIM)[None, :]
        by_assignment = assign[:, None].to(tl.int64) * NDIM + n[None, :]
        if EPILOGUE == EPI_UP:
            u_tile = round_to(acc, dtype, EXACT)
            tl.store(out_ptr + by_assignment, u_tile, mask=ok)
            if act_ptr is not None:
                tl.store(act_ptr + by_assignment, relu2(u_tile, dtype, EXACT), mask=ok)
        elif EPILOGUE == EPI_SCATTER:
            if WEIGHTED:
                acc = acc * tl.load(weight_ptr + assign, mask=valid, other=0.0)[:, None]
            tl.store(out_ptr + by_assignment, round_to(acc, dtype, EXACT), mask=ok)
        elif EPILOGUE == EPI_DGRAD_ACT:
            w = tl.load(weight_ptr + assign, mask=valid, other=0.0) if WEIGHTED else None
            if QUARTERS:
                q0, q1, q2, q3 = _column_quarters(acc, BM, BN)
                Q: tl.constexpr = BN // 4
                partial = _dgrad_act(q0, pid_n * BN + tl.arange(0, Q), r, assign, valid,
                                     w, u_ptr, out_ptr, NDIM, WEIGHTED, EXACT)
                partial += _dgrad_act(q1, pid_n * BN + Q + tl.arange(0, Q), r,
                                      assign, valid, w, u_ptr, out_ptr, NDIM, WEIGHTED, EXACT)
                partial += _dgrad_act(q2, pid_n * BN + 2 * Q + tl.arange(0, Q), r,
                                      assign, valid, w, u_ptr, out_ptr, NDIM, WEIGHTED, EXACT)
                partial += _dgrad_act(q3, pid_n * BN + 3 * Q + tl.arange(0, Q), r,
                                      assign, valid, w, u_ptr, out_ptr, NDIM, WEIGHTED, EXACT)
            else:
                partial = _dgrad_act(acc, n, r, assign, valid, w, u_ptr, out_ptr, NDIM, WEIGHTED,
                                     EXACT)
            if WEIGHTED:
                tl.store(part_ptr + pid_n * (T * K_TOP) + assign, partial, mask=valid)
        else:       # EPI_COMBINE (the dense shared expert: row = token)
            if QUARTERS:
                q0, q1, q2, q3 = _column_quarters(acc, BM, BN)
                Q: tl.constexpr = BN // 4
                _combine(q0, pid_n * BN + tl.arange(0, Q), token, valid, rows_ptr, ids_ptr,
                         out_ptr, stride_out, NDIM, K_TOP, E, VEC, EXACT)
                _combine(q1, pid_n * BN + Q + tl.arange(0, Q), token, valid, rows_ptr, ids_ptr,
                         out_ptr, stride_out, NDIM, K_TOP, E, VEC, EXACT)
                _combine(q2, pid_n * BN + 2 * Q + tl.arange(0, Q), token, valid, rows_ptr,
                         ids_ptr, out_ptr, stride_out, NDIM, K_TOP, E, VEC, EXACT)
                _combine(q3, pid_n * BN + 3 * Q + tl.arange(0, Q), token, valid, rows_ptr,
                         ids_ptr, out_ptr, stride_out, NDIM, K_TOP, E, VEC, EXACT)
            else:
                _combine(acc, n, token, valid, rows_ptr, ids_ptr, out_ptr, stride_out, NDIM,
                         K_TOP, E, VEC, EXACT)


@triton.jit
def _column_halves(acc, BM: tl.constexpr, BN: tl.constexpr):
    """The left and right [BM, BN / 2] halves of a [BM, BN] tile."""
    return tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), [0, 2, 1]))


@triton.jit
def _column_quarters(acc, BM: tl.constexpr, BN: tl.constexpr):
    """The four [BM, BN / 4] column quarters of a [BM, BN] tile, left to right: an epilogue
    that reads a second tile (u, the k rows, the gradient it adds to) runs on one quarter at a
    time, so only a quarter of that tile is live beside the accumulator."""
    left, right = _column_halves(acc, BM, BN)
    q0, q1 = _column_halves(left, BM, BN // 2)
    q2, q3 = _column_halves(right, BM, BN // 2)
    return q0, q1, q2, q3


@triton.jit
def _dgrad_act(acc, n, r, assign, valid, w, u_ptr, out_ptr, NDIM: tl.constexpr,
               WEIGHTED: tl.constexpr, EXACT: tl.constexpr):
    """EPI_DGRAD_ACT on columns n of the tile: d_u = w·g·2·relu(u) by row (w: the routing
    weights, WEIGHTED); returns the <g, a> partial of those columns (0 without weights)."""
    ok = valid[:, None] & (n < NDIM)[None, :]
    relu_u = tl.maximum(tl.load(u_ptr + assign[:, None].to(tl.int64) * NDIM + n[None, :],
                                mask=ok, other=0.0).to(tl.float32), 0.0)
    dtype = out_ptr.dtype.element_ty
    partial = tl.zeros_like(valid.to(tl.float32))
    if WEIGHTED:
        act = round_to(relu_u * relu_u, dtype, EXACT).to(tl.float32)
        # each product rounded once (fma with 0 is never contracted into the sum): the row sum
        # is then bitwise the same in every thread that holds it, so the copies that warps
        # exchange through shared memory agree and the result does not depend on their timing
        partial = tl.sum(tl.fma(acc, act, 0.0), axis=1)
        acc = acc * w[:, None]
    tl.store(out_ptr + r[:, None].to(tl.int64) * NDIM + n[None, :],
             round_to(acc * 2.0 * relu_u, dtype, EXACT), mask=ok)
    return partial


@triton.jit
def _combine(acc, n, token, valid, rows_ptr, ids_ptr, out_ptr, stride_out, NDIM: tl.constexpr,
             K_TOP: tl.constexpr, E: tl.constexpr, VEC: tl.constexpr, EXACT: tl.constexpr):
    """EPI_COMBINE on columns n of the tile: the shared expert's product, then the rows j =
    0..k-1 of each token's kept assignments in that order, rounded once into out (d_x)."""
    for j in range(K_TOP):
        a_j = token.to(tl.int64) * K_TOP + j
        ex = tl.load(ids_ptr + a_j, mask=valid, other=-1)
        kept = valid & (ex >= 0) & (ex < E)
        acc += tl.load(rows_ptr + a_j[:, None] * NDIM + n[None, :],
                       mask=kept[:, None] & (n < NDIM)[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + token[:, None].to(tl.int64) * (stride_out * VEC) + n[None, :],
             round_to(acc, out_ptr.dtype.element_ty, EXACT),
             mask=valid[:, None] & (n < NDIM)[None, :])


# -- weight gradients ----------------------------------------------------------------------------
@triton.jit
def _holding(j, cum, o_e, E: tl.constexpr):
    """For each item j [W], the expert whose items hold it, of a per-expert count with inclusive
    prefix sums ``cum`` [EP]: the first e with cum[e] > j (E past the total)."""
    return tl.sum(((cum[None, :] <= j[:, None]) & (o_e < E)[None, :]).to(tl.int32), axis=1)


@triton.jit
def _entries(v, o_e, e):
    """v[e] for each expert e [W] of a vector over experts v [EP] (0 outside it)."""
    return tl.sum(tl.where(o_e[None, :] == e[:, None], v[None, :], 0), axis=1)


@triton.jit
def moe_wgrad_split_kernel(counts_ptr, offsets_ptr, table_ptr, E: tl.constexpr, EP: tl.constexpr,
                           CHUNK: tl.constexpr, SLOTS: tl.constexpr, WS: tl.constexpr):
    """One program: the work items of the routed weight gradients' split-K launches, table[i] =
    (skip, expert, first row, rows (0 when skipped), slot, first slot, slots, 0) int32, SLOTS
    items of each. An expert with more than CHUNK rows is split: its chunks 1, 2, ... of CHUNK
    rows go to slots, numbered over the split experts in expert order, then chunk order (the
    experts' own launch gives it no rows). Chunks' launch: item j, the j-th such chunk, into
    slot j (skipped past the last); first chunks' launch: item s, the s-th split expert's chunk
    0, which adds its slots in order. Since CHUNK >= t·k / SLOTS the slots hold every chunk past
    a first, whatever the routing; the clamps only keep every index in its buffer."""
    o_e = tl.arange(0, EP)
    n = tl.load(counts_ptr + o_e, mask=o_e < E, other=0)
    split = n > CHUNK
    extra = tl.where(split, (n + CHUNK - 1) // CHUNK - 1, 0)
    cum = tl.cumsum(extra, axis=0)
    j = tl.arange(0, WS)
    held = _holding(j, cum, o_e, E)
    skip = (held >= E) | (j >= SLOTS)
    e = tl.minimum(held, E - 1)
    chunk = 1 + j - (_entries(cum, o_e, e) - _entries(extra, o_e, e))
    rows = tl.where(skip, 0, tl.minimum(_entries(n, o_e, e) - chunk * CHUNK, CHUNK))
    _table_rows(table_ptr, j, j < SLOTS, skip, e, tl.load(offsets_ptr + e) + chunk * CHUNK,
                rows, j, j * 0, j * 0)
    held = _holding(j, tl.cumsum(split.to(tl.int32), axis=0), o_e, E)
    skip = (held >= E) | (j >= SLOTS)
    e = tl.minimum(held, E - 1)
    first = _entries(cum, o_e, e) - _entries(extra, o_e, e)
    parts = tl.maximum(tl.minimum(_entries(extra, o_e, e), SLOTS - first), 0)
    _table_rows(table_ptr + SLOTS * 8, j, j < SLOTS, skip, e, tl.load(offsets_ptr + e),
                tl.where(skip, 0, tl.minimum(_entries(n, o_e, e), CHUNK)), j * 0 - 1, first,
                parts)


@triton.jit
def _table_rows(ptr, i, m, skip, e, start, rows, slot, first, parts):
    """Rows i (where m) of an int32 [*, 8] work table."""
    row = ptr + i * 8
    tl.store(row, skip.to(tl.int32), mask=m)
    tl.store(row + 1, e, mask=m)
    tl.store(row + 2, start, mask=m)
    tl.store(row + 3, rows, mask=m)
    tl.store(row + 4, slot, mask=m)
    tl.store(row + 5, first, mask=m)
    tl.store(row + 6, parts, mask=m)
    tl.store(row + 7, i * 0, mask=m)


@triton.jit
def moe_wgrad_kernel(a_ptr, b_ptr, sorted_ptr, offsets_ptr, counts_ptr, weight_ptr, grad_ptr,
                     table_ptr, part_ptr, T, stride_b, K_TOP: tl.constexpr, E: tl.constexpr,
                     M: tl.constexpr, N: tl.constexpr, ROUTED: tl.constexpr,
                     A_SOURCE: tl.constexpr, A_RELU2: tl.constexpr, A_WEIGHTED: tl.constexpr,
                     TRANSPOSED: tl.constexpr, ACCUMULATE: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT: tl.constexpr, CHUNK: tl.constexpr, SLOTS: tl.constexpr,
                     UPCAST: tl.constexpr, IEEE: tl.constexpr, EXACT: tl.constexpr,
                     VEC: tl.constexpr):
    """grad[e][m, n] (grad[e][n, m] when TRANSPOSED) (+)= the sum over e's rows r, in dispatch
    order, of A[r, m] · B[token_r, n]: one program per (work item, BM × BN tile), the work item
    slowest (``wgrad_tile``)."""
    wgrad_tile(tl.program_id(0), a_ptr, b_ptr, sorted_ptr, offsets_ptr, counts_ptr, weight_ptr,
               grad_ptr, table_ptr, part_ptr, T, stride_b, K_TOP, E, M, N, ROUTED, A_SOURCE,
               A_RELU2, A_WEIGHTED, TRANSPOSED, ACCUMULATE, BM, BN, BK, GROUP_M, SPLIT, CHUNK,
               SLOTS, UPCAST, IEEE, EXACT, VEC)


@triton.jit
def moe_dense_wgrad_pair_kernel(a0_ptr, b0_ptr, grad0_ptr, stride_b0, a1_ptr, b1_ptr, grad1_ptr,
                                stride_b1, T, M: tl.constexpr, N: tl.constexpr,
                                SOURCE_0: tl.constexpr, RELU2_0: tl.constexpr,
                                TRANSPOSED_0: tl.constexpr, SOURCE_1: tl.constexpr,
                                RELU2_1: tl.constexpr, TRANSPOSED_1: tl.constexpr,
                                ACCUMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BK: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                                IEEE: tl.constexpr, EXACT: tl.constexpr, VEC: tl.constexpr):
    """Two dense (one expert, every token a row) weight gradients of the same [M, N] tiling in
    one launch, so that the second's tiles fill the first's last wave: programs below
    ceil(M / BM)·ceil(N / BN) compute grad0 from (a0, b0) with SOURCE_0, RELU2_0 and
    TRANSPOSED_0 (``wgrad_tile``, unweighted, unsplit), the rest grad1 from (a1, b1)."""
    tiles: tl.constexpr = ((M + BM - 1) // BM) * ((N + BN - 1) // BN)
    pid = tl.program_id(0)
    if pid < tiles:
        wgrad_tile(pid, a0_ptr, b0_ptr, None, None, None, None, grad0_ptr, None, None, T,
                   stride_b0, 1, 1, M, N, False, SOURCE_0, RELU2_0, False, TRANSPOSED_0,
                   ACCUMULATE, BM, BN, BK, GROUP_M, 0, 0, 0, UPCAST, IEEE, EXACT, VEC)
    else:
        wgrad_tile(pid - tiles, a1_ptr, b1_ptr, None, None, None, None, grad1_ptr, None, None,
                   T, stride_b1, 1, 1, M, N, False, SOURCE_1, RELU2_1, False, TRANSPOSED_1,
                   ACCUMULATE, BM, BN, BK, GROUP_M, 0, 0, 0, UPCAST, IEEE, EXACT, VEC)


@triton.jit
def wgrad_tile(pid, a_ptr, b_ptr, sorted_ptr, offsets_ptr, counts_ptr, weight_ptr, grad_ptr,
               table_ptr, part_ptr, T, stride_b, K_TOP: tl.constexpr, E: tl.constexpr,
               M: tl.constexpr, N: tl.constexpr, ROUTED: tl.constexpr, A_SOURCE: tl.constexpr,
               A_RELU2: tl.constexpr, A_WEIGHTED: tl.constexpr, TRANSPOSED: tl.constexpr,
               ACCUMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               GROUP_M: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr,
               SLOTS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
               EXACT: tl.constexpr, VEC: tl.constexpr):
    """Program ``pid`` of a weight-gradient launch: grad[e][m, n] (grad[e][n, m] when
    TRANSPOSED) (+)= the sum over e's rows r, in dispatch order, of A[r, m] · B[token_r, n]
    (added to the buffer's value at the end, a quarter of the columns at a time, when
    ACCUMULATE): A = d_u by row, or a = relu(u)² (times the routing weight when A_WEIGHTED,
    rounded) by assignment, loaded as [BM, BK] so that its transform happens
    on the MMA's register operand; B = x or d_out gathered by token (a view, stride_b vectors a
    row). One program per (work item, BM × BN tile), the work item slowest; inside it GROUP_M
    row tiles run through every column tile. Routed, a work item is an expert (SPLIT 0 and 1;
    SPLIT 1 gives an expert of more than CHUNK rows none, rewriting its tile as it is), or a
    part of one read from the work table (``moe_wgrad_split_kernel``): SPLIT 2, the chunks
    past a split expert's first, each into its fp32 slot of ``part_ptr`` [SLOTS, M·N] (in the
    gradient's layout); SPLIT 3, the split experts' first chunks, which add their slots in
    chunk order, then the buffer (ACCUMULATE), rounded once: a fixed partition and a fixed
    order, so the result is the same bits every run."""
    m_tiles: tl.constexpr = (M + BM - 1) // BM
    n_tiles: tl.constexpr = (N + BN - 1) // BN
    w = pid // (m_tiles * n_tiles)
    tile = pid % (m_tiles * n_tiles)
    per_group = GROUP_M * n_tiles
    first_m = tile // per_group * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    m = (first_m + tile % per_group % group_rows) * BM + tl.arange(0, BM)
    n = (tile % per_group // group_rows) * BN + tl.arange(0, BN)
    ITEM0: tl.constexpr = SLOTS * (SPLIT > 2)
    if ROUTED:
        if SPLIT < 2:
            start, rows = tl.load(offsets_ptr + w), tl.load(counts_ptr + w)
            if SPLIT == 1:                      # a split expert's tile: rewritten as it is
                rows = tl.where(rows > CHUNK, 0, rows)
        else:
            start = tl.load(table_ptr + (ITEM0 + w) * 8 + 2)
            rows = tl.load(table_ptr + (ITEM0 + w) * 8 + 3)
    else:
        start, rows = w * 0, T + w * 0
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    kk = tl.arange(0, BK)
    dtype = a_ptr.dtype.element_ty
    for r0 in range(0, rows, BK):
        ok = r0 + kk < rows
        r = start + r0 + kk
        if ROUTED:
            assign = tl.load(sorted_ptr + r, mask=ok, other=0)
        else:
            assign = r
        token = assign // K_TOP
        a_row = _operand_rows(A_SOURCE, r, token, assign, M, 0, VEC)
        a = tl.load(a_ptr + a_row[None, :] + m[:, None], mask=ok[None, :] & (m < M)[:, None],
                    other=0.0)                                           # [BM, BK]
        if A_RELU2:
            a = relu2(a, dtype, EXACT)
        if A_WEIGHTED:
            wt = tl.load(weight_ptr + assign, mask=ok, other=0.0)
            a = round_to(a.to(tl.float32) * wt[None, :], dtype, EXACT)
        b = tl.load(b_ptr + token[:, None].to(tl.int64) * (stride_b * VEC) + n[None, :],
                    mask=ok[:, None] & (n < N)[None, :], other=0.0)      # [BK, BN]
        acc = mm(a, b, acc, UPCAST, IEEE)                                # [BM, BK] @ [BK, BN]
    e, slot, first, parts = w, w, w, w          # the item's expert, slot and parts, read late
    work = True
    if SPLIT > 1:
        item = table_ptr + (ITEM0 + w) * 8
        work = tl.load(item) == 0
        e, slot, first, parts = (tl.load(item + 1), tl.load(item + 4), tl.load(item + 5),
                                 tl.load(item + 6))
    base = grad_ptr + e.to(tl.int64) * (M * N)
    n0 = tile % per_group // group_rows * BN
    q0, q1, q2, q3 = _column_quarters(acc, BM, BN)
    Q: tl.constexpr = BN // 4
    if not work:
        return
    if SPLIT == 2:
        part = part_ptr + slot.to(tl.int64) * (M * N)
        _wgrad_slot_out(q0, part, m, n0 + tl.arange(0, Q), M, N, TRANSPOSED)
        _wgrad_slot_out(q1, part, m, n0 + Q + tl.arange(0, Q), M, N, TRANSPOSED)
        _wgrad_slot_out(q2, part, m, n0 + 2 * Q + tl.arange(0, Q), M, N, TRANSPOSED)
        _wgrad_slot_out(q3, part, m, n0 + 3 * Q + tl.arange(0, Q), M, N, TRANSPOSED)
    else:
        parts_at = part_ptr + first.to(tl.int64) * (M * N) if SPLIT == 3 else part_ptr
        ADD: tl.constexpr = SPLIT == 3
        _wgrad_quarter(q0, base, m, n0, BM, Q, M, N, TRANSPOSED, ACCUMULATE, EXACT, parts_at,
                       parts, ADD)
        _wgrad_quarter(q1, base, m, n0 + Q, BM, Q, M, N, TRANSPOSED, ACCUMULATE, EXACT,
                       parts_at, parts, ADD)
        _wgrad_quarter(q2, base, m, n0 + 2 * Q, BM, Q, M, N, TRANSPOSED, ACCUMULATE, EXACT,
                       parts_at, parts, ADD)
        _wgrad_quarter(q3, base, m, n0 + 3 * Q, BM, Q, M, N, TRANSPOSED, ACCUMULATE, EXACT,
                       parts_at, parts, ADD)


@triton.jit
def _wgrad_quarter(q, base, m, n0, BM: tl.constexpr, Q: tl.constexpr, M: tl.constexpr,
                   N: tl.constexpr, TRANSPOSED: tl.constexpr, ACCUMULATE: tl.constexpr,
                   EXACT: tl.constexpr, parts_at, parts, ADD_PARTS: tl.constexpr):
    """A column quarter [BM, Q] (columns n0 ...) of a weight-gradient tile into grad[e]
    (``_wgrad_out``); adding slots, a half of it at a time (one more fp32 tile is live)."""
    if ADD_PARTS:
        h0, h1 = _column_halves(q, BM, Q)
        _wgrad_out(h0, base, m, n0 + tl.arange(0, Q // 2), M, N, TRANSPOSED, ACCUMULATE, EXACT,
                   parts_at, parts, ADD_PARTS)
        _wgrad_out(h1, base, m, n0 + Q // 2 + tl.arange(0, Q // 2), M, N, TRANSPOSED,
                   ACCUMULATE, EXACT, parts_at, parts, ADD_PARTS)
    else:
        _wgrad_out(q, base, m, n0 + tl.arange(0, Q), M, N, TRANSPOSED, ACCUMULATE, EXACT,
                   parts_at, parts, ADD_PARTS)


@triton.jit
def _grad_offsets(m, n, M: tl.constexpr, N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Offsets of [m, n] in one expert's gradient ([n, m] when TRANSPOSED; 32-bit while the
    gradient has fewer than 2^31 elements), and where they are inside it."""
    if M * N < 2**31:
        mi, ni = m, n
    else:
        mi, ni = m.to(tl.int64), n.to(tl.int64)
    if TRANSPOSED:
        at = ni[None, :] * M + mi[:, None]
    else:
        at = mi[:, None] * N + ni[None, :]
    return at, (m < M)[:, None] & (n < N)[None, :]


@triton.jit
def _wgrad_slot_out(acc, part, m, n, M: tl.constexpr, N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Columns n of a split-K chunk's fp32 tile into its slot (``part``), in the gradient's
    layout."""
    at, in_grad = _grad_offsets(m, n, M, N, TRANSPOSED)
    tl.store(part + at, acc, mask=in_grad)


@triton.jit
def _wgrad_out(acc, base, m, n, M: tl.constexpr, N: tl.constexpr, TRANSPOSED: tl.constexpr,
               ACCUMULATE: tl.constexpr, EXACT: tl.constexpr, parts_at, parts,
               ADD_PARTS: tl.constexpr):
    """Columns n of a weight-gradient tile into grad[e] (``base``; [n, m] when TRANSPOSED):
    after the ``parts`` slots from ``parts_at`` on, in order (ADD_PARTS), added to the buffer's
    gradient when ACCUMULATE, rounded once to the buffer's dtype."""
    at, in_grad = _grad_offsets(m, n, M, N, TRANSPOSED)
    if ADD_PARTS:
        for _ in range(parts):
            acc += tl.load(parts_at + at, mask=in_grad, other=0.0)
            parts_at += M * N
    if ACCUMULATE:
        acc += tl.load(base + at, mask=in_grad, other=0.0).to(tl.float32)
    if base.dtype.element_ty == tl.float32:
        tl.store(base + at, acc, mask=in_grad)
    else:
        tl.store(base + at, round_to(acc, base.dtype.element_ty, EXACT), mask=in_grad)


# -- fixed-order sums ----------------------------------------------------------------------------
@triton.jit
def moe_combine_kernel(buf_ptr, ids_ptr, out_ptr, T, stride_out,
                       K_TOP: tl.constexpr, E: tl.constexpr, H: tl.constexpr,
                       BT: tl.constexpr, BH: tl.constexpr, EXACT: tl.constexpr,
                       VEC: tl.constexpr):
    """out[t] = sum over j (in order) of the rows buf[t·k + j] (x's dtype) of the kept
    assignments, in fp32, rounded once; out (out or d_x: a view) stride_out vectors a row.
    Without a shared expert only: with one, its down (or dgrad-up) GEMM sums the rows in its
    epilogue (EPI_COMBINE)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    row_ok = rows < T
    col_ok = (cols < H)[None, :]
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in range(K_TOP):
        a = rows.to(tl.int64) * K_TOP + j
        ex = tl.load(ids_ptr + a, mask=row_ok, other=-1)
        kept = row_ok & (ex >= 0) & (ex < E)
        acc += tl.load(buf_ptr + a[:, None] * H + cols[None, :], mask=kept[:, None] & col_ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * (stride_out * VEC) + cols[None, :],
             round_to(acc, out_ptr.dtype.element_ty, EXACT), mask=row_ok[:, None] & col_ok)


@triton.jit
def moe_weight_grad_reduce_kernel(part_ptr, ids_ptr, dw_ptr, status_ptr, A, E: tl.constexpr,
                                  PARTS: tl.constexpr, BLOCK: tl.constexpr,
                                  HAS_STATUS: tl.constexpr):
    """d_w[a] = sum over the column tiles (in order) of the <g, act> partials; 0 when dropped
    (and the dropped ids other than -1 reported)."""
    a = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ex = tl.load(ids_ptr + a, mask=a < A, other=-1)
    kept = (a < A) & (ex >= 0) & (ex < E)
    report(status_ptr, _invalid_id(ex, E), EXPERT_ID, HAS_STATUS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(PARTS):
        acc += tl.load(part_ptr + p * A + a, mask=kept, other=0.0)
    tl.store(dw_ptr + a, acc, mask=a < A)
