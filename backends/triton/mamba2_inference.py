"""Mamba2 inference: Triton kernels for the state update over T tokens (snapshots, nearest or
stochastic storage) and the rollback to a snapshot.

One program per (row, head, block of p): the [BP, N] state tile stays in fp32 registers across
the T tokens and is rounded only where it is written (every checkpoint_period tokens, the last
token, and every snapshot). Stochastic rounding draws from Philox-4x32-10 keyed by the row's seed
and countered by (element index, offset + t); fusedops.backends.torch.mamba2_inference mirrors it
bit for bit.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusedops._backend import triton_interpreter_active

from .compiler import KernelSpec, make_launcher, pointer_type
from .rounding import nearest_even, stochastic


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
def ssd_state_update_kernel(state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, bias_ptr,
                            idx_ptr, seed_ptr, offset_ptr, y_ptr, snap_ptr, SLOTS, T, dt_min, dt_max,
                            H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                            N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                            PERIOD: tl.constexpr, HAS_D: tl.constexpr, D_PER_CHANNEL: tl.constexpr,
                            HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                            HAS_INDICES: tl.constexpr, STOCHASTIC: tl.constexpr,
                            HAS_SNAPSHOTS: tl.constexpr, EXACT_NEAREST: tl.constexpr):
    i_b, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_INDICES:
        slot = tl.load(idx_ptr + i_b).to(tl.int64)
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
        seed = tl.load(seed_ptr + i_b)
        offset = tl.load(offset_ptr + i_b)
    else:
        seed = 0
        offset = 0
    p_snap = snap_ptr + (i_b.to(tl.int64) * (T + 1) * H + i_h) * (P * N) + o_p[:, None] * N + o_n[None, :]
    if HAS_SNAPSHOTS:
        tl.store(p_snap, b_raw, mask=m_pn)
    b_A = tl.load(A_ptr + i_h)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + i_h)
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
            dt = tl.where(dt > 20.0, dt, tl.maximum(dt, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(dt))))
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
            tl.store(p_snap + (t + 1) * (H * P * N), b_written, mask=m_pn)
    tl.store(p_state, b_S.to(DTYPE), mask=m_pn)


@triton.jit
def ssd_rollback_kernel(state_ptr, snap_ptr, acc_ptr, idx_ptr, SLOTS, T: tl.constexpr,
                        NUMEL: tl.constexpr, BLOCK: tl.constexpr, HAS_INDICES: tl.constexpr):
    i_b, i_t = tl.program_id(0), tl.program_id(1)
    if HAS_INDICES:
        slot = tl.load(idx_ptr + i_b).to(tl.int64)
    else:
        slot = i_b.to(tl.int64)
    acc = tl.load(acc_ptr + i_b).to(tl.int64)
    if (slot < 0) | (slot >= SLOTS) | (acc < 0) | (acc > T):
        return
    o = i_t * BLOCK + tl.arange(0, BLOCK)
    m = o < NUMEL
    b = tl.load(snap_ptr + (i_b.to(tl.int64) * (T + 1) + acc) * NUMEL + o, mask=m)
    tl.store(state_ptr + slot * NUMEL + o, b, mask=m)


def _p_tile(problem) -> int:
    """Head-dim rows per program: 16, or 8 with stochastic rounding (Philox keeps four 32-bit
    words per element live), so about 16 (8) state elements per thread at n = 128."""
    return max(1, min(8 if problem.stochastic else 16, triton.next_power_of_2(problem.head_dim)))


def update_spec(problem) -> KernelSpec:
    xt, st = pointer_type(problem.dtype), pointer_type(problem.state_dtype)
    args = (("state_ptr", st), ("x_ptr", xt), ("dt_ptr", pointer_type(problem.dt_dtype)),
            ("A_ptr", "*fp32"), ("B_ptr", xt), ("C_ptr", xt), ("D_ptr", "*fp32"), ("z_ptr", xt),
            ("bias_ptr", "*fp32"), ("idx_ptr", "*i32"), ("seed_ptr", "*i64"), ("offset_ptr", "*i64"),
            ("y_ptr", xt), ("snap_ptr", st), ("SLOTS", "i32"), ("T", "i32"), ("dt_min", "fp32"),
            ("dt_max", "fp32"))
    constexprs = dict(H=problem.heads, G=problem.groups, P=problem.head_dim,
                      N=problem.state, BP=_p_tile(problem), BN=triton.next_power_of_2(problem.state),
                      PERIOD=problem.checkpoint_period, HAS_D=problem.has_D,
                      D_PER_CHANNEL=problem.D_per_channel, HAS_Z=problem.has_z,
                      HAS_BIAS=problem.has_dt_bias, SOFTPLUS=problem.dt_softplus,
                      HAS_INDICES=problem.has_indices, STOCHASTIC=problem.stochastic,
                      HAS_SNAPSHOTS=problem.has_snapshots,
                      EXACT_NEAREST=triton_interpreter_active() and problem.state_dtype == torch.bfloat16)
    aligned = tuple(n for n, t in args if t.startswith("*") and t not in ("*i32", "*i64"))
    warps = max(1, min(8, _p_tile(problem) * triton.next_power_of_2(problem.state) // 256))
    # with Philox, ptxas otherwise settles at ~72 registers and keeps a small stack frame
    return KernelSpec(ssd_state_update_kernel, args + tuple((k, "constexpr") for k in constexprs),
                      tuple(constexprs.items()), aligned=aligned, num_warps=warps, num_stages=1,
                      maxnreg=128 if problem.stochastic else None)


def rollback_spec(problem) -> KernelSpec:
    st = pointer_type(problem.state_dtype)
    constexprs = dict(T=problem.tokens, NUMEL=problem.state_numel,
                      BLOCK=min(4096, triton.next_power_of_2(problem.state_numel)),
                      HAS_INDICES=problem.has_indices)
    args = (("state_ptr", st), ("snap_ptr", st), ("acc_ptr", "*i32"), ("idx_ptr", "*i32"),
            ("SLOTS", "i32"))
    return KernelSpec(ssd_rollback_kernel, args + tuple((k, "constexpr") for k in constexprs),
                      tuple(constexprs.items()), aligned=("state_ptr", "snap_ptr"), num_warps=4,
                      num_stages=1)


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return None


def update_launcher(problem):
    spec = update_spec(problem)
    grid = (problem.batch, problem.heads, triton.cdiv(problem.head_dim, _p_tile(problem)))
    launch_update = make_launcher(spec, grid, problem.device)
    slots, tokens = problem.slots, problem.tokens
    lo, hi = problem.dt_limit

    def launch(t, *, stream):
        x, A = t["x"], t["A"]
        launch_update(t["state"], x, t["dt"], A, t["B"], t["C"], t["D"] if problem.has_D else A,
                      t["z"] if problem.has_z else x, t["dt_bias"] if problem.has_dt_bias else A,
                      t["state_batch_indices"] if problem.has_indices else A,
                      t["rng_seed"] if problem.stochastic else A,
                      t["rng_offset"] if problem.stochastic else A, t["y"],
                      t["snapshots"] if problem.has_snapshots else t["state"], slots, tokens, lo,
                      hi, stream=stream)
    return launch


def rollback_launcher(problem):
    spec = rollback_spec(problem)
    block = dict(spec.constexprs)["BLOCK"]
    launch_rb = make_launcher(spec, (problem.batch, triton.cdiv(problem.state_numel, block), 1),
                              problem.device)
    slots = problem.slots

    def launch(t, *, stream):
        launch_rb(t["state"], t["snapshots"], t["accepted"],
                  t["state_batch_indices"] if problem.has_indices else t["accepted"], slots,
                  stream=stream)
    return launch


def aot_specs():
    """(label, KernelSpec): decode at h=128 p=64 n=128 g=8 for each state dtype and policy, a
    speculative 4-token launch with snapshots, and the rollback."""
    from fusedops.mamba2_inference import DecodeProblem, RollbackProblem
    cpu = torch.device("cpu")
    for sdt, stochastic in ((torch.float32, False), (torch.float16, False), (torch.float16, True),
                            (torch.bfloat16, True)):
        name = f"{str(sdt).removeprefix('torch.')}{' stochastic' if stochastic else ''}"
        for tokens, snaps in ((1, False), (4, True)):
            problem = DecodeProblem(torch.bfloat16, torch.bfloat16, sdt, 256, tokens, 512, 128, 64, 8,
                                    128, True, False, True, True, True, (0.0, math.inf), True, snaps,
                                    stochastic, 1, cpu)
            yield f"decode T={tokens} {name}{' snapshots' if snaps else ''}", update_spec(problem)
    yield "rollback fp16", rollback_spec(RollbackProblem(torch.float16, 256, 4, 512, 128 * 64 * 128, True, cpu))
