"""The expert-parallel dispatch's routing tables, computed on the device from topk_ids.

Experts are sharded contiguously: rank d holds experts [d·E_l, (d + 1)·E_l). A token is sent
once to each rank holding at least one of its experts (a *send row*), with its k ids rewritten
to that rank's local ids (−1 where the expert lives elsewhere: padding the expert plans skip)
and its k routing weights. Send rows are ordered by destination rank, then by token, so the
receiver sees them ordered by source rank, then token: every order is fixed by the routing,
which makes the dispatch, the experts and the combine deterministic.

Dropless: rank d gets every row for it; the row counts are exchanged and read on the host (the
all_to_all split sizes). Capacity C: each (source, destination) pair has C row slots; a
token's rows past the first C for a rank are dropped (its experts there contribute nothing and
get no gradient), unused slots are padding (ids −1): fixed split sizes, no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """One call's tables. ``rows`` = the send-row bound (sentinel index of the zero row).

    src [rows + 1] int64: the token of each send row (−1: unused); dest [rows + 1] int64: its
    destination rank; slots [t, min(k, world)] int64: the send rows of each token in rank order
    (``rows`` where there are fewer); assignment_rows [t, k] int64: the send row carrying
    assignment (t, j) (``rows`` when dropped); counts [world] int64: rows per destination."""

    src: torch.Tensor
    dest: torch.Tensor
    slots: torch.Tensor
    assignment_rows: torch.Tensor
    counts: torch.Tensor


def route(topk_ids: torch.Tensor, experts_per_rank: int, world: int, rows: int,
          capacity: int | None) -> Routing:
    """The tables for ``topk_ids`` [t, k] (global ids; ids outside [0, E) are dropped)."""
    t, k = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < experts_per_rank * world)
    dest = torch.where(valid, torch.div(ids, experts_per_rank, rounding_mode="floor"), world)
    hit = torch.zeros(t, world + 1, dtype=torch.bool, device=device).scatter_(1, dest, True)[:, :world]
    position = torch.cumsum(hit.long(), 0) - 1
    ranks = torch.arange(world, device=device)
    if capacity is None:
        counts = hit.sum(0)
        row = torch.cumsum(counts, 0) - counts + position
    else:
        hit = hit & (position < capacity)
        counts = hit.sum(0)
        row = ranks * capacity + position
    row = torch.where(hit, row, rows)
    flat = row.reshape(-1)
    src = torch.full((rows + 1,), -1, dtype=torch.long, device=device)
    src.scatter_(0, flat, torch.arange(t, device=device).repeat_interleave(world))
    src[rows] = -1
    dest_of_row = torch.full((rows + 1,), world, dtype=torch.long, device=device)
    dest_of_row.scatter_(0, flat, ranks.repeat(t))
    dest_of_row[rows] = world
    slots = torch.sort(row, 1).values[:, :min(k, world)]
    assignment_rows = torch.where(valid, row.gather(1, dest.clamp(max=world - 1)), rows)
    return Routing(src, dest_of_row, slots, assignment_rows, counts)


def send_metadata(routing: Routing, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  experts_per_rank: int, n: int) -> torch.Tensor:
    """[n, k + k·w/4] int32 of the first n send rows (w: the routing weights' element size):
    the local ids (−1: elsewhere or unused), then the routing weights' bits (0 where the id is
    −1)."""
    src, dest = routing.src[:n], routing.dest[:n]
    used = src >= 0
    token = src.clamp(min=0)
    ids = topk_ids.long().index_select(0, token)
    here = (torch.div(ids, experts_per_rank, rounding_mode="floor") == dest[:, None]) & \
        (ids >= 0) & used[:, None]
    local = torch.where(here, ids - dest[:, None] * experts_per_rank, -1).to(torch.int32)
    weights = torch.where(here, topk_weights.index_select(0, token), 0).to(topk_weights.dtype)
    return torch.cat([local, weights.contiguous().view(torch.int32)], 1)


def combine(rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = sum over m of rows[slots[t, m]] (rows' last row is zero), in fp32 (fp64 for
    fp64) in slot order, rounded once into ``out``."""
    acc = torch.zeros(out.shape, dtype=torch.float64 if out.dtype == torch.float64 else torch.float32,
                      device=out.device)
    for m in range(slots.shape[1]):
        acc += rows.index_select(0, slots[:, m])
    out.copy_(acc)
