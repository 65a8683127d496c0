"""Context-parallel Mamba2 chunked scan: the chunked SSD state passing, one level up.

Each rank scans its pieces of the sequence from a zero state with the existing differentiable
op (``fusedops.ops.mamba2_chunk_scan``), keeping each piece's final state f and the total decay
alpha of its first segment; one all-gather exchanges (f, alpha) — h·p·n + h floats per stream
and piece; every rank combines the prefix of the pieces before its own into their true initial
states (carry_in(q) = sum over q' < q of (prod over q' < u < q of alpha_u) · f_q'), and corrects
its outputs: y_t += C_t · exp(cumsum(dt·A) up to t) · carry_in (the term a zero initial state
left out), before the optional gate. The backward is autograd's: the all-gather's adjoint is a
reduce-scatter (each piece's f and alpha get the gradient every later piece's carry sent back),
so dinitial_states of a piece flows back to the pieces before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.dtypes import accumulator_dtype
from ..errors import ValidationError
from ..mamba2_scan import Mamba2ChunkScanForward
from ..mamba2_scan.contract import DEFAULT_CHUNK_SIZE, DEFAULT_DT_LIMIT
from ..ops import mamba2_chunk_scan
from .collectives import (all_gather, check_same_on_every_rank, expect_group_device,
                          group_rank_world, tie)
from .layout import SequenceLayout
from .scan_sharding import LocalScan, dense_scan, host_offsets, varlen_scan


def check_layout(layout, world: int, rank: int, name: str, tensor: torch.Tensor, dim: int,
                 shape: str) -> None:
    """The layout is a SequenceLayout over ``world`` ranks and ``tensor`` holds this rank's part."""
    if not isinstance(layout, SequenceLayout):
        raise ValidationError(f"layout: expected a fusedops.distributed.SequenceLayout, got "
                              f"{type(layout).__name__}")
    if layout.world != world:
        raise ValidationError(f"layout: expected a layout over the group's {world} ranks, got one "
                              f"over {layout.world}")
    local = layout.local_length(rank)
    if tensor.shape[dim] != local:
        raise ValidationError(f"{name}: expected {shape} with {local} positions (rank {rank}'s part "
                              f"of the layout) along dim {dim}, got {list(tensor.shape)}")


