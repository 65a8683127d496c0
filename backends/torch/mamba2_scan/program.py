"""Mamba2 chunked selective scan (SSD) in plain torch (fusedops.mamba2_scan.contract).

The sequence is cut into *segments*: consecutive pieces of at most Q = chunk_size tokens of one
sequence (sequence s covers ceil(len_s / Q) segments, the last one possibly short). Without
cu_seqlens the sequences are the batch rows. Per segment and head, with a_t = dt_t·A and
Acum_i = sum_{k<=i} a_k inside the segment:

    y_i  = sum_{j<=i} exp(Acum_i - Acum_j) (C_i·B_j) dt_j x_j  +  exp(Acum_i) C_i·H0  +  D x_i
    H1   = exp(Acum_last) H0 + sum_j exp(Acum_last - Acum_j) dt_j x_j ⊗ B_j

H0 is the state entering the segment (the sequence's initial state, or zero, for its first
segment; the previous segment's H1 otherwise); the last H1 of a sequence is its final state.
Exponents are clamped to <= 0 so no decay factor can overflow. Every step is vectorised over
segments (gathered into [segments, heads, Q] tiles by (row, position) index from the operands
as they are: views of wider buffers are read in place, never made contiguous first; static
sizes, no host synchronisation); only the state passing loops, over segment positions within a
sequence.

With sequence ids (seq_idx) every token carries its run number r (``sequence_runs``: the runs of
equal ids along its row, numbered so that run 0 is a leading run of id 0, the one the initial
state enters); with r_prev the run of the token before the segment (0 at a row's start) and
r_last the run of the segment's last token, the pair (i, j) counts only when r_i = r_j, the
entering state only for r_i = r_prev, a token's part of H1 only for r_j = r_last, and H0 carries
into H1 only when r_last = r_prev (the masks mamba_ssm's kernels apply to its chunks).

The forward's pieces (``segment_layout``, ``segment_terms``, ``pair_tiles``,
``segment_states``, ``pass_states``, ``segment_output``) are autograd-differentiable. The backward
(``mamba2_backward``) recomputes them and differentiates the segmented algorithm by hand, in the
compute dtype, with the spec's conventions: the dt_limit clamp passes the gradient at its
bounds, softplus has threshold 20 (derivative 1 above it), a clamped exponent passes the
gradient where it is <= 0, and the state_dtype rounding passes the gradient unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fusedops.core.dtypes import accumulator_dtype
from fusedops.core.status import Status
from fusedops.mamba2_scan.contract import DEFAULT_DT_LIMIT, SOFTPLUS_THRESHOLD, max_segments

from . import backward as grad
from ..common import direct_program, report, unsupported_reason

__all__ = ["PairTiles", "SegmentLayout", "SegmentTerms", "backward_program", "chunk_scan_backward",
           "chunk_scan_forward", "forward_program", "gather_heads", "pass_states",
           "pair_tiles", "rounded_states", "sanitise_cu_seqlens", "scatter_heads", "segment_layout",
           "segment_output", "segment_states", "segment_terms", "segments", "sequence_runs",
           "transform_dt", "unsupported_reason"]


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


class SegmentLayout(NamedTuple):
    """Where the tokens of every segment are, and which of their terms count (S segments of Q
    slots; T = b·l tokens)."""

    batch: int
    length: int
    nseq: int
    row: torch.Tensor        # [S, Q] int64: the slot's batch row (0 for an empty slot)
    pos: torch.Tensor        # [S, Q] int64: its position along the row
    valid: torch.Tensor      # [S, Q] bool: the slot holds a token
    store: torch.Tensor      # [S, Q] int64: its flat token index, T (a discarded row) if empty
    pair: torch.Tensor       # [S, Q, Q] bool: the (i, j) terms that count (j <= i, same run)
    first: torch.Tensor      # [nseq] int64: the sequence's first segment
    count: torch.Tensor      # [nseq] int64: its number of segments
    covered: torch.Tensor | None   # [b, l, 1, 1] bool with cu_seqlens: a sequence covers it
    enter: torch.Tensor | None     # [S, 1, Q] with seq_idx: the entering state reaches the token
    ends: torch.Tensor | None      # [S, 1, Q] with seq_idx: the token is part of H1
    carry: torch.Tensor | None     # [S, 1] with seq_idx: H0 carries into H1

    @property
    def positions(self) -> int:
        """Segments a sequence can have at most: ceil(l / Q)."""
        return math.ceil(self.length / self.row.shape[1])


def segment_layout(batch: int, length: int, chunk: int, cu_seqlens, seq_idx, status,
                   device: torch.device, compute_dtype=torch.float32) -> SegmentLayout:
    """The SegmentLayout of a problem. ``cu_seqlens`` may hold anything: it is sanitised
    (Status.CU_SEQLENS ORed into ``status`` when invalid); ``seq_idx`` [b, l] (not with
    cu_seqlens): Status.SEQ_IDX for negative or decreasing ids. Masks in ``compute_dtype``."""
    T = batch * length
    nseq = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    covered = None
    if cu_seqlens is not None:
        cu_seqlens, bad = sanitise_cu_seqlens(cu_seqlens.to(device), T)
        report(status, Status.CU_SEQLENS, bad)
        token = torch.arange(T, device=device)
        covered = ((token >= cu_seqlens[0]) & (token < cu_seqlens[-1])).view(batch, length, 1, 1)
    start, end, offsets = segments(batch, length, chunk, cu_seqlens, device)
    tok = start[:, None] + torch.arange(chunk, device=device)            # [S, Q]
    valid = tok < end[:, None]
    tok = torch.where(valid, tok, torch.zeros_like(tok))
    store = torch.where(valid, tok, torch.full_like(tok, T))
    row, pos = tok // length, tok % length
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=device))
    pair = causal & valid[:, :, None] & valid[:, None, :]
    enter = ends = carry = None
    if seq_idx is not None:
        every = sequence_runs(seq_idx.to(device), status)                # [b, l]
        runs = every[row, pos]                                           # [S, Q]
        r_last = runs.gather(1, (end - start - 1).clamp(min=0)[:, None])[:, 0]
        r_prev = torch.where(start % length == 0, torch.zeros_like(r_last),
                             every.reshape(T)[(start - 1).clamp(min=0)])
        pair = pair & (runs[:, :, None] == runs[:, None, :])
        enter = (runs == r_prev[:, None]).to(compute_dtype)[:, None]
        ends = (runs == r_last[:, None]).to(compute_dtype)[:, None]
        carry = (r_last == r_prev).to(compute_dtype)[:, None]
    return SegmentLayout(batch, length, nseq, row, pos, valid, store, pair, offsets[:-1],
                         offsets[1:] - offsets[:-1], covered, enter, ends, carry)


def gather_heads(t: torch.Tensor, layout: SegmentLayout, index=None) -> torch.Tensor:
    """[b, l, k, ...] -> [S, k', Q, ...]: the tokens of every segment, head (or group) major, read
    from ``t`` as it is (a view of a wider buffer in place); ``index`` [k'] picks and orders the
    third dimension (default: all k). Empty slots hold token 0."""
    k = torch.arange(t.shape[2], device=t.device) if index is None else index
    return t[layout.row[:, None], layout.pos[:, None], k[None, :, None]]


def scatter_heads(v: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """[S, k, Q, ...] -> [b, l, k, ...]: every slot's value at its token (empty slots dropped;
    tokens no segment holds get 0). The inverse of ``gather_heads`` on the valid slots."""
    T = layout.batch * layout.length
    k = torch.arange(v.shape[1], device=v.device)[None, :, None]
    out = v.new_zeros(T + 1, *v.shape[1:2], *v.shape[3:])
    out.index_put_((layout.store[:, None], k), v)
    return out[:T].view(layout.batch, layout.length, *out.shape[1:])


class SegmentTerms(NamedTuple):
    """The per-segment operands and weights of the scan, in the compute dtype (h = g·r heads,
    head i in group i // r)."""

    dts: torch.Tensor        # [S, h, Q] dt (0 in empty slots)
    acum: torch.Tensor       # [S, h, Q] cumulative dt·A along the segment
    xs: torch.Tensor         # [S, h, Q, p] x (0 in empty slots)
    xdt: torch.Tensor        # [S, h, Q, p] dt·x
    Bh: torch.Tensor         # [S, h, Q, n] B of each head's group
    Ch: torch.Tensor         # [S, h, Q, n] C of each head's group
    Bs: torch.Tensor         # [S, g, Q, n] B of each group (a view of Bh)
    Cs: torch.Tensor         # [S, g, Q, n] C of each group (a view of Ch)
    w_start: torch.Tensor    # [S, h, Q] exp(min(acum_i, 0)): how much of H0 reaches y_i
    w_end: torch.Tensor      # [S, h, Q] exp(min(acum_last - acum_j, 0)): x_j's share of H1
    step: torch.Tensor       # [S, h] exp(min(acum_last, 0)): how much of H0 carries into H1

    def by_group(self, t: torch.Tensor) -> torch.Tensor:
        """[S, h, ...] -> [S, g, r, ...] (a view)."""
        g = self.Bs.shape[1]
        return t.view(t.shape[0], g, t.shape[1] // g, *t.shape[2:])


def segment_terms(x, dt, A, B, C, layout: SegmentLayout,
                  compute_dtype=torch.float32) -> SegmentTerms:
    """The SegmentTerms of x [b, l, h, p], the transformed dt [b, l, h] (``transform_dt``), A
    [h] and B, C [b, l, g, n]."""
    cd = compute_dtype
    h, g = x.shape[2], B.shape[2]
    present = layout.valid.to(cd)[:, None]                              # [S, 1, Q]
    dts = gather_heads(dt, layout).to(cd).mul_(present)
    xs = gather_heads(x, layout).to(cd).mul_(present[..., None])
    group = torch.arange(h, device=x.device) // (h // g)
    Bh, Ch = gather_heads(B, layout, group).to(cd), gather_heads(C, layout, group).to(cd)
    acum = torch.cumsum(dts * A.to(cd)[:, None], dim=-1)
    last = acum[..., -1]                                                # [S, h]
    w_start = torch.exp(torch.clamp(acum, max=0.0))
    w_end = torch.exp(torch.clamp(last[..., None] - acum, max=0.0))
    step = torch.exp(torch.clamp(last, max=0.0))
    if layout.enter is not None:
        w_start, w_end, step = w_start * layout.enter, w_end * layout.ends, step * layout.carry
    first_heads = slice(None, None, h // g)
    return SegmentTerms(dts, acum, xs, xs * dts[..., None], Bh, Ch, Bh[:, first_heads],
                        Ch[:, first_heads], w_start, w_end, step)


class PairTiles(NamedTuple):
    """The [segments, heads, Q, Q] tiles of the pairs' term of y (the largest tensors)."""

    decay: torch.Tensor      # [S, h, Q, Q] exp(min(acum_i - acum_j, 0)), every (i, j)
    cb: torch.Tensor         # [S, g, Q, Q] C_i·B_j on the pairs that count, else 0
    weights: torch.Tensor    # [S, h, Q, Q] decay · cb
    clamped: torch.Tensor | None   # [S, h, Q, Q] bool: acum_i - acum_j > 0 (when asked)


def pair_tiles(terms: SegmentTerms, layout: SegmentLayout, with_clamped: bool = False):
    """The PairTiles of a segment's terms; ``clamped`` only ``with_clamped`` (else None). The
    pairs that do not count are masked in C·B, not with -inf exponents (exp is slow there on
    x86), and the exponent is clamped to <= 0 (its gradient is 0 where it was positive)."""
    diff = terms.acum[..., :, None] - terms.acum[..., None, :]
    clamped = diff > 0 if with_clamped else None
    decay = diff.clamp_(max=0.0).exp_()
    cb = (terms.Cs @ terms.Bs.transpose(-1, -2)).masked_fill_(~layout.pair[:, None], 0.0)
    return PairTiles(decay, cb, (terms.by_group(decay) * cb[:, :, None]).flatten(1, 2), clamped)


def segment_states(terms: SegmentTerms) -> torch.Tensor:
    """Each segment's own contribution to H1, sum_j w_end_j dt_j x_j ⊗ B_j: [S, h, p, n]."""
    return (terms.xdt * terms.w_end[..., None]).transpose(-1, -2) @ terms.Bh


def pass_states(own: torch.Tensor, step: torch.Tensor, layout: SegmentLayout,
                initial_states=None):
    """(H0 [S, h, p, n], final [nseq, h, p, n]): the state entering every segment and each
    sequence's last H1, walking the sequences' segments side by side (``own``: segment_states,
    ``step``: SegmentTerms.step; initial_states [nseq, h, p, n] or None for zeros)."""
    S = own.shape[0]
    state = (own.new_zeros(layout.nseq, *own.shape[1:]) if initial_states is None
             else initial_states.to(own.dtype))
    entering = own.new_zeros(S + 1, *own.shape[1:])                     # row S: discarded
    for pos in range(layout.positions):
        active = pos < layout.count
        k = torch.where(active, layout.first + pos, torch.full_like(layout.first, S))
        entering.index_put_((k,), state)
        k = k.clamp(max=S - 1)
        stepped = step[k][..., None, None] * state + own[k]
        state = torch.where(active[:, None, None, None], stepped, state)
    return entering[:S], state


def rounded_states(entering: torch.Tensor, state_dtype) -> torch.Tensor:
    """The entering states as the output reads them: rounded to ``state_dtype`` (when it is
    not the compute dtype), the gradient passing the rounding unchanged."""
    if state_dtype is None or state_dtype == entering.dtype:
        return entering
    return entering + (entering.to(state_dtype).to(entering.dtype) - entering).detach()


def segment_output(terms: SegmentTerms, pairs: PairTiles, passed: torch.Tensor) -> torch.Tensor:
    """y of every slot before D and the gate [S, h, Q, p]: the pairs' sum plus w_start_i C_i·H0
    (``passed``: the entering states as read, ``rounded_states``)."""
    from_state = terms.Ch @ passed.transpose(-1, -2)                    # [S, h, Q, p]
    return (pairs.weights @ terms.xdt).addcmul_(terms.w_start[..., None], from_state)


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
    segment_start_states stay in compute_dtype). Differentiable by autograd."""
    b, l = x.shape[:2]
    cd = compute_dtype
    layout = segment_layout(b, l, chunk_size, cu_seqlens, seq_idx, status, x.device, cd)
    terms = segment_terms(x, transform_dt(dt, dt_bias, dt_softplus, dt_limit, cd), A, B, C,
                          layout, cd)
    entering, final = pass_states(segment_states(terms), terms.step, layout, initial_states)
    y_pre = scatter_heads(segment_output(terms, pair_tiles(terms, layout),
                                         rounded_states(entering, state_dtype)), layout)
    y_pre, y = gated_output(y_pre, x, D, z, layout.covered)
    return y.to(x.dtype), final, y_pre, entering


def gated_output(y_pre, x, D, z, covered):
    """(y before the gate, y) [b, l, h, p] in y_pre's dtype: y_pre + D·x (D [h] or [h, p]),
    then times silu(z); tokens outside ``covered`` (with cu_seqlens) get 0."""
    cd = y_pre.dtype
    if D is not None:
        y_pre = torch.addcmul(y_pre, D.to(cd)[:, None] if D.dim() == 1 else D.to(cd), x.to(cd))
    y = y_pre * F.silu(z.to(cd)) if z is not None else y_pre
    if covered is not None:    # tokens no sequence covers: y = 0, and no gradient flows back
        zero = torch.zeros((), dtype=cd, device=y.device)
        y_pre, y = torch.where(covered, y_pre, zero), torch.where(covered, y, zero)
    return y_pre, y


def chunk_scan_backward(x, dt, A, B, C, dy, chunk_size, D=None, z=None, dt_bias=None,
                        dt_softplus=False, dt_limit=DEFAULT_DT_LIMIT, initial_states=None,
                        cu_seqlens=None, dfinal_states=None, compute_dtype=torch.float32,
                        status=None, seq_idx=None, state_dtype=None):
    """The gradients of ``chunk_scan_forward``'s y (given dy [b, l, h, p]) and final_states
    (dfinal_states [nseq, h, p, n], or None for zero), computed by hand from its recomputed
    segment terms (``mamba2_backward``): a dict with dx, ddt, dA, dB, dC and, for the optional
    inputs given, dD, dz, ddt_bias, dinitial_states (all in compute_dtype, the shapes of their
    inputs). The options and the status reporting are the forward's."""
    b, l = x.shape[:2]
    cd = compute_dtype
    layout = segment_layout(b, l, chunk_size, cu_seqlens, seq_idx, status, x.device, cd)
    terms = segment_terms(x, transform_dt(dt, dt_bias, dt_softplus, dt_limit, cd), A, B, C,
                          layout, cd)
    pairs = pair_tiles(terms, layout, with_clamped=True)
    entering, _ = pass_states(segment_states(terms), terms.step, layout, initial_states)
    passed = rounded_states(entering, state_dtype)
    dy = dy.to(cd)
    if layout.covered is not None:
        dy = torch.where(layout.covered, dy, torch.zeros((), dtype=cd, device=dy.device))
    dz = dD = None
    if z is not None:                     # y before the gate, for dz (before the pairs' tiles go)
        y_pre, _ = gated_output(scatter_heads(segment_output(terms, pairs, passed), layout), x,
                                D, None, None)
        dy, dz = grad.gate_backward(dy, y_pre, z)
        del y_pre
    dys = gather_heads(dy, layout).mul_(layout.valid.to(cd)[:, None, :, None])  # [S, h, Q, p]
    del dy
    d_xdt, d_cb, d_a = grad.pairs_backward(terms, pairs, dys, layout.pair)
    del pairs                             # spent (d_cb holds C·B's memory): free the tiles
    d_xdt, dBs, dCs, d_a, d_initial = grad.state_gradients(
        terms, layout, entering, passed, dys, dfinal_states, d_xdt, d_cb, d_a)

    d_dts = (d_xdt * terms.xs).sum(-1).addcmul_(d_a, A.to(cd)[:, None])
    d_xs = d_xdt.mul_(terms.dts[..., None])                             # xdt = x·dt
    if D is not None:
        d_xs, dD = grad.skip_backward(d_xs, dys, terms.xs, D)
    ddt, ddt_bias = grad.transform_dt_backward(scatter_heads(d_dts, layout), dt, dt_bias,
                                               dt_softplus, dt_limit, cd)
    grads = dict(dx=scatter_heads(d_xs, layout), ddt=ddt, dA=(d_a * terms.dts).sum((0, 2)),
                 dB=scatter_heads(dBs, layout), dC=scatter_heads(dCs, layout), dD=dD, dz=dz,
                 ddt_bias=ddt_bias,
                 dinitial_states=d_initial if initial_states is not None else None)
    return {name: value for name, value in grads.items() if value is not None}


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
    """The hand-written gradients of ``chunk_scan_backward`` (dA, dD, ddt_bias added with
    accumulate)."""
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
