"""Mamba2 chunked scan (Triton): the buffers the forward and backward programs declare: what
the forward saves for the backward and each direction's workspace pieces (docs/mamba2_scan.md, "What
the forward saves, what the backward recomputes")."""

from __future__ import annotations

import torch

from fusedops.core.workspace import Layout

from .tiles import Tiles, counts, tiles


def _varlen(problem) -> bool:
    return problem.num_sequences is not None


def saved_layout(problem) -> Layout:
    """What the forward saves for the backward: the state entering every segment in the plan's
    state dtype (max_segments·h·p·n, unless recompute_states) and y before the z gate (b·l·h·p
    in x's dtype, with z). The backward program declares the same layout."""
    return Layout([
        ("states", problem.state_dtype, 0 if problem.recompute_states else
         problem.max_segments * problem.heads * problem.head_dim * problem.state),
        ("ypre", problem.dtype, problem.batch * problem.length * problem.heads * problem.head_dim
         if problem.has_z else 0),
    ])


def _forward_pieces(problem) -> list:
    """The forward workspace's pieces, which the backward recomputes into its own."""
    S, H, Q = problem.max_segments, problem.heads, problem.chunk
    return [
        ("cu", torch.int32, problem.sequences + 1 if _varlen(problem) else 0),
        ("offsets", torch.int32, problem.sequences + 1 if _varlen(problem) else 0),
        ("runs", torch.int32, problem.batch * problem.length if problem.has_seq_idx else 0),
        ("dts", torch.float32, S * H * Q),
        ("acum", torch.float32, S * H * Q),
        ("cb", torch.float32, S * problem.groups * Q * Q),
        ("states", problem.state_dtype,
         S * H * problem.head_dim * problem.state if problem.recompute_states else 0),
    ]


def forward_workspace(problem) -> Layout:
    """Varlen: the sanitised cu_seqlens and the segment table; sequence ids: the run of every
    token; the transformed dt and its cumulative log-decay per segment, C·B per group, and the
    segment states when they are not saved."""
    return Layout(_forward_pieces(problem))


def backward_workspace(problem, t: Tiles | None = None) -> Layout:
    """The forward workspace recomputed (and the states and final states when recomputed), the
    gate's dy, the segment-state gradients and fixed-order partial sums."""
    S, H, P, N, Q = (problem.max_segments, problem.heads, problem.head_dim, problem.state,
                     problem.chunk)
    c = counts(problem, t or tiles(problem))
    recompute = problem.recompute_states
    pairs = c["NQB"] * (c["NQB"] + 1) // 2          # the block pairs of a segment
    return Layout(_forward_pieces(problem) + [
        ("final", torch.float32, problem.sequences * H * P * N if recompute else 0),
        ("dypre", problem.dtype, problem.batch * problem.length * H * P if problem.has_z else 0),
        ("dstates", problem.dtype, S * H * P * N),
        ("intra", torch.float32, S * H * pairs * (2 * (Q // c["NQB"]) + 1)),
        ("ddt_part", torch.float32, S * H * c["NPB"] * Q),
        ("u", torch.float32, S * H * c["DBC_NNB"] * Q),
        ("w", torch.float32, S * H * c["DBC_NNB"] * Q),
        ("v", torch.float32, S * H * c["DBC_NNB"]),
        ("dD_part", torch.float32, S * H * c["NQB"] * P if problem.has_D else 0),
        ("dA_part", torch.float32, S * H),
        ("dbias_part", torch.float32, S * H if problem.has_dt_bias else 0),
    ])
