"""Independent float64 math of the scan contract: the token-by-token recurrence, differentiated
by autograd. Written from the contract, separately from the torch backend (which computes by
segments), so the reference is checked against math it does not share code with."""

from __future__ import annotations

import torch

from .contract import DEFAULT_DT_LIMIT, SOFTPLUS_THRESHOLD

GRADIENT_OF = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
               "dt_bias": "ddt_bias", "initial_states": "dinitial_states"}


def transformed_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=DEFAULT_DT_LIMIT):
    """dt + dt_bias, through softplus (u itself above the threshold) when asked, clamped to
    dt_limit; float64."""
    u = dt.double() + (dt_bias.double() if dt_bias is not None else 0.0)
    if dt_softplus:
        t = SOFTPLUS_THRESHOLD
        u = torch.where(u > t, u, torch.log1p(torch.exp(torch.clamp(u, max=t))))
    return torch.clamp(u, min=dt_limit[0], max=dt_limit[1])


def mamba2_sequential(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                      dt_limit=DEFAULT_DT_LIMIT, initial_states=None, cu_seqlens=None,
                      seq_idx=None):
    """The forward as the token-by-token recurrence, in float64; returns (y [b, l, h, p],
    final_states [nseq, h, p, n]). Differentiable by autograd. ``seq_idx`` [b, l]: along a row
    the state restarts at every token whose id differs from the previous token's, and the row's
    initial state enters only when its first id is 0 (mamba_ssm's rule, applied to any ids)."""
    x, A, B, C = (t.double() for t in (x, A, B, C))
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    dtv = transformed_dt(dt, dt_bias, dt_softplus, dt_limit)
    if cu_seqlens is None:
        spans = [(row, 0, l) for row in range(b)]
    else:
        bounds = cu_seqlens.tolist()
        spans = [(0, bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
    heads_per_group = h // g
    ids = seq_idx.tolist() if seq_idx is not None else None
    ys = torch.zeros(b, l, h, p, dtype=torch.float64, device=x.device)
    finals = []
    zero = torch.zeros(h, p, n, dtype=torch.float64, device=x.device)
    for s, (row, t0, t1) in enumerate(spans):
        enters = initial_states is not None and (ids is None or ids[row][0] == 0)
        state = initial_states[s].double().clone() if enters else zero
        rows = []
        for t in range(t0, t1):
            if ids is not None and t > t0 and ids[row][t] != ids[row][t - 1]:
                state = zero                                              # a new sequence
            Bt = B[row, t].repeat_interleave(heads_per_group, 0)        # [h, n]
            Ct = C[row, t].repeat_interleave(heads_per_group, 0)
            decay = torch.exp(dtv[row, t] * A)                            # [h]
            state = decay[:, None, None] * state + (dtv[row, t][:, None] * x[row, t])[..., None] * Bt[:, None, :]
            yt = torch.einsum("hpn,hn->hp", state, Ct)
            if D is not None:
                yt = yt + (D.double()[:, None] if D.dim() == 1 else D.double()) * x[row, t]
            if z is not None:
                zt = z[row, t].double()
                yt = yt * zt * torch.sigmoid(zt)
            rows.append(yt)
        if rows:
            ys = ys.index_put((torch.tensor([row] * len(rows)), torch.arange(t0, t1)), torch.stack(rows))
        finals.append(state)
    return ys, torch.stack(finals)


def scan_with_gradients(tensors, *, dt_softplus=False, dt_limit=DEFAULT_DT_LIMIT) -> dict:
    """y, final_states and the gradients of sum(y·dy) (+ sum(final_states·dfinal_states) when
    given) w.r.t. every floating input present, all float64 on the CPU."""
    t = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
    leaves = {k: t[k].double().requires_grad_() for k in GRADIENT_OF if t.get(k) is not None}
    y, final = mamba2_sequential(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], D=leaves.get("D"),
        z=leaves.get("z"), dt_bias=leaves.get("dt_bias"), dt_softplus=dt_softplus,
        dt_limit=dt_limit, initial_states=leaves.get("initial_states"),
        cu_seqlens=t.get("cu_seqlens"), seq_idx=t.get("seq_idx"))
    loss = (y * t["dy"].double()).sum()
    if t.get("dfinal_states") is not None:
        loss = loss + (final * t["dfinal_states"].double()).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return dict(y=y.detach(), final_states=final.detach(),
                **{GRADIENT_OF[k]: g if g is not None else torch.zeros_like(leaves[k])
                   for k, g in zip(leaves, grads)})


def oracle(case) -> dict[str, torch.Tensor]:
    """Every result of a scan case (the names ``samples.run`` returns), in float64."""
    return scan_with_gradients(case.tensors, dt_softplus=case.options.get("dt_softplus", False),
                               dt_limit=case.options.get("dt_limit", DEFAULT_DT_LIMIT))
