"""The Mamba2 mixer's causal depthwise convolution over a sequence split across ranks: each
piece needs the K − 1 positions before it, which live on other pieces (other ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .collectives import all_gather, tie
from .layout import SequenceLayout


def causal_conv1d(xbc: torch.Tensor, weight: torch.Tensor, bias, layout: SequenceLayout, rank: int,
                  group) -> torch.Tensor:
    """Depthwise causal convolution of this rank's part xbc [b, l, c] of the sequence (the
    layout's positions; zero history before position 0) with weight [c, 1, K] and bias [c] or
    None: [b, l, c], a new tensor.

    One all-gather of each local piece's last K − 1 positions ((K − 1)·b·c elements per piece),
    from which every piece takes the positions before it; the backward reduce-scatters their
    gradient to the ranks that hold them."""
    b, _, c = xbc.shape
    K = weight.shape[-1]
    halo = K - 1
    if halo == 0:
        return F.conv1d(xbc.transpose(1, 2), weight, bias, groups=c).transpose(1, 2)
    P = layout.max_pieces
    local = list(zip(layout.local_pieces(rank), layout.local_offsets(rank)))
    tails = xbc.new_zeros((P, b, halo, c))
    parts = [tails[j] for j in range(P)]
    for j, ((_, piece), offset) in enumerate(local):
        keep = min(piece.length, halo)
        if keep:
            parts[j] = torch.cat([tails[j, :, :halo - keep], xbc[:, offset + piece.length - keep:
                                                                   offset + piece.length]], 1)
    gathered = all_gather(torch.stack(parts), group, (xbc, weight, bias))  # [W, P, b, K-1, c]
    rows = gathered.permute(0, 1, 3, 2, 4).reshape(-1, b, c)                 # [W·P·(K-1), b, c]
    rows = torch.cat([rows, rows.new_zeros((1, b, c))])
    where = {}
    for r in range(layout.world):
        for slot, (q, _) in enumerate(layout.local_pieces(r)):
            where[q] = r * P + slot
    starts = [p.start for p in layout.pieces]
    out = []
    for (q, piece), offset in local:
        if not piece.length:
            continue
        index = []
        for position in range(piece.start - halo, piece.start):
            holder = max((i for i, p in enumerate(layout.pieces) if p.length and p.start <= position),
                         default=None) if position >= 0 else None
            if holder is None:
                index.append(rows.shape[0] - 1)
            else:
                end = starts[holder] + layout.pieces[holder].length
                index.append(where[holder] * halo + halo - (end - position))
        before = rows.index_select(0, torch.tensor(index, device=xbc.device)).transpose(0, 1)
        sequence = torch.cat([before, xbc[:, offset:offset + piece.length]], 1).transpose(1, 2)
        out.append(F.conv1d(sequence, weight, bias, groups=c).transpose(1, 2))
    result = torch.cat(out, 1) if out else xbc.new_zeros(xbc.shape)
    return tie(result, gathered)
