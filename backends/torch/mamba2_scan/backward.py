"""The gradients of the torch backend's Mamba2 chunked scan, piece by piece (backends/torch/
mamba2.py composes them in ``chunk_scan_backward``).

Each function takes the gradient of one piece's output and returns the gradients of its inputs
(``state_gradients`` adds the states' paths to the pairs' gradients), in the compute dtype,
with the forward's shapes: S segments of Q slots, h = g·r heads (head i in group i // r), head
dim p, state size n. Every exponent is a sum of a_k = dt_k·A along a segment; the gradient of
a_k is summed over the terms whose exponent holds it (the pairs that straddle k, the boundary
weights that span it), never as a difference of cumulative sums, which would cancel large
opposite terms in fp32. Conventions: exp(min(e, 0)) passes the gradient where e <= 0
(torch.clamp's rule), the dt_limit clamp passes it at its bounds, softplus' derivative is 1
above the threshold (20) and sigmoid below.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedops.mamba2_scan.contract import SOFTPLUS_THRESHOLD

__all__ = ["boundary_weights_backward", "gate_backward", "pairs_backward",
           "pass_states_backward", "segment_output_state_backward", "segment_states_backward",
           "skip_backward", "state_gradients", "straddling_sums", "transform_dt_backward"]


def gate_backward(dy: torch.Tensor, y_pre: torch.Tensor, z: torch.Tensor):
    """(d y_pre, dz) [b, l, h, p] of y = y_pre·silu(z), given dy (in the compute dtype).
    Overwrites y_pre."""
    zf = z.to(dy.dtype)
    dz = torch.ops.aten.silu_backward(y_pre.mul_(dy), zf)   # times silu'(z), torch's kernel
    return F.silu(zf).mul_(dy), dz


def skip_backward(d_xs: torch.Tensor, dys: torch.Tensor, xs: torch.Tensor, D: torch.Tensor):
    """(d xs + D·dy, dD [h] or [h, p]) of the skip term D·x per slot [S, h, Q, p] (d xs
    updated in place), given dys and xs (0 in empty slots)."""
    Df = D.to(dys.dtype)
    if D.dim() == 1:
        return d_xs.addcmul_(dys, Df[:, None, None]), (dys * xs).sum((0, 2, 3))
    return d_xs.addcmul_(dys, Df[:, None]), (dys * xs).sum((0, 2))


def state_gradients(terms, layout, entering, passed, dys, dfinal, d_xdt, d_cb, d_a):
    """(d xdt [S, h, Q, p], dB [S, g, Q, n], dC [S, g, Q, n], d a [S, h, Q] (a = dt·A),
    d initial_states [nseq, h, p, n]): the pairs' gradients (``pairs_backward``: d xdt,
    d(C·B), d a, updated in place) completed with the states' paths (the entering states' term of y, the state
    passing, the segments' own states and their boundary weights), given dys [S, h, Q, p] (0
    in empty slots) and dfinal (None: zero). ``entering``: the states entering the segments;
    ``passed``: as the output read them."""
    d_passed, dC, d_w_start = segment_output_state_backward(terms, passed, dys)
    d_own, d_initial = pass_states_backward(d_passed, terms.step, layout, dfinal)
    d_step = (d_own * entering).sum((-1, -2))                           # [S, h]
    d_xdt_own, dB, d_w_end = segment_states_backward(terms, d_own)
    d_xdt += d_xdt_own
    dC += d_cb @ terms.Bs
    dB += d_cb.transpose(-1, -2) @ terms.Cs
    d_a += boundary_weights_backward(terms, d_w_start, d_w_end, d_step)
    return d_xdt, dB, dC, d_a, d_initial


def segment_output_state_backward(terms, passed: torch.Tensor, dys: torch.Tensor):
    """(d passed [S, h, p, n], dC [S, g, Q, n], d w_start [S, h, Q]) of the entering state's
    term of y, y_i += w_start_i C_i·passed, given dys [S, h, Q, p] (0 in empty slots)."""
    through = dys @ passed                                  # [S, h, Q, n]: dy_i·passed
    d_w_start = (through * terms.Ch).sum(-1)
    dC = terms.by_group(through.mul_(terms.w_start[..., None])).sum(2)
    d_passed = (dys * terms.w_start[..., None]).transpose(-1, -2) @ terms.Ch
    return d_passed, dC, d_w_start


def pass_states_backward(d_entering: torch.Tensor, step: torch.Tensor, layout, dfinal=None):
    """(d own [S, h, p, n], d initial_states [nseq, h, p, n]) of ``pass_states``: the
    sequences' segments walked back from the last, given the gradients of the entering states
    and of the final states (None: zero)."""
    S = d_entering.shape[0]
    grad = (d_entering.new_zeros(layout.nseq, *d_entering.shape[1:]) if dfinal is None
            else dfinal.to(d_entering.dtype))           # of the state after the current step
    d_own = d_entering.new_zeros(S + 1, *d_entering.shape[1:])          # row S: discarded
    for pos in reversed(range(layout.positions)):
        active = pos < layout.count
        k = torch.where(active, layout.first + pos, torch.full_like(layout.first, S))
        d_own.index_put_((k,), grad)
        k = k.clamp(max=S - 1)
        before = step[k][..., None, None] * grad + d_entering[k]
        grad = torch.where(active[:, None, None, None], before, grad)
    return d_own[:S], grad


def segment_states_backward(terms, d_own: torch.Tensor):
    """(d xdt [S, h, Q, p], dB [S, g, Q, n], d w_end [S, h, Q]) of ``segment_states``,
    own = sum_j w_end_j xdt_j ⊗ B_j, given d own [S, h, p, n]."""
    dB = terms.by_group((terms.xdt * terms.w_end[..., None]) @ d_own).sum(2)
    spread = terms.Bh @ d_own.transpose(-1, -2)             # [S, h, Q, p]: d own · B_j
    d_w_end = (terms.xdt * spread).sum(-1)
    return spread.mul_(terms.w_end[..., None]), dB, d_w_end


def pairs_backward(terms, pairs, dys: torch.Tensor, pair: torch.Tensor):
    """(d xdt [S, h, Q, p], d(C·B) [S, g, Q, Q], d a [S, h, Q]) of the pairs' term of y,
    y_i = sum_j decay_ij cb_ij xdt_j (cb 0 outside ``pair`` [S, Q, Q]), given dys [S, h, Q, p].
    Spends the PairTiles ``pairs``: their memory holds the gradients."""
    d_xdt = pairs.weights.transpose(-1, -2) @ dys
    d_weights = torch.matmul(dys, terms.xdt.transpose(-1, -2), out=pairs.weights)
    d_cb_heads = terms.by_group(d_weights.mul_(pairs.decay))           # [S, g, r, Q, Q]
    # the exponent acum_i - acum_j of each pair: d exponent = d weights · decay · cb, 0 if clamped
    d_exponent = torch.mul(d_cb_heads, pairs.cb[:, :, None], out=terms.by_group(pairs.decay))
    d_exponent = d_exponent.flatten(1, 2).masked_fill_(pairs.clamped, 0.0)
    d_cb = torch.sum(d_cb_heads, 2, out=pairs.cb).masked_fill_(~pair[:, None], 0.0)
    return d_xdt, d_cb, straddling_sums(d_exponent)


def straddling_sums(d_exponent: torch.Tensor) -> torch.Tensor:
    """d a [S, h, Q] (a_k = dt_k·A, acum = cumsum a) from d exponent [S, h, Q, Q] of the pairs'
    exponents acum_i - acum_j: a_k is in the exponent of the pairs that straddle it (j < k <= i),
    so d a_k = sum_{i >= k} sum_{j < k} d exponent_ij, summed as such (no large opposite sums
    cancelling, as d acum_i = rows - columns would). Overwrites d_exponent."""
    before = d_exponent.cumsum_(-1).tril_(-1)               # [i, m]: sum_{j <= m} (m < i)
    return F.pad(before.sum(-2)[..., :-1], (1, 0))          # d a_{m+1} = sum_{i > m} [i, m]


def boundary_weights_backward(terms, d_w_start, d_w_end, d_step) -> torch.Tensor:
    """d a [S, h, Q] (a_k = dt_k·A) through w_start_i = exp(min(acum_i, 0)) (a_k in it for
    k <= i), w_end_j = exp(min(acum_last - acum_j, 0)) (for k > j) and step = exp(min(acum_last,
    0)) (every k), their seq_idx masks included, given their gradients ([S, h, Q], [S, h, Q],
    [S, h])."""
    acum = terms.acum
    last = acum[..., -1]
    d_start = d_w_start * terms.w_start * (acum <= 0)
    d_end = d_w_end * terms.w_end * (last[..., None] - acum <= 0)
    d_last = d_step * terms.step * (last <= 0)
    from_start = d_start.flip(-1).cumsum(-1).flip(-1)                   # sum over i >= k
    from_end = F.pad(d_end.cumsum(-1)[..., :-1], (1, 0))                # sum over j < k
    return from_start + from_end + d_last[..., None]


def transform_dt_backward(d_dt, dt, dt_bias, dt_softplus: bool, dt_limit, compute_dtype):
    """(ddt [b, l, h], ddt_bias [h] or None) of ``transform_dt`` (bias, softplus, clamp), given
    the gradient of the transformed dt."""
    u = dt.to(compute_dtype)
    if dt_bias is not None:
        u = u + dt_bias.to(compute_dtype)
    v = F.softplus(u, beta=1.0, threshold=SOFTPLUS_THRESHOLD) if dt_softplus else u
    d = torch.where((v >= dt_limit[0]) & (v <= dt_limit[1]), d_dt, 0.0)
    if dt_softplus:
        d = d * torch.where(u > SOFTPLUS_THRESHOLD, 1.0, torch.sigmoid(u))
    return d, (d.sum((0, 1)) if dt_bias is not None else None)
