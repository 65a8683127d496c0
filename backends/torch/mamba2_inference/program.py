"""Mamba2 inference in plain torch: the state update over T tokens with a storage policy, and
the rollback to a snapshot (fusedops.mamba2_inference.contract).

Per row (a request, whose state lives in ``state[slot]``) and head, for tokens t = 1..T:

    S <- exp(dt_t A) S + dt_t x_t ⊗ B_t          in fp32
    y_t = S C_t + D x_t   (· silu(z_t))
    after token t, if t % checkpoint_period == 0 or t == T: S <- store(S)   (the written state)

``store`` rounds to the state dtype: to nearest-even, or stochastically: up to the next
representable value away from the truncated one with probability equal to the remaining
fraction (unbiased, always within one ulp), the uniform number coming from Philox-4x32-10 keyed
by the row's seed and countered by (element index, offset + t). The same (seed, offset) therefore
reproduces every rounding decision: a replay from a checkpoint, a rollback to snapshot k and a
run of the first k tokens all agree bit for bit. Snapshot t is store(S) after token t (snapshot
0 is the stored initial state). Rows whose slot is negative (padding) or past the cache
(Status.SLOT_INDEX) are skipped: no slot is touched, their y rows and snapshots are 0. Indices are
never used to index before they are validated (no negative-index wraparound, no IndexError,
no host read). x, dt, B, C, z and y may be views of wider buffers: they are read and written in
place (B and C may be fp32 with 16-bit x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedops.core.status import Status
from fusedops.mamba2_inference.contract import DEFAULT_DT_LIMIT

from ..common import direct_program, report, unsupported_reason
from ..mamba2_scan.program import transform_dt

__all__ = ["philox_uniform", "rollback", "rollback_program", "state_update", "store",
           "unsupported_reason", "update_program"]

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_UNIFORM_SCALE = 4.6566127342e-10


def _mul_hi_lo(a: int, b: torch.Tensor):
    """High and low 32 bits of a * b for a < 2^32 (int) and b < 2^32 (int64 tensor), exactly."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    t_hi, t_lo = a * b_hi, a * b_lo
    high = (t_hi + (t_lo >> 16)) >> 16
    low = (((t_hi & 0xFFFF) << 16) + t_lo) & _MASK32
    return high, low


def philox_uniform(seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor):
    """Uniform [0, 1) floats from Philox-4x32-10 (as Triton's ``tl.philox`` with c3 = 0 and its
    ``uint_to_uniform_float``); every argument an int64 tensor, broadcast together."""
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0, c1, c2, c3 = c0 & _MASK32, c1 & _MASK32, c2 & _MASK32, torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c2, c1, c3 = hi_b ^ c1 ^ k0, hi_a ^ c3 ^ k1, lo_b, lo_a
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    as_int32 = torch.where(c0 >= 2**31, c0 - 2**32, c0)
    as_int32 = torch.where(as_int32 < 0, -as_int32 - 1, as_int32)        # ~x for negative x
    return as_int32.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def store(value: torch.Tensor, dtype: torch.dtype, uniform: torch.Tensor | None) -> torch.Tensor:
    """Rounds fp32 ``value`` to ``dtype``: to nearest-even when ``uniform`` is None, else up or
    down with probability given by the position between the two neighbours (unbiased)."""
    if dtype == torch.float32:
        return value.clone()
    near = value.to(dtype)
    if uniform is None:
        return near
    near_f = near.to(torch.float32)
    bits = near.view(_BITS[dtype])
    toward_zero = near_f.abs() > value.abs()
    other = torch.where(toward_zero, bits - 1, bits + 1).view(dtype)
    lo = torch.where(toward_zero, other, near)
    hi = torch.where(toward_zero, near, other)
    lo_f, hi_f = lo.to(torch.float32), hi.to(torch.float32)
    p = (value - lo_f) / (hi_f - lo_f)
    return torch.where(uniform < p, hi, lo)


def element_index(h: int, p: int, n: int, device) -> torch.Tensor:
    """Philox's first counter: the element's index within one [h, p, n] state."""
    return torch.arange(h * p * n, device=device, dtype=torch.int64).view(h, p, n)


