"""How a sequence is split over the ranks of a context-parallel group (host metadata only)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ValidationError


@dataclass(frozen=True)
class Piece:
    """Positions [start, start + length) of the global sequence, held by ``rank``."""

    start: int
    length: int
    rank: int

    @property
    def end(self) -> int:
        """One past the piece's last position."""
        return self.start + self.length


def _count(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValidationError(f"{name}: expected an int >= 0, got {value!r}")
    return int(value)


class SequenceLayout:
    """The split of a sequence of ``total`` positions into pieces, each held by one rank.

    Pieces tile [0, total) in order; piece i holds ``lengths[i]`` positions and belongs to
    ``ranks[i]``. A rank's local tensor is the concatenation of its pieces in sequence order
    (``shard``), so a rank holds ``local_length(rank)`` positions; pieces may be empty, and a
    rank may hold none (an empty rank). Every rank of a group must build the same layout (the
    distributed operators check it).

    - ``SequenceLayout.contiguous(lengths)``: rank r holds one contiguous piece of lengths[r].
    - ``SequenceLayout.zigzag(total, world)``: 2·world chunks as equal as possible; rank r holds
      chunks r and 2·world − 1 − r, so under a causal mask every rank has the same work.
    """

    def __init__(self, lengths: Sequence[int], ranks: Sequence[int], world: int) -> None:
        world = _count("world", world)
        if world < 1:
            raise ValidationError(f"world: expected an int >= 1, got {world}")
        lengths = [_count(f"lengths[{i}]", n) for i, n in enumerate(lengths)]
        ranks = [_count(f"ranks[{i}]", r) for i, r in enumerate(ranks)]
        if len(lengths) != len(ranks) or not lengths:
            raise ValidationError(f"ranks: expected one rank per piece ({len(lengths)} pieces), got "
                                  f"{len(ranks)}")
        for i, r in enumerate(ranks):
            if r >= world:
                raise ValidationError(f"ranks[{i}]: expected a rank in [0, {world}), got {r}")
        pieces, start = [], 0
        for n, r in zip(lengths, ranks):
            pieces.append(Piece(start, n, r))
            start += n
        self.world, self.total, self.pieces = world, start, tuple(pieces)

    @classmethod
    def contiguous(cls, lengths: Sequence[int]) -> SequenceLayout:
        """Rank r holds positions [sum(lengths[:r]), sum(lengths[:r + 1]))."""
        lengths = list(lengths)
        return cls(lengths, range(len(lengths)), len(lengths))

    @classmethod
    def zigzag(cls, total: int, world: int) -> SequenceLayout:
        """2·world chunks of total // (2·world) positions (the first total % (2·world) one more);
        rank r holds chunks r and 2·world − 1 − r (the two-chunk causal load balance)."""
        total, world = _count("total", total), _count("world", world)
        if world < 1:
            raise ValidationError(f"world: expected an int >= 1, got {world}")
        base, extra = divmod(total, 2 * world)
        lengths = [base + (c < extra) for c in range(2 * world)]
        ranks = [c if c < world else 2 * world - 1 - c for c in range(2 * world)]
        return cls(lengths, ranks, world)

    # -- per rank ----------------------------------------------------------------------------------
    def local_pieces(self, rank: int) -> tuple[tuple[int, Piece], ...]:
        """(global piece index, piece) of ``rank``'s pieces, in sequence order."""
        return tuple((i, p) for i, p in enumerate(self.pieces) if p.rank == rank)

    def local_length(self, rank: int) -> int:
        """Positions ``rank`` holds."""
        return sum(p.length for _, p in self.local_pieces(rank))

    def local_offsets(self, rank: int) -> tuple[int, ...]:
        """Where each of ``rank``'s pieces starts in its local tensor."""
        offsets, at = [], 0
        for _, p in self.local_pieces(rank):
            offsets.append(at)
            at += p.length
        return tuple(offsets)

    @property
    def max_pieces(self) -> int:
        """The most pieces any rank holds."""
        return max(len(self.local_pieces(r)) for r in range(self.world))

    @property
    def max_local_length(self) -> int:
        """The most positions any rank holds."""
        return max(self.local_length(r) for r in range(self.world))

    @property
    def key(self) -> tuple:
        """What identifies the layout (compared across ranks)."""
        return ("SequenceLayout", self.world, tuple((p.length, p.rank) for p in self.pieces))

    # -- tensors -----------------------------------------------------------------------------------
    def shard(self, tensor: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """``rank``'s local part of a full-sequence ``tensor`` (sequence along ``dim``): its
        pieces concatenated in order (a new contiguous tensor)."""
        if tensor.shape[dim] != self.total:
            raise ValidationError(f"tensor: expected {self.total} positions along dim {dim}, got "
                                  f"{tensor.shape[dim]}")
        parts = [tensor.narrow(dim, p.start, p.length) for _, p in self.local_pieces(rank)]
        if not parts:
            return tensor.narrow(dim, 0, 0).contiguous()
        return torch.cat(parts, dim).contiguous()

    def unshard(self, shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The full sequence from every rank's local tensor (``shards[r]`` of rank r)."""
        if len(shards) != self.world:
            raise ValidationError(f"shards: expected one tensor per rank ({self.world}), got {len(shards)}")
        parts = []
        for i, piece in enumerate(self.pieces):
            index = [j for j, _ in self.local_pieces(piece.rank)].index(i)
            offset = self.local_offsets(piece.rank)[index]
            parts.append(shards[piece.rank].narrow(dim, offset, piece.length))
        return torch.cat(parts, dim)

    def __repr__(self) -> str:
        pieces = ", ".join(f"[{p.start}, {p.end})@{p.rank}" for p in self.pieces)
        return f"SequenceLayout(total={self.total}, world={self.world}: {pieces})"

    def __eq__(self, other) -> bool:
        return isinstance(other, SequenceLayout) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)
