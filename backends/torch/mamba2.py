"""Mamba2 chunked selective scan (SSD) in plain torch (fusedops.mamba2.contract).

The sequence is cut into *segments*: consecutive pieces of at most Q = chunk_size tokens of one
sequence (sequence s covers ceil(len_s / Q) segments, the last one possibly short). Without
cu_seqlens the sequences are the batch rows. Per segment and head, with a_t = dt_t·A and
Acum_i = sum_{k<=i} a_k inside the segment:

    y_i  = sum_{j<=i} exp(Acum_i - Acum_j) (C_i·B_j) dt_j x_j  +  exp(Acum_i) C_i·H0  +  D x_i
    H1   = exp(Acum_last) H0 + sum_j exp(Acum_last - Acum_j) dt_j x_j ⊗ B_j

H0 is the state entering the segment (the sequence's initial state, or zero, for its first
segment; the previous segment's H1 otherwise); the last H1 of a sequence is its final state.
Exponents are clamped to <= 0 so no decay factor can overflow. Every step is vectorised over
segments (gathered into [segments, Q] tiles by (row, position) index from the operands as they
are: views of wider buffers are read in place, never made contiguous first; static sizes, no
host synchronisation); only the state passing loops, over segment positions within a sequence.

With sequence ids (seq_idx) every token carries its run number r (``sequence_runs``: the runs of
equal ids along its row, numbered so that run 0 is a leading run of id 0, the one the initial
state enters); with r_prev the run of the token before the segment (0 at a row's start) and
r_last the run of the segment's last token, the pair (i, j) counts only when r_i = r_j, the
entering state only for r_i = r_prev, a token's part of H1 only for r_j = r_last, and H0 carries
into H1 only when r_last = r_prev (the masks mamba_ssm's kernels apply to its chunks).

The backward is autograd through this forward in the compute dtype, which implements the spec's
conventions (torch.clamp passes the gradient at dt_limit's bounds; softplus with threshold 20).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fusedops.core.dtypes import accumulator_dtype
from fusedops.core.status import Status
from fusedops.mamba2.contract import DEFAULT_DT_LIMIT, SOFTPLUS_THRESHOLD, max_segments

from ._autograd import autograd_recording
from .common import direct_program, report, unsupported_reason

__all__ = ["backward_program", "chunk_scan_backward", "chunk_scan_forward", "forward_program",
           "sanitise_cu_seqlens", "segments", "sequence_runs", "transform_dt",
           "unsupported_reason"]


def transform_dt(dt, dt_bias, dt_softplus: bool, dt_limit, compute_dtype=torch.float32):
    """dt after bias, softplus (threshold 20) and the dt_limit clamp, in ``compute_dtype``."""
    u = dt.to(compute_dtype)
    if dt_bias is not None:
        u = u + dt_bias.to(compute_dtype)
    if dt_softplus:
        u = F.softplus(u, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return torch.clamp(u, min=dt_limit[0], max=dt_limit[1])


def sanitise_cu_seqlens(cu_seqlens: torch.Tensor, total: int):
    """(c', bad): the sanitised offsets c'[i] = clamp(c[i], c'[i-1], total) with c'[0] =
    clamp(c[0], 0, total) (the running maximum of max(c, 0), capped at ``total``), int64, and
    whether c was invalid (c[0] != 0 or c' != c; a 0-d bool tensor, no host read)."""
    cu = cu_seqlens.to(torch.int64)
    clean = torch.cummax(cu.clamp(min=0), dim=0).values.clamp(max=total)
    bad = (cu[0] != 0) | (clean != cu).any()
    return clean, bad


def sequence_runs(seq_idx: torch.Tensor, status=None) -> torch.Tensor:
    """The run number of every token [b, l] int64: runs of equal ids along a row, counted from 1
    at the row's start, or from 0 when the row starts with id 0 (so run 0 is the leading run the
    initial state enters). Status.SEQ_IDX is ORed into ``status`` when a row holds a negative id
    or decreases (no host read)."""
    ids = seq_idx.to(torch.int64)
    change = torch.zeros_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    report(status, Status.SEQ_IDX, (ids < 0).any() | (ids[:, 1:] < ids[:, :-1]).any())
    return (ids[:, :1] != 0).to(torch.int64) + torch.cumsum(change.to(torch.int64), dim=1)


def segments(batch: int, length: int, chunk: int, cu_seqlens: torch.Tensor | None,
             device: torch.device):
    """(seg_start, seg_end, seg_offsets): token ranges [start, end) of every segment in the
    flattened [batch·length] token index (unused trailing segments are empty, start == end == 0),
    and the first segment of each sequence (seg_offsets[s] .. seg_offsets[s+1]). ``cu_seqlens``
    must be sanitised (``sanitise_cu_seqlens``)."""
    if cu_seqlens is None:
        per_row = math.ceil(length / chunk)
        k = torch.arange(batch * per_row, device=device)
        row, c = k // per_row, k % per_row
        start = row * length + c * chunk
        end = row * length + torch.clamp((c + 1) * chunk, max=length)
        offsets = torch.arange(batch + 1, device=device) * per_row
        return start, end, offsets
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    counts = (lengths + chunk - 1) // chunk
    offsets = torch.cat((torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(counts, 0)))
    total = max_segments(1, length, chunk, lengths.numel())
    k = torch.arange(total, device=device)
    seq = torch.searchsorted(offsets[1:], k, right=True).clamp(max=lengths.numel() - 1)
    used = k < offsets[-1]
    start = cu[seq] + (k - offsets[seq]) * chunk
    end = torch.minimum(cu[seq + 1], start + chunk)
    zero = torch.zeros_like(start)
    return torch.where(used, start, zero), torch.where(used, end, zero), offsets


def chunk_scan_forward(x, dt, A, B, C, chunk_size: int, D=None, z=None, dt_bias=None,
                       dt_softplus=False, dt_limit=DEFAULT_DT_LIMIT, initial_states=None,
                       cu_seqlens=None, compute_dtype=torch.float32, status=None, seq_idx=None,
                       state_dtype=None):
    """Returns ``(y, final_states, y_pre_gate, segment_start_states)``.

    y [b, l, h, p] in x's dtype (z-gated when z is given, rounded once); final_states
    [nseq, h, p, n] in compute_dtype (nseq = b, or len(cu_seqlens) - 1); y_pre_gate the fp32 y
    before the z gate; segment_start_states [segments, h, p, n] (H0 of every segment).
    cu_seqlens may hold anything: it is sanitised (``sanitise_cu_seqlens``; Status.CU_SEQLENS
    ORed into ``status`` when it was invalid), and tokens no sequence covers get y = 0.
    ``seq_idx`` [b, l] (not with cu_seqlens): the state restarts where the id changes along a
    row (``sequence_runs``; Status.SEQ_IDX for negative or decreasing ids). ``state_dtype``:
    the output reads the entering states rounded to it, as the kernels pass them (the gradient
    flows through the rounding unchanged; the carried state, final_states and
    segment_start_states stay in compute_dtype)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    Q = chunk_size
    cd = compute_dtype
    dev = x.device
    T = b * l
    nseq = b if cu_seqlens is None else cu_seqlens.numel() - 1
    covered = None
    if cu_seqlens is not None:
        cu_seqlens, bad = sanitise_cu_seqlens(cu_seqlens.to(dev), T)
        report(status, Status.CU_SEQLENS, bad)
        token = torch.arange(T, device=dev)
        covered = ((token >= cu_seqlens[0]) & (token < cu_seqlens[-1])).view(b, l, 1, 1)
    start, end, offsets = segments(b, l, Q, cu_seqlens, dev)
    S = start.numel()

    tok = start[:, None] + torch.arange(Q, device=dev)                  # [S, Q]
    valid = tok < end[:, None]
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    vmask = valid.to(cd)
    row, pos = tok // l, tok % l                     # gathered from the operands as they are

    dtf = transform_dt(dt, dt_bias, dt_softplus, dt_limit, cd)           # [b, l, h]
    xs = x[row, pos].to(cd) * vmask[..., None, None]                     # [S, Q, h, p]
    dts = dtf[row, pos] * vmask[..., None]                               # [S, Q, h]
    Bs = B[row, pos].to(cd)                                              # [S, Q, g, n]
    Cs = C[row, pos].to(cd)
    Acum = torch.cumsum(dts * A.to(cd), dim=1)                          # [S, Q, h]
    Alast = Acum[:, -1]                                                  # [S, h]

    # sequence ids: which pairs, entering states and end states of a segment count
    same, enter, ends, carry = None, None, None, None
    if seq_idx is not None:
        every = sequence_runs(seq_idx.to(dev), status)                    # [b, l]
        runs = every[row, pos]                                           # [S, Q]
        r_last = runs.gather(1, (end - start - 1).clamp(min=0)[:, None])[:, 0]
        r_prev = torch.where(start % l == 0, torch.zeros_like(r_last),
                             every.reshape(T)[(start - 1).clamp(min=0)])
        same = runs[:, :, None] == runs[:, None, :]                      # [S, Q, Q]
        enter = (runs == r_prev[:, None]).to(cd)                         # [S, Q]
        ends = (runs == r_last[:, None]).to(cd)
        carry = (r_last == r_prev).to(cd)                                # [S]

    # intra-segment: (C_i·B_j) exp(Acum_i - Acum_j) dt_j x_j over j <= i of the same segment
    CB = torch.einsum("sqgn,skgn->sgqk", Cs, Bs)                         # [S, g, Q, Q]
    causal = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=dev))
    pair = causal & valid[:, :, None] & valid[:, None, :]                # [S, Q, Q]
    if same is not None:
        pair = pair & same
    diff = Acum.permute(0, 2, 1)[:, :, :, None] - Acum.permute(0, 2, 1)[:, :, None, :]
    decay = torch.exp(torch.clamp(diff, max=0.0)) * pair[:, None].to(cd)  # [S, h, Q, Q]
    decay = decay.reshape(S, g, r, Q, Q) * CB[:, :, None]
    xdt = (xs * dts[..., None]).reshape(S, Q, g, r, p)
    y = torch.einsum("sgrqk,skgrp->sqgrp", decay, xdt).reshape(S, Q, h, p)

    # segment states: sum_j exp(Acum_last - Acum_j) dt_j x_j ⊗ B_j
    w_end = torch.exp(torch.clamp(Alast[:, None] - Acum, max=0.0))
    if ends is not None:
        w_end = w_end * ends[..., None]
    w_end = w_end.reshape(S, Q, g, r)
    seg_state = torch.einsum("sqgr,sqgrp,sqgn->sgrpn", w_end, xdt, Bs).reshape(S, h, p, n)

    # state passing along each sequence's segments
    state = (torch.zeros(nseq, h, p, n, dtype=cd, device=dev) if initial_states is None
             else initial_states.to(cd))
    H0 = torch.zeros(S + 1, h, p, n, dtype=cd, device=dev)                # row S: discard slot
    first, count = offsets[:-1], offsets[1:] - offsets[:-1]
    for pos in range(math.ceil(l / Q)):   # no sequence has more segments than that
        active = pos < count
        k = torch.where(active, first + pos, torch.full_like(first, S))
        H0 = H0.index_put((k,), state)
        ka = k.clamp(max=S - 1)
        decay = torch.exp(torch.clamp(Alast[ka], max=0.0))
        if carry is not None:
            decay = decay * carry[ka, None]
        stepped = decay[..., None, None] * state + seg_state[ka]
        state = torch.where(active[:, None, None, None], stepped, state)
    H0 = H0[:S]

    # state -> output: exp(Acum_i) C_i·H0
    Cr = Cs[:, :, :, None].expand(S, Q, g, r, n).reshape(S, Q, h, n)
    w_start = torch.exp(torch.clamp(Acum, max=0.0))
    if enter is not None:
        w_start = w_start * enter[..., None]
    passed = H0
    if state_dtype is not None and state_dtype != cd:
        passed = H0 + (H0.to(state_dtype).to(cd) - H0).detach()
    y = y + w_start[..., None] * torch.einsum("sqhn,shpn->sqhp", Cr, passed)

    out = torch.zeros(T + 1, h, p, dtype=cd, device=dev)
    out = out.index_put((torch.where(valid, tok, torch.full_like(tok, T)),), y)[:T]
    y_pre = out.reshape(b, l, h, p)                  # a fresh tensor: the reshape is a view
    if D is not None:
        y_pre = y_pre + (D.to(cd)[:, None] if D.dim() == 1 else D.to(cd)) * x.to(cd)
    y_out = y_pre * F.silu(z.to(cd)) if z is not None else y_pre
    if covered is not None:    # tokens no sequence covers: y = 0, and no gradient flows back
        zero = torch.zeros((), dtype=cd, device=dev)
        y_pre, y_out = torch.where(covered, y_pre, zero), torch.where(covered, y_out, zero)
    return y_out.to(x.dtype), state, y_pre, H0


def chunk_scan_backward(x, dt, A, B, C, dy, chunk_size, D=None, z=None, dt_bias=None,
                        dt_softplus=False, dt_limit=DEFAULT_DT_LIMIT, initial_states=None,
                        cu_seqlens=None, dfinal_states=None, compute_dtype=torch.float32,
                        status=None, seq_idx=None, state_dtype=None):
    """Gradients by autograd through ``chunk_scan_forward`` in ``compute_dtype``. Returns a dict
    with dx, ddt, dA, dB, dC and, for the optional inputs given, dD, dz, ddt_bias,
    dinitial_states (all in compute_dtype)."""
    cd = compute_dtype
    named = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                 initial_states=initial_states)
    leaves = {k: v.detach().to(cd).requires_grad_() for k, v in named.items() if v is not None}
    with autograd_recording():
        y, final, _, _ = chunk_scan_forward(
            leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk_size,
            D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
            dt_softplus=dt_softplus, dt_limit=dt_limit,
            initial_states=leaves.get("initial_states"), cu_seqlens=cu_seqlens, compute_dtype=cd,
            status=status, seq_idx=seq_idx, state_dtype=state_dtype)
        outputs, grads = [y], [dy.to(cd)]
        if dfinal_states is not None:
            outputs.append(final)
            grads.append(dfinal_states.to(cd))
        result = torch.autograd.grad(outputs, list(leaves.values()), grads, allow_unused=True)
    names = {"x": "dx", "dt": "ddt", "A": "dA", "B": "dB", "C": "dC", "D": "dD", "z": "dz",
             "dt_bias": "ddt_bias", "initial_states": "dinitial_states"}
    return {names[k]: (gr if gr is not None else torch.zeros_like(leaves[k]))
            for k, gr in zip(leaves, result)}


# -- the backend surface -----------------------------------------------------------------------
def _options(problem, b) -> dict:
    return dict(D=b.get("D"), z=b.get("z"), dt_bias=b.get("dt_bias"),
                dt_softplus=problem.dt_softplus, dt_limit=problem.dt_limit,
                initial_states=b.get("initial_states"), cu_seqlens=b.get("cu_seqlens"),
                compute_dtype=accumulator_dtype(problem.dtype), status=b.get("status"),
                seq_idx=b.get("seq_idx"), state_dtype=problem.state_dtype)


def forward_program(problem):
    """Writes y, final_states and the segment states when asked (``saved`` is empty: the
    backward recomputes)."""
    def run(b):
        y, final, _, entering = chunk_scan_forward(b["x"], b["dt"], b["A"], b["B"], b["C"],
                                                   problem.chunk, **_options(problem, b))
        b["y"].copy_(y)
        b["final_states"].copy_(final)
        if b.get("segment_states") is not None:
            b["segment_states"].copy_(entering)
    return direct_program(run)


def backward_program(problem):
    """Gradients by autograd through the forward (dA, dD, ddt_bias added with accumulate)."""
    accumulated = ("dA", "dD", "ddt_bias")

    def run(b):
        grads = chunk_scan_backward(b["x"], b["dt"], b["A"], b["B"], b["C"], b["dy"], problem.chunk,
                                    dfinal_states=b.get("dfinal_states"), **_options(problem, b))
        for name, value in grads.items():
            if problem.accumulate and name in accumulated:
                b[name].add_(value)
            else:
                b[name].copy_(value)
    return direct_program(run)
