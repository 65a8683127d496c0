"""Host metadata of a context-parallel Mamba2 scan: which local segments a rank scans, which of
them continue a sequence begun on an earlier piece, and which final states it owns.

A *stream* is one chain of states across the pieces: a batch row (dense, S = b streams) or the
one packed stream (varlen, S = 1, where only the sequence crossing a piece boundary carries a
state across it). Each local piece j is scanned from a zero state (a sequence that starts in it
takes its own initial state); what leaves it is ``carry_out = alpha_j · carry_in + f_j`` per
stream, with f_j the final state of its last segment and alpha_j the total decay of its first
segment when that one segment covers the whole piece and continues (else 0; 1 for an empty
piece, which passes the carry through).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ValidationError
from .layout import SequenceLayout


@dataclass(frozen=True)
class Segment:
    """A local scan sequence: ``length`` tokens from ``start`` of the packed local stream (dense:
    row·L + offset), part of global sequence ``sequence``; ``fresh`` when the sequence starts
    here (it takes its initial state), else it continues one begun on an earlier piece."""

    start: int
    length: int
    sequence: int
    fresh: bool


@dataclass(frozen=True)
class PieceScan:
    """One local piece: ``offset``, ``length`` along the local sequence axis; ``continues`` when
    its first ``first_length`` tokens continue a sequence from an earlier piece (they get the
    carried-in state's contribution); ``spans`` when that sequence also covers the whole piece
    (the carry passes through with its decay); ``last`` the segment index per stream whose final
    state leaves the piece (empty when no sequence covers its end)."""

    offset: int
    length: int
    continues: bool
    first_length: int
    spans: bool
    last: tuple[int, ...]


@dataclass(frozen=True)
class LocalScan:
    """What one rank computes. ``owned``: (global sequence, segment index, local piece whose
    carry it adds or None) of each final state this rank returns; ``global_pieces``: the global
    index of each local piece."""

    streams: int
    segments: tuple[Segment, ...]
    pieces: tuple[PieceScan, ...]
    global_pieces: tuple[int, ...]
    owned: tuple[tuple[int, int, int | None], ...]
    num_sequences: int

    @property
    def local_cu_seqlens(self) -> list[int]:
        """Offsets of the segments in the packed local stream (they tile a prefix of it)."""
        return [0] + [s.start + s.length for s in self.segments]


def host_offsets(cu_seqlens, total: int) -> list[int]:
    """cu_seqlens (a 1-D int tensor or a sequence of ints) as a list, checked: starts at 0,
    never decreases, ends at most at ``total``, at least one sequence."""
    if hasattr(cu_seqlens, "tolist"):
        if getattr(cu_seqlens, "ndim", 1) != 1:
            raise ValidationError(f"cu_seqlens: expected a 1-D [nseq + 1] tensor, got shape "
                                  f"{list(cu_seqlens.shape)}")
        values = [int(v) for v in cu_seqlens.tolist()]
    else:
        values = [int(v) for v in cu_seqlens]
    if len(values) < 2:
        raise ValidationError(f"cu_seqlens: expected [nseq + 1] offsets with nseq >= 1, got {values}")
    if values[0] != 0:
        raise ValidationError(f"cu_seqlens: expected cu_seqlens[0] = 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValidationError(f"cu_seqlens: expected non-decreasing offsets, got cu_seqlens[{i}] = "
                                  f"{values[i]} < cu_seqlens[{i - 1}] = {values[i - 1]}")
    if values[-1] > total:
        raise ValidationError(f"cu_seqlens: expected offsets up to the layout's {total} positions, "
                              f"got cu_seqlens[{len(values) - 1}] = {values[-1]}")
    return values


def dense_scan(layout: SequenceLayout, rank: int, batch: int) -> LocalScan:
    """Every batch row is one sequence over the whole layout."""
    local = layout.local_pieces(rank)
    L = layout.local_length(rank)
    nonempty = [i for i, p in enumerate(layout.pieces) if p.length]
    last_piece = nonempty[-1] if nonempty else None
    segments, index = [], {}
    for row in range(batch):
        offset = 0
        for j, (q, piece) in enumerate(local):
            if piece.length:
                index[row, j] = len(segments)
                segments.append(Segment(row * L + offset, piece.length, row, piece.start == 0))
            offset += piece.length
    pieces, owned, offset = [], [], 0
    for j, (q, piece) in enumerate(local):
        continues = piece.length > 0 and piece.start > 0
        last = tuple(index[row, j] for row in range(batch)) if piece.length else ()
        pieces.append(PieceScan(offset, piece.length, continues, piece.length, continues, last))
        if q == last_piece:
            owned = [(row, index[row, j], j if continues else None) for row in range(batch)]
        offset += piece.length
    return LocalScan(batch, tuple(segments), tuple(pieces), tuple(q for q, _ in local),
                     tuple(owned), batch)


def varlen_scan(layout: SequenceLayout, rank: int, cu: Sequence[int]) -> LocalScan:
    """Packed sequences (offsets ``cu`` over the layout's positions) in one stream. A sequence's
    final state is owned by the piece holding its last token (an empty sequence: the piece
    holding the token at its offset, or the last token)."""
    total, nseq = layout.total, len(cu) - 1
    if total == 0:
        raise ValidationError("layout: expected at least one position with packed sequences, got 0")
    starts = [p.start for p in layout.pieces if p.length]
    holders = [i for i, p in enumerate(layout.pieces) if p.length]

    def piece_of(token: int) -> int:
        return holders[bisect.bisect_right(starts, token) - 1]

    def sequence_at(token: int) -> int | None:
        if token >= cu[-1]:
            return None
        return bisect.bisect_right(cu, token) - 1

    owner = [piece_of(cu[s + 1] - 1) if cu[s + 1] > cu[s] else piece_of(min(cu[s], total - 1))
             for s in range(nseq)]
    segments, pieces, owned, offset = [], [], [], 0
    local = layout.local_pieces(rank)
    for j, (q, piece) in enumerate(local):
        a, e = piece.start, piece.end
        first = sequence_at(a) if piece.length else None
        last_seq = sequence_at(e - 1) if piece.length else None
        first_index = last_index = None
        for s in range(nseq if piece.length else 0):
            overlaps = cu[s] < e and cu[s + 1] > a
            if not overlaps and not (cu[s] == cu[s + 1] and owner[s] == q):
                continue
            lo = min(max(cu[s], a), e)
            hi = max(min(cu[s + 1], e), lo)
            if s == first:
                first_index = len(segments)
            if s == last_seq:
                last_index = len(segments)
            if owner[s] == q:
                owned.append((s, len(segments), j if (s == first and cu[s] < a) else None))
            segments.append(Segment(offset + lo - a, hi - lo, s, cu[s] >= a))
        continues = first is not None and cu[first] < a
        first_length = segments[first_index].length if first_index is not None else 0
        spans = continues and first == last_seq
        last = (last_index,) if last_index is not None else ()
        pieces.append(PieceScan(offset, piece.length, continues, first_length, spans, last))
        offset += piece.length
    return LocalScan(1, tuple(segments), tuple(pieces), tuple(q for q, _ in local), tuple(owned),
                     nseq)
