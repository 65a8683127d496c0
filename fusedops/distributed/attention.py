"""Context-parallel GQA attention: K/V all-gathered over the group (docs/distributed.md has the
communication model behind that choice), each local query piece attended to the keys it sees
with the existing plans.

Forward, per local piece of the layout: the all-gather of every rank's K/V starts
asynchronously; the piece attends to its own keys (causal: s_q = s_k) while it is in flight;
then to the keys of the earlier pieces (causal) or of every other piece (not causal), all
visible, and the two partial results are merged by their lse: lse = logaddexp(lse_1, lse_2),
o = Σ o_i·exp(lse_i − lse). With ``overlap=False`` each piece makes one call over its whole key
prefix instead (the plans' bottom-right causal alignment, s_q < s_k), after the gather.

Backward, per piece: one backward call over the piece's whole key set with the bottom-right
alignment, given the forward's (merged) o and lse, then a reduce-scatter of dK/dV to the ranks
that hold the keys. (A backward split like the forward's would let the reduce-scatter overlap
the own-keys call, but the plans' backward contract takes the o and lse of its own inputs: the
torch backend recomputes the softmax from the keys it is given.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..gqa_attention import gqa_attention_backward, gqa_attention_forward
from ..gqa_attention.contract import softmax_scale as expect_softmax_scale
from ..core.dtypes import accumulator_dtype
from ..core.options import expect_bool
from ..errors import ValidationError
from .collectives import (check_same_on_every_rank, expect_group_device, gather_into,
                          group_rank_world)
from .mamba2 import check_layout


def _calls(layout, rank: int, causal: bool, overlap: bool):
    """Per local piece: (global index, piece, local offset, [(key pieces, causal, local)])."""
    out = []
    for (index, piece), offset in zip(layout.local_pieces(rank), layout.local_offsets(rank)):
        if not piece.length:
            continue
        others = [i for i, p in enumerate(layout.pieces)
                  if p.length and i != index and (not causal or i < index)]
        if overlap:
            calls = [([index], causal, True)] + ([(others, False, False)] if others else [])
        else:
            calls = [(sorted(others + [index]), causal, False)]
        out.append((index, piece, offset, calls))
    return out


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, rank, world, group, causal, scale, backend, overlap):
        b, L, hq, d = q.shape
        hkv = k.shape[2]
        Lmax = layout.max_local_length
        send = k.new_zeros((2, b, Lmax, hkv, d))
        send[0, :, :L], send[1, :, :L] = k, v
        gathered = k.new_empty((world, 2, b, Lmax, hkv, d))
        work = gather_into(gathered.view(-1), send.view(-1), group=group, async_op=True)
        ctx.slots = {i: (p.rank, layout.local_offsets(p.rank)[
            [j for j, _ in layout.local_pieces(p.rank)].index(i)], p.length)
            for i, p in enumerate(layout.pieces)}
        plan = _calls(layout, rank, causal, overlap)
        options = dict(softmax_scale=scale, backend=backend)
        results = {}
        for q_index, piece, offset, calls in plan:
            for c, (keys, is_causal, local) in enumerate(calls):
                if local:
                    qs = q[:, offset:offset + piece.length].contiguous()
                    ks = k[:, offset:offset + piece.length].contiguous()
                    vs = v[:, offset:offset + piece.length].contiguous()
                    results[q_index, c] = gqa_attention_forward(qs, ks, vs, causal=is_causal, **options)
        work.wait()
        o_parts, lse_parts = [], []
        acc = accumulator_dtype(q.dtype)
        for q_index, piece, offset, calls in plan:
            qs = q[:, offset:offset + piece.length].contiguous()
            partial = []
            for c, (keys, is_causal, local) in enumerate(calls):
                if not local:
                    ks, vs = _keys(gathered, ctx.slots, keys)
                    results[q_index, c] = gqa_attention_forward(qs, ks, vs, causal=is_causal, **options)
                partial.append(results[q_index, c])
            if len(partial) == 1:
                o_j, lse_j = partial[0]
            else:
                lse_j = torch.logaddexp(partial[0][1], partial[1][1])
                o_j = sum(o.to(acc) * torch.exp(l - lse_j).transpose(1, 2)[..., None]
                          for o, l in partial).to(q.dtype)
            o_parts.append(o_j)
            lse_parts.append(lse_j)
        o = torch.cat(o_parts, 1) if o_parts else q.new_zeros(q.shape)
        lse = torch.cat(lse_parts, 2) if lse_parts else q.new_zeros((b, hq, 0), dtype=acc)
        ctx.save_for_backward(q, k, v, gathered, o, lse)
        ctx.setup = (plan, group, options, causal)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, gathered, o, lse = ctx.saved_tensors
        plan, group, options, causal = ctx.setup
        acc = accumulator_dtype(q.dtype)
        do = do.contiguous()
        send = torch.zeros(gathered.shape, dtype=acc, device=q.device)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        at = 0
        for q_index, piece, offset, calls in plan:
            rows = slice(offset, offset + piece.length)
            lse_j = lse[:, :, at:at + piece.length].contiguous()
            at += piece.length
            keys = sorted({i for keys, _, _ in calls for i in keys})
            ks, vs = _keys(gathered, ctx.slots, keys)
            g = gqa_attention_backward(q[:, rows].contiguous(), ks, vs, o[:, rows].contiguous(), lse_j,
                                       do[:, rows].contiguous(), causal=causal, **options)
            dq[:, rows] += g["dq"]
            _scatter(send, ctx.slots, keys, g["dk"], g["dv"])
        send = send.to(q.dtype)
        received = torch.empty_like(send)
        dist.all_to_all_single(received.view(-1), send.view(-1), group=group)
        L = q.shape[1]
        dk = received[0, 0, :, :L].to(acc, copy=True)
        dv = received[0, 1, :, :L].to(acc, copy=True)
        for part in received[1:]:
            dk += part[0, :, :L]
            dv += part[1, :, :L]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 8))


def _keys(gathered, slots, keys):
    """K and V [b, n, h_kv, d] of the global pieces ``keys`` (in order), contiguous."""
    parts = [(gathered[r, :, :, off:off + n]) for r, off, n in (slots[i] for i in keys)]
    kv = torch.cat(parts, 2) if len(parts) > 1 else parts[0]
    return kv[0].contiguous(), kv[1].contiguous()


def _scatter(send, slots, keys, dk, dv) -> None:
    at = 0
    for r, off, n in (slots[i] for i in keys):
        send[r, 0, :, off:off + n] += dk[:, at:at + n]
        send[r, 1, :, off:off + n] += dv[:, at:at + n]
        at += n


def context_parallel_gqa_attention(q, k, v, layout, *, causal: bool = True, softmax_scale=None,
                                   overlap: bool = True, group=None, backend: str = "auto",
                                   check_consistency: bool = True):
    """Differentiable GQA attention over a sequence split over the ranks of ``group``.

    Each rank passes its local part (``layout.shard``) of q [b, l, h_q, d] and k, v [b, l, h_kv,
    d] (l = ``layout.local_length(rank)``, 0 on an empty rank; bf16/fp16/fp32, float64 on the
    torch backend) and gets o [b, l, h_q, d] in q's dtype: attention over the whole sequence,
    causal by position (the layout's positions, whatever rank holds them) or not. With a
    ``SequenceLayout.zigzag`` layout every rank does the same causal work.

    Each rank all-gathers K/V (2·b·l_max·h_kv·d elements per rank, l_max the longest local
    part, asynchronous: the pieces' own-key attention runs meanwhile, then the lse merge) and
    saves q, k, v, o, lse and the gathered K/V for the backward, which makes one call per piece
    over its key prefix (bottom-right causal alignment) and reduce-scatters dK/dV (an
    all_to_all of the same size in q's dtype, then a sum in rank order: deterministic).
    ``overlap=False``: the forward also makes one call per piece, after the gather. o and the
    gradients are new tensors (no aliasing). Every rank must
    call it and backpropagate through o. ``check_consistency``: as in
    context_parallel_mamba2_scan.
    """
    rank, world = group_rank_world(group)
    for name, t, shape in (("q", q, "[b, l, h_q, d]"), ("k", k, "[b, l, h_kv, d]"),
                           ("v", v, "[b, l, h_kv, d]")):
        if t.ndim != 4:
            raise ValidationError(f"{name}: expected {shape}, got shape {list(t.shape)}")
        check_layout(layout, world, rank, name, t, 1, shape)
        expect_group_device(name, t, group)
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValidationError(f"k, v: expected [b, l, h_kv, d] with b, d like q {list(q.shape)}, got "
                              f"k {list(k.shape)}, v {list(v.shape)}")
    causal, overlap = expect_bool("causal", causal), expect_bool("overlap", overlap)
    softmax_scale = expect_softmax_scale("softmax_scale", softmax_scale)
    if check_consistency:
        b, _, hq, d = q.shape
        check_same_on_every_rank(dict(
            layout=layout.key, q=("[b, ., h_q, d]", b, hq, d, str(q.dtype)),
            k=("[b, ., h_kv, d]", k.shape[2], str(k.dtype)),
            options=(causal, softmax_scale, overlap)), group, q.device)
    o = _ContextParallelAttention.apply(q, k, v, layout, rank, world, group, causal, softmax_scale,
                                        backend, overlap)
    return o
