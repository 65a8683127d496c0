"""Independent float64 math of the inference contract: the recurrence token by token, every
state kept exact (the storage rounding is what the tolerance allows for), then the rollback's
choice of snapshot. Written from the contract, separately from the torch backend."""

from __future__ import annotations

import torch

from ..mamba2_scan.contract import DEFAULT_DT_LIMIT
from ..mamba2_scan.oracle import transformed_dt


def decode_sequential(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      dt_limit=DEFAULT_DT_LIMIT):
    """Rows of initial states ``state`` [b, h, p, n] through T tokens, in float64; returns
    (y [b, T, h, p], states [b, T+1, h, p, n]: the state after each prefix, 0 = the initial)."""
    x, A, B, C = (t.double() for t in (x, A, B, C))
    b, T, h, p = x.shape
    g = B.shape[2]
    dtv = transformed_dt(dt, dt_bias, dt_softplus, dt_limit)          # [b, T, h]
    S = state.double()
    states, ys = [S], []
    for t in range(T):
        Bt = B[:, t].repeat_interleave(h // g, 1)                        # [b, h, n]
        Ct = C[:, t].repeat_interleave(h // g, 1)
        decay = torch.exp(dtv[:, t] * A)                                 # [b, h]
        S = decay[..., None, None] * S + (dtv[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        yt = torch.einsum("bhpn,bhn->bhp", S, Ct)
        if D is not None:
            yt = yt + (D.double()[:, None] if D.dim() == 1 else D.double()) * x[:, t]
        if z is not None:
            zt = z[:, t].double()
            yt = yt * zt * torch.sigmoid(zt)
        states.append(S)
        ys.append(yt)
    return torch.stack(ys, 1), torch.stack(states, 1)


def oracle(case) -> dict[str, torch.Tensor]:
    """y, snapshots and the state after the update and the rollback (the names ``samples.run``
    returns), in float64. Rows with an invalid slot (negative, or past the cache) get zero y and
    snapshots and touch no slot; a row whose accepted count is outside [0, T] keeps the state
    after all T tokens."""
    t = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.tensors.items()}
    state = t["state"].double()
    b, T = t["x"].shape[:2]
    slots = state.shape[0]
    slot = (torch.arange(b) if t.get("state_batch_indices") is None
            else t["state_batch_indices"].long())
    valid = (slot >= 0) & (slot < slots)
    start = state[slot.clamp(0, slots - 1)]
    y, states = decode_sequential(start, t["x"], t["dt"], t["A"], t["B"], t["C"], D=t.get("D"),
                                  z=t.get("z"), dt_bias=t.get("dt_bias"),
                                  dt_softplus=case.options.get("dt_softplus", False),
                                  dt_limit=case.options.get("dt_limit", DEFAULT_DT_LIMIT))
    zero = torch.zeros((), dtype=torch.float64)
    y = torch.where(valid[:, None, None, None], y, zero)
    snapshots = torch.where(valid[:, None, None, None, None], states, zero)
    final = state.clone()
    for i in range(b):
        if valid[i]:
            accepted = int(t["accepted"][i])
            final[slot[i]] = states[i, accepted if 0 <= accepted <= T else T]
    return dict(y=y, snapshots=snapshots, state=final)
