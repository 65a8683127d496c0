"""Mamba2 inference: Triton kernels for the state update over T tokens (snapshots, nearest or
stochastic storage) and the rollback to a snapshot (fusedops.mamba2_inference.contract).

One program per (row, head, block of p): the [BP, N] state tile stays in fp32 registers across
the T tokens and is rounded only where it is written (every checkpoint_period tokens, the last
token, and every snapshot). Stochastic rounding draws from Philox-4x32-10 keyed by the row's seed
and countered by (element index, offset + t); the torch backend mirrors it bit for bit. Kernel
arguments carry the plan's tensor names; absent optional operands (D, z, dt_bias, the slot
indices, the seeds and offsets, the snapshots) are compiled out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage
from fusedops.mamba2_inference.contract import SOFTPLUS_THRESHOLD, DecodeProblem

from . import interpreter_active
from .rounding import nearest_even, stochastic
from .runtime import KernelSpec, pointer_type

__all__ = ["rollback_program", "rollback_spec", "unsupported_reason", "update_program",
           "update_spec"]


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
                            y_ptr, snapshots_ptr, SLOTS, T, dt_min, dt_max,
                            H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                            N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                            PERIOD: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                            HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                            HAS_INDICES: tl.constexpr, STOCHASTIC: tl.constexpr,
                            HAS_SNAPSHOTS: tl.constexpr, EXACT_NEAREST: tl.constexpr,
                            SOFTPLUS_THRESHOLD: tl.constexpr):
    i_b, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_INDICES:
        slot = tl.load(state_batch_indices_ptr + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    if (slot < 0) | (slot >= SLOTS):     # padding (or out of the cache): nothing is touched
        return
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    DTYPE = state_ptr.dtype.element_ty
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
    o_snap = (i_b.to(tl.int64) * (T + 1) * H + i_h) * (P * N) + o_p[:, None] * N + o_n[None, :]
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
    for t in range(T):
        tok = i_b.to(tl.int64) * T + t
        dt = tl.load(dt_ptr + tok * H + i_h).to(tl.float32)
        if HAS_BIAS:
            dt += bias
        if SOFTPLUS:
            dt = tl.where(dt > SOFTPLUS_THRESHOLD, dt, tl.maximum(dt, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(dt))))
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        decay = tl.exp(dt * b_A)
        p_x = tok * (H * P) + i_h * P + o_p
        b_x = tl.load(x_ptr + p_x, mask=m_p, other=0.0).to(tl.float32)
        b_B = tl.load(B_ptr + tok * (G * N) + i_g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_C = tl.load(C_ptr + tok * (G * N) + i_g * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_S = decay * b_S + (dt * b_x)[:, None] * b_B[None, :]
        b_y = tl.sum(b_S * b_C[None, :], axis=1)
        if HAS_D:
            b_y += b_D * b_x
        if HAS_Z:
            b_z = tl.load(z_ptr + p_x, mask=m_p, other=0.0).to(tl.float32)
            b_y *= b_z * tl.sigmoid(b_z)
        tl.store(y_ptr + p_x, b_y.to(y_ptr.dtype.element_ty), mask=m_p)
        b_written = stored(b_S, elements, seed, offset + t + 1, DTYPE, STOCHASTIC, EXACT_NEAREST)
        if ((t + 1) % PERIOD == 0) | (t == T - 1):
            b_S = b_written.to(tl.float32)
        if HAS_SNAPSHOTS:
            tl.store(snapshots_ptr + o_snap + (t + 1) * (H * P * N), b_written, mask=m_pn)
    tl.store(p_state, b_S.to(DTYPE), mask=m_pn)


@triton.jit
def ssd_rollback_kernel(state_ptr, snapshots_ptr, accepted_ptr, state_batch_indices_ptr, SLOTS,
                        T: tl.constexpr, NUMEL: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_INDICES: tl.constexpr):
    i_b, i_t = tl.program_id(0), tl.program_id(1)
    if HAS_INDICES:
        slot = tl.load(state_batch_indices_ptr + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    acc = tl.load(accepted_ptr + i_b).to(tl.int64)
    if (slot < 0) | (slot >= SLOTS) | (acc < 0) | (acc > T):
        return
    o = i_t * BLOCK + tl.arange(0, BLOCK)
    m = o < NUMEL
    b = tl.load(snapshots_ptr + (i_b.to(tl.int64) * (T + 1) + acc) * NUMEL + o, mask=m)
    tl.store(state_ptr + slot * NUMEL + o, b, mask=m)


def _p_tile(problem) -> int:
    """Head-dim rows per program: 16, or 8 with stochastic rounding (Philox keeps four 32-bit
    words per element live), so about 16 (8) state elements per thread at n = 128."""
    return max(1, min(8 if problem.stochastic else 16, triton.next_power_of_2(problem.head_dim)))


def update_spec(problem) -> KernelSpec:
    """The state update over the T tokens: one program per (row, head, head-dim tile)."""
    xt, st = pointer_type(problem.dtype), pointer_type(problem.state_dtype)

    def present(flag, triton_type):
        return triton_type if flag else None
    args = (("state_ptr", st), ("x_ptr", xt), ("dt_ptr", pointer_type(problem.dt_dtype)),
            ("A_ptr", "*fp32"), ("B_ptr", xt), ("C_ptr", xt),
            ("D_ptr", present(problem.has_D, "*fp32")), ("z_ptr", present(problem.has_z, xt)),
            ("dt_bias_ptr", present(problem.has_dt_bias, "*fp32")),
            ("state_batch_indices_ptr", present(problem.has_indices, "*i32")),
            ("rng_seed_ptr", present(problem.stochastic, "*i64")),
            ("rng_offset_ptr", present(problem.stochastic, "*i64")), ("y_ptr", xt),
            ("snapshots_ptr", present(problem.has_snapshots, st)), ("SLOTS", "i32"), ("T", "i32"),
            ("dt_min", "fp32"), ("dt_max", "fp32"))
    constexprs = dict(H=problem.heads, G=problem.groups, P=problem.head_dim,
                      N=problem.state, BP=_p_tile(problem), BN=triton.next_power_of_2(problem.state),
                      PERIOD=problem.checkpoint_period, HAS_D=problem.has_D,
                      D_PER_CHANNEL=problem.D_per_channel, HAS_Z=problem.has_z,
                      HAS_BIAS=problem.has_dt_bias, SOFTPLUS=problem.dt_softplus,
                      HAS_INDICES=problem.has_indices, STOCHASTIC=problem.stochastic,
                      HAS_SNAPSHOTS=problem.has_snapshots,
                      EXACT_NEAREST=interpreter_active() and problem.state_dtype == torch.bfloat16,
                      SOFTPLUS_THRESHOLD=SOFTPLUS_THRESHOLD)
    warps = max(1, min(8, _p_tile(problem) * triton.next_power_of_2(problem.state) // 256))
    grid = (problem.batch, problem.heads, triton.cdiv(problem.head_dim, _p_tile(problem)))
    # with Philox, ptxas otherwise settles at ~72 registers and keeps a small stack frame
    return KernelSpec.make(ssd_state_update_kernel, args, constexprs, grid, num_warps=warps,
                           num_stages=1, maxnreg=128 if problem.stochastic else None)


def rollback_spec(problem) -> KernelSpec:
    """The rollback: one program per (row, tile of the [h, p, n] state)."""
    st = pointer_type(problem.state_dtype)
    block = min(4096, triton.next_power_of_2(problem.state_numel))
    constexprs = dict(T=problem.tokens, NUMEL=problem.state_numel, BLOCK=block,
                      HAS_INDICES=problem.has_indices)
    args = (("state_ptr", st), ("snapshots_ptr", st), ("accepted_ptr", "*i32"),
            ("state_batch_indices_ptr", "*i32" if problem.has_indices else None), ("SLOTS", "i32"))
    return KernelSpec.make(ssd_rollback_kernel, args, constexprs,
                           (problem.batch, triton.cdiv(problem.state_numel, block)), num_warps=4,
                           num_stages=1)


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    """Why the Triton kernels cannot serve ``problem`` (None: every dtype the plans take)."""
    dtype = problem.dtype if isinstance(problem, DecodeProblem) else problem.state_dtype
    return kernel_dtype_reason("Triton Mamba2 inference kernels", dtype)


def update_program(problem) -> Program:
    """One launch: every row, head and head-dim tile over the T tokens."""
    lo, hi = problem.dt_limit
    return Program(stages=(Stage(update_spec(problem), dict(SLOTS=problem.slots, T=problem.tokens,
                                                            dt_min=lo, dt_max=hi)),))


def rollback_program(problem) -> Program:
    """One launch: every row's accepted snapshot, tile by tile, into its slot."""
    return Program(stages=(Stage(rollback_spec(problem), dict(SLOTS=problem.slots)),))