def decay_log(dt, A, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """dt·A per token and head [b, l, h], in A's dtype (fp32; fp64 at reference precision),
    with the scan's dt transform (bias, softplus above 20 the identity, the clamp passing the
    gradient at its bounds)."""
    u = dt.to(A.dtype)
    if dt_bias is not None:
        u = u + dt_bias
    if dt_softplus:
        u = F.softplus(u, threshold=20.0)
    u = torch.clamp(u, dt_limit[0], dt_limit[1])
    return u * A


def _local_initial_states(plan: LocalScan, initial_states, like: torch.Tensor):
    """[nseg, h, p, n]: a fresh segment's initial state, zero for a continuing one; None when
    no initial state is given."""
    if initial_states is None:
        return None
    zero = initial_states.new_zeros((1, *initial_states.shape[1:]))
    table = torch.cat([initial_states, zero])
    index = [s.sequence if s.fresh else len(initial_states) for s in plan.segments]
    return table.index_select(0, torch.tensor(index, device=table.device)).contiguous()


def context_parallel_mamba2_scan(x, dt, A, B, C, layout: SequenceLayout,
                                 chunk_size: int = DEFAULT_CHUNK_SIZE, *, D=None, z=None,
                                 dt_bias=None, dt_softplus: bool = False,
                                 dt_limit=DEFAULT_DT_LIMIT, initial_states=None, cu_seqlens=None,
                                 group=None, backend: str = "auto",
                                 check_consistency: bool = True):
    """Differentiable Mamba2 chunked scan of a sequence split over the ranks of ``group``.

    Each rank passes its local part (``layout.shard``) of x [b, l, h, p], dt [b, l, h], B, C
    [b, l, g, n] and z [b, l, h, p] (optional), l = ``layout.local_length(rank)`` (0 on an empty
    rank), the replicated A [h], D, dt_bias, and the options of ``fusedops.ops.mamba2_chunk_scan``.
    Dense (no cu_seqlens): every batch row is one sequence over the whole layout, and
    initial_states is [b, h, p, n]. Packed: b = 1 and ``cu_seqlens`` holds the global offsets
    [nseq + 1] over the layout's positions (a host sequence of ints or a tensor, read on the
    host; starting at 0, non-decreasing, ending at most at ``layout.total``); sequences may
    cross piece and rank boundaries; initial_states is [nseq, h, p, n].

    Returns (y [b, l, h, p] in x's dtype, final_states [nseq, h, p, n] fp32). A rank's
    final_states rows hold the sequences whose last token it holds (an empty sequence: the rank
    holding the token at its offset, or the last token); the other rows are 0, so a sum over the
    group gives every final state. Gradients flow to every input; those of the replicated A, D,
    dt_bias and initial_states are this rank's share: sum them over the group. Deterministic
    (fixed-order sums), bitwise run to run at a fixed layout.

    Collectives: one consistency check (an all-gather of a few int64s, skipped with
    ``check_consistency=False``), one all-gather of (4·h·p·n + 4·h)·S bytes per local piece in
    the forward (S = b streams dense, 1 packed) and its reduce-scatter in the backward. Every
    rank must call it (an empty rank too) and backpropagate through its outputs. Nothing aliases
    the inputs; the local scan saves what ``mamba2_chunk_scan`` saves.
    """
    rank, world = group_rank_world(group)
    if x.ndim != 4:
        raise ValidationError(f"x: expected [b, l, h, p], got shape {list(x.shape)}")
    check_layout(layout, world, rank, "x", x, 1, "[b, l, h, p]")
    expect_group_device("x", x, group)
    b, L, h, p = x.shape
    if B.ndim != 4:
        raise ValidationError(f"B: expected [b, l, g, n], got shape {list(B.shape)}")
    g, n = B.shape[2], B.shape[3]
    options = Mamba2ChunkScanForward.normalise_options(
        dict(chunk_size=chunk_size, dt_softplus=dt_softplus, dt_limit=dt_limit))
    cu = None
    if cu_seqlens is not None:
        if b != 1:
            raise ValidationError(f"x: expected b == 1 with cu_seqlens (packed sequences), got b = {b}")
        cu = host_offsets(cu_seqlens, layout.total)
    if check_consistency:
        check_same_on_every_rank(dict(
            layout=layout.key, cu_seqlens=cu, x=("[b, ., h, p]", b, h, p, str(x.dtype)),
            B=("[b, ., g, n]", g, n), A=str(A.dtype), options=tuple(options.items()),
            optional_inputs=tuple(t is not None for t in (D, z, dt_bias, initial_states))),
            group, x.device)
    plan = dense_scan(layout, rank, b) if cu is None else varlen_scan(layout, rank, cu)
    S = plan.streams

    if plan.segments:
        packed = [t.contiguous().view(1, b * L, *t.shape[2:]) for t in (x, dt, B, C)]
        local_cu = torch.tensor(plan.local_cu_seqlens, dtype=torch.int32, device=x.device)
        y0, final_local = mamba2_chunk_scan(
            *packed[:2], A, *packed[2:], options["chunk_size"], D=D, dt_bias=dt_bias,
            dt_softplus=options["dt_softplus"], dt_limit=options["dt_limit"],
            initial_states=_local_initial_states(plan, initial_states, x), cu_seqlens=local_cu,
            backend=backend)
        y0 = y0.view(b, L, h, p)
    else:
        y0, final_local = x.new_zeros(x.shape), None

    decays = {}
    for j, piece in enumerate(plan.pieces):
        if piece.continues:
            span = slice(piece.offset, piece.offset + piece.first_length)
            log_decay = decay_log(dt[:, span], A, dt_bias, options["dt_softplus"], options["dt_limit"])
            decays[j] = torch.exp(torch.clamp(torch.cumsum(log_decay, 1), max=0.0))   # [S, len, h]

    payload = []
    for j in range(layout.max_pieces):
        piece = plan.pieces[j] if j < len(plan.pieces) else None
        f = x.new_zeros((S, h, p, n), dtype=A.dtype)
        alpha = x.new_ones((S, h), dtype=A.dtype)
        if piece is not None and piece.length:
            if piece.last:
                f = final_local.index_select(0, torch.tensor(piece.last, device=x.device))
            alpha = decays[j][:, -1] if piece.spans else torch.zeros_like(alpha)
        payload.append(torch.cat([f.reshape(S, h, p * n), alpha[..., None]], -1))
    anchors = (x, dt, A, B, C, D, z, dt_bias, initial_states)
    gathered = all_gather(torch.stack(payload), group, anchors)      # [W, P, S, h, p·n + 1]

    carries = _carries(layout, plan, gathered.view(-1, S, h, p * n + 1), (S, h, p, n))
    y = _corrected(y0, z, plan, decays, carries, C, g)
    final = _final_states(plan, final_local, decays, carries, (h, p, n), A.dtype, x.device)
    return tie(y, gathered), tie(final, gathered)


def _carries(layout, plan: LocalScan, table, shape) -> dict[int, torch.Tensor]:
    """carry_in [S, h, p, n] of each local piece that continues a sequence, from the gathered
    (f, alpha) of every piece, combined in sequence order."""
    wanted = {plan.global_pieces[j]: j for j, piece in enumerate(plan.pieces) if piece.continues}
    if not wanted:
        return {}
    S, h, p, n = shape
    where = {}
    for r in range(layout.world):
        for slot, (q, _) in enumerate(layout.local_pieces(r)):
            where[q] = r * layout.max_pieces + slot
    carries, state = {}, None
    for q in range(max(wanted) + 1):
        if q in wanted:
            carries[wanted[q]] = state if state is not None else table.new_zeros(shape)
        row = table[where[q]]
        f, alpha = row[..., :-1].reshape(shape), row[..., -1]
        state = f if state is None else alpha[..., None, None] * state + f
    return carries


def _state_term(C, carry, decay, g: int) -> torch.Tensor:
    """C_t · carry per head, times the decay: [S, len, h, p] fp32."""
    S, T = C.shape[:2]
    _, h, p, n = carry.shape
    grouped = carry.view(S, g, h // g, p, n)
    term = torch.einsum("stgn,sgkpn->stgkp", C.to(carry.dtype), grouped).reshape(S, T, h, p)
    return term * decay[..., None]


def _corrected(y0, z, plan: LocalScan, decays, carries, C, g: int) -> torch.Tensor:
    if not carries and z is None:
        return y0
    dtype, acc = y0.dtype, accumulator_dtype(y0.dtype)
    y = y0.to(acc)
    if carries:
        parts, at = [], 0
        for j in sorted(carries):
            piece = plan.pieces[j]
            lo, hi = piece.offset, piece.offset + piece.first_length
            parts += [y[:, at:lo], y[:, lo:hi] + _state_term(C[:, lo:hi], carries[j], decays[j], g)]
            at = hi
        parts.append(y[:, at:])
        y = torch.cat(parts, 1)
    if z is not None:
        y = y * F.silu(z.to(acc))
    return y.to(dtype)


def _final_states(plan: LocalScan, final_local, decays, carries, shape, dtype, device) -> torch.Tensor:
    """[nseq, h, p, n]: the owned sequences' final states (a continuing one's carried-in term
    added), 0 for the others."""
    rows = [None] * plan.num_sequences
    for sequence, segment, j in plan.owned:
        row = final_local[segment]
        if j is not None:
            stream = sequence if plan.streams > 1 else 0
            row = row + decays[j][stream, -1][:, None, None] * carries[j][stream]
        rows[sequence] = row
    zero = torch.zeros(shape, dtype=dtype, device=device)
    return torch.stack([zero if r is None else r for r in rows])
