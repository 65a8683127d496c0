"""Mamba2 inference: the Triton kernels for the state update over T tokens (snapshots, nearest or
stochastic storage) and the rollback to a snapshot (fusedops.mamba2_inference.contract).

One program per (row, head, block of p): the [BP, N] state tile stays in fp32 registers across
the T tokens and is rounded only where it is written (every checkpoint_period tokens, the last
token, and every snapshot). Stochastic rounding draws from Philox-4x32-10 keyed by the row's seed
and countered by (element index, offset + t); the torch backend mirrors it bit for bit. Kernel
arguments carry the plan's tensor names; absent optional operands (D, z, dt_bias, the slot
indices, the seeds and offsets, the snapshots, the status word) are compiled out. x, dt, B, C, z
and y are addressed through their strides (row·stride_b + token·stride_t + head·stride_h +
column), taken in units of a constexpr (VX, VB, VDT: a 16-byte vector when the rows are whole
vectors, so the loads stay vectorised; else 1); B and C may be fp32 with 16-bit x.

Index data (any values): a row whose slot is negative (padding) or past the cache
(Status.SLOT_INDEX) is skipped: its programs write zeros to its y rows and snapshots and touch
no slot; the rollback skips a row whose accepted count is outside [0, T]
(Status.ACCEPTED_COUNT) or whose slot is invalid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedops.core.status import Status

from ..primitives import report_if
from ..rounding import nearest_even, stochastic
from ..ssm_math import softplus


SLOT_INDEX_BIT: tl.constexpr = tl.constexpr(int(Status.SLOT_INDEX))
ACCEPTED_COUNT_BIT: tl.constexpr = tl.constexpr(int(Status.ACCEPTED_COUNT))


@triton.jit
def stored(S, elements, seed, counter, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr,
           EXACT_NEAREST: tl.constexpr):
    """The state as written to a DTYPE cache after the counter-th token of the row."""
    if STOCHASTIC:
        c1 = (counter & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
        c2 = (counter >> 32).to(tl.int32)
        r0, _, _, _ = tl.philox(seed, elements, c1, c2, 0)
        return stochastic(S, tl.uint_to_uniform_float(r0), DTYPE, tl.int16)
    elif EXACT_NEAREST:
        return nearest_even(S, DTYPE, tl.int16)
    else:
        return S.to(DTYPE)


@triton.jit
def ssd_state_update_kernel(state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr,
                            dt_bias_ptr, state_batch_indices_ptr, rng_seed_ptr, rng_offset_ptr,
                            y_ptr, snapshots_ptr, status_ptr, stride_x_b, stride_x_t, stride_x_h,
                            stride_dt_b, stride_dt_t, stride_B_b, stride_B_t, stride_B_g,
                            stride_C_b, stride_C_t, stride_C_g, stride_z_b, stride_z_t,
                            stride_z_h, stride_y_b, stride_y_t, stride_y_h, SLOTS, T, dt_min,
                            dt_max, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                            N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                            PERIOD: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                            HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                            HAS_INDICES: tl.constexpr, STOCHASTIC: tl.constexpr,
                            HAS_SNAPSHOTS: tl.constexpr, EXACT_NEAREST: tl.constexpr,
                            SOFTPLUS_THRESHOLD: tl.constexpr, HAS_STATUS: tl.constexpr,
                            VX: tl.constexpr, VB: tl.constexpr, VDT: tl.constexpr):
    i_b, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    DTYPE = state_ptr.dtype.element_ty
    o_snap = (i_b.to(tl.int64) * (T + 1) * H + i_h) * (P * N) + o_p[:, None] * N + o_n[None, :]
    row = i_b.to(tl.int64)
    p_y = y_ptr + row * (stride_y_b * VX) + i_h * (stride_y_h * VX) + o_p
    if HAS_INDICES:
        slot = tl.load(state_batch_indices_ptr + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    if (slot < 0) | (slot >= SLOTS):
        # padding, or past the cache (reported once per row): no slot is touched, y and the
        # snapshots of the row are 0
        report_if(status_ptr, (slot >= SLOTS) & (i_h == 0) & (i_p == 0), SLOT_INDEX_BIT, HAS_STATUS)
        for t in range(T):
            tl.store(p_y + t * (stride_y_t * VX), tl.zeros([BP], dtype=y_ptr.dtype.element_ty),
                     mask=m_p)
        if HAS_SNAPSHOTS:
            for t in range(T + 1):
                tl.store(snapshots_ptr + o_snap + t * (H * P * N),
                         tl.zeros([BP, BN], dtype=DTYPE), mask=m_pn)
        return
    i_g = i_h // (H // G)
    elements = (i_h * P + o_p[:, None]) * N + o_n[None, :]
    p_state = state_ptr + (slot * H + i_h) * (P * N) + o_p[:, None] * N + o_n[None, :]
    b_raw = tl.load(p_state, mask=m_pn, other=0.0)
    b_S = b_raw.to(tl.float32)
    if STOCHASTIC:
        seed = tl.load(rng_seed_ptr + i_b)
        offset = tl.load(rng_offset_ptr + i_b)
    else:
        seed = 0
        offset = 0
    if HAS_SNAPSHOTS:
        tl.store(snapshots_ptr + o_snap, b_raw, mask=m_pn)
    b_A = tl.load(A_ptr + i_h)
    if HAS_BIAS:
        bias = tl.load(dt_bias_ptr + i_h)
    if HAS_D:
        if D_PER_CHANNEL:
            b_D = tl.load(D_ptr + i_h * P + o_p, mask=m_p, other=0.0)
        else:
            b_D = tl.load(D_ptr + i_h)
    p_x = x_ptr + row * (stride_x_b * VX) + i_h * (stride_x_h * VX) + o_p
    p_dt = dt_ptr + row * (stride_dt_b * VDT) + i_h
    p_B = B_ptr + row * (stride_B_b * VB) + i_g * (stride_B_g * VB) + o_n
    p_C = C_ptr + row * (stride_C_b * VB) + i_g * (stride_C_g * VB) + o_n
    if HAS_Z:
        p_z = z_ptr + row * (stride_z_b * VX) + i_h * (stride_z_h * VX) + o_p
    for t in range(T):
        dt = tl.load(p_dt + t * (stride_dt_t * VDT)).to(tl.float32)
        if HAS_BIAS:
            dt += bias
        if SOFTPLUS:
            dt = softplus(dt, SOFTPLUS_THRESHOLD)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        decay = tl.exp(dt * b_A)
        b_x = tl.load(p_x + t * (stride_x_t * VX), mask=m_p, other=0.0).to(tl.float32)
        b_B = tl.load(p_B + t * (stride_B_t * VB), mask=m_n, other=0.0).to(tl.float32)
        b_C = tl.load(p_C + t * (stride_C_t * VB), mask=m_n, other=0.0).to(tl.float32)
        b_S = decay * b_S + (dt * b_x)[:, None] * b_B[None, :]
        b_y = tl.sum(b_S * b_C[None, :], axis=1)
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_z = tl.load(p_z + t * (stride_z_t * VX), mask=m_p, other=0.0).to(tl.float32)
            b_y *= b_z * tl.sigmoid(b_z)
        tl.store(p_y + t * (stride_y_t * VX), b_y.to(y_ptr.dtype.element_ty), mask=m_p)
        b_written = stored(b_S, elements, seed, offset + t + 1, DTYPE, STOCHASTIC, EXACT_NEAREST)
        if ((t + 1) % PERIOD == 0) | (t == T - 1):
            b_S = b_written.to(tl.float32)
        if HAS_SNAPSHOTS:
            tl.store(snapshots_ptr + o_snap + (t + 1) * (H * P * N), b_written, mask=m_pn)
    tl.store(p_state, b_S.to(DTYPE), mask=m_pn)


@triton.jit
def ssd_rollback_kernel(state_ptr, snapshots_ptr, accepted_ptr, state_batch_indices_ptr,
                        status_ptr, SLOTS, T: tl.constexpr, NUMEL: tl.constexpr,
                        BLOCK: tl.constexpr, HAS_INDICES: tl.constexpr, HAS_STATUS: tl.constexpr):
    i_b, i_t = tl.program_id(0), tl.program_id(1)
    if HAS_INDICES:
        slot = tl.load(state_batch_indices_ptr + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    acc = tl.load(accepted_ptr + i_b).to(tl.int64)
    bad_acc = (acc < 0) | (acc > T)
    report_if(status_ptr, bad_acc & (i_t == 0), ACCEPTED_COUNT_BIT, HAS_STATUS)
    report_if(status_ptr, (slot >= SLOTS) & (i_t == 0), SLOT_INDEX_BIT, HAS_STATUS)
    if (slot < 0) | (slot >= SLOTS) | bad_acc:      # skipped: the slot keeps its state
        return
    o = i_t * BLOCK + tl.arange(0, BLOCK)
    m = o < NUMEL
    b = tl.load(snapshots_ptr + (i_b.to(tl.int64) * (T + 1) + acc) * NUMEL + o, mask=m)
    tl.store(state_ptr + slot * NUMEL + o, b, mask=m)