def state_update(state, x, dt, A, B, C, y, *, D=None, z=None, dt_bias=None, dt_softplus=False,
                 dt_limit=DEFAULT_DT_LIMIT, state_batch_indices=None, stochastic=False,
                 checkpoint_period=1, rng_seed=None, rng_offset=None, snapshots=None, status=None):
    """T tokens for every row, in place on ``state`` [slots, h, p, n] (and ``y``, ``snapshots``).
    Rows with a negative slot or one past the cache are skipped (y and snapshots 0; SLOT_INDEX
    ORed into ``status`` for a slot past the cache)."""
    b, T, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    slots, dev, sdt = state.shape[0], x.device, state.dtype
    rows = torch.arange(b, device=dev)
    slot = rows if state_batch_indices is None else state_batch_indices.to(torch.int64)
    valid = (slot >= 0) & (slot < slots)
    report(status, Status.SLOT_INDEX, slot >= slots)
    slot = torch.where(valid, slot, torch.zeros_like(slot))
    S = state[slot].to(torch.float32)                                    # [b, h, p, n]
    elements = element_index(h, p, n, dev)

    def write(S, t):
        if not stochastic:
            return store(S, sdt, None)
        counter = rng_offset.to(torch.int64) + t                         # [b]
        u = philox_uniform(rng_seed.to(torch.int64)[:, None, None, None], elements[None],
                           counter[:, None, None, None], (counter >> 32)[:, None, None, None])
        return store(S, sdt, u)

    if snapshots is not None:
        snap = [state[slot]]
    heads_per_group = h // g
    outs = []
    for t in range(T):
        # token by token, so that every step computes on the same shapes whatever T is (torch's
        # vectorised math may differ in the last ulp between shapes; replays must not)
        # (element-wise on the operands as they are, views included: the same bits either way)
        dtv = transform_dt(dt[:, t], dt_bias, dt_softplus, dt_limit)               # [b, h] fp32
        decay = torch.exp(dtv * A.float())
        Bt = B[:, t].float().repeat_interleave(heads_per_group, 1)                 # [b, h, n]
        Ct = C[:, t].float().repeat_interleave(heads_per_group, 1)
        xt = x[:, t].float()
        S = decay[..., None, None] * S + (dtv[:, :, None] * xt)[..., None] * Bt[:, :, None, :]
        yt = torch.einsum("bhpn,bhn->bhp", S, Ct)
        if D is not None:
            yt = yt + (D.float()[:, None] if D.dim() == 1 else D.float()) * xt
        if z is not None:
            yt = yt * F.silu(z[:, t].float())
        outs.append(yt)
        written = write(S, t + 1)
        if (t + 1) % checkpoint_period == 0 or t + 1 == T:
            S = written.to(torch.float32)
        if snapshots is not None:
            snap.append(written)
    keep = valid[:, None, None, None]
    y.copy_(torch.where(keep, torch.stack(outs, 1).to(y.dtype), torch.zeros((), dtype=y.dtype,
                                                                            device=dev)))
    if snapshots is not None:
        snapshots.copy_(torch.where(keep[:, None], torch.stack(snap, 1),
                                    torch.zeros((), dtype=sdt, device=dev)))
    _scatter_rows(state, slot, valid, S.to(sdt))


def _scatter_rows(state, slot, valid, rows):
    """state[slot[i]] = rows[i] for the valid rows, leaving every other slot untouched, without
    reading how many rows are valid on the host."""
    slots = state.shape[0]
    owner = torch.full((slots + 1,), -1, dtype=torch.int64, device=state.device)
    owner = owner.index_put((torch.where(valid, slot, torch.full_like(slot, slots)),),
                            torch.arange(slot.numel(), device=state.device))[:slots]
    picked = rows[owner.clamp(min=0)]
    state.copy_(torch.where((owner >= 0)[:, None, None, None], picked, state))


def rollback(state, snapshots, accepted, state_batch_indices=None, status=None):
    """state[slot_i] = snapshots[i, accepted[i]] (the state after the accepted prefix) for the
    rows with a valid slot and accepted in [0, T]; ACCEPTED_COUNT (any row) and SLOT_INDEX (a
    slot past the cache) ORed into ``status``."""
    b, T1 = snapshots.shape[:2]
    dev = state.device
    slot = (torch.arange(b, device=dev) if state_batch_indices is None
            else state_batch_indices.to(torch.int64))
    acc = accepted.to(torch.int64)
    report(status, Status.ACCEPTED_COUNT, (acc < 0) | (acc >= T1))
    report(status, Status.SLOT_INDEX, slot >= state.shape[0])
    valid = (slot >= 0) & (slot < state.shape[0]) & (acc >= 0) & (acc < T1)
    slot = torch.where(valid, slot, torch.zeros_like(slot))
    chosen = snapshots[torch.arange(b, device=dev), acc.clamp(0, T1 - 1)]
    _scatter_rows(state, slot, valid, chosen)


# -- the backend surface -----------------------------------------------------------------------
def update_program(problem):
    """T tokens in place on the state (and y, snapshots)."""
    def run(b):
        state_update(b["state"], b["x"], b["dt"], b["A"], b["B"], b["C"], b["y"], D=b.get("D"),
                     z=b.get("z"), dt_bias=b.get("dt_bias"), dt_softplus=problem.dt_softplus,
                     dt_limit=problem.dt_limit, state_batch_indices=b.get("state_batch_indices"),
                     stochastic=problem.stochastic, checkpoint_period=problem.checkpoint_period,
                     rng_seed=b.get("rng_seed"), rng_offset=b.get("rng_offset"),
                     snapshots=b.get("snapshots"), status=b.get("status"))
    return direct_program(run)


def rollback_program(problem):
    """state[slot_i] = snapshots[i, accepted[i]] for the valid rows."""
    def run(b):
        rollback(b["state"], b["snapshots"], b["accepted"], b.get("state_batch_indices"),
                 b.get("status"))
    return direct_program(run)
