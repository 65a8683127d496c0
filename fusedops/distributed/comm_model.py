"""Bytes each rank sends per layer, per direction, for the distributed operators (the formulas of
docs/distributed.md), and the ring alternative the context-parallel attention was weighed
against. Host arithmetic only; a rank's message to itself is a local copy and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends in the forward and in the backward, and the bytes it keeps from the
    forward for the backward because of the exchange."""

    forward: float
    backward: float
    saved: float = 0.0


def mamba2_bytes(batch: int, heads: int, head_dim: int, state: int, conv_dim: int, conv_kernel: int,
                 world: int, *, pieces: int = 2, element_size: int = 2,
                 packed: bool = False) -> CommVolume:
    """Context-parallel Mamba2 mixer: the convolution halo, (K − 1)·c activations per piece and
    stream, and the state passing, h·(p·n + 1) fp32 per piece and stream (one stream when
    packed, b when dense), each all-gathered (sent to W − 1 ranks) in the forward and
    reduce-scattered in the backward."""
    streams = 1 if packed else batch
    halo = pieces * batch * (conv_kernel - 1) * conv_dim * element_size
    states = pieces * streams * heads * (head_dim * state + 1) * 4
    each = (world - 1) * (halo + states)
    return CommVolume(each, each)


def attention_bytes(batch: int, seqlen: int, kv_heads: int, head_dim: int, world: int, *,
                    element_size: int = 2) -> CommVolume:
    """Context-parallel attention with all-gathered K/V (balanced: l = S/W positions per rank):
    the forward sends 2·b·l·h_kv·d elements to W − 1 ranks, the backward reduce-scatters dK/dV
    (the same), and every rank keeps the gathered K/V, 2·b·S·h_kv·d elements."""
    local = 2 * batch * (seqlen / world) * kv_heads * head_dim * element_size
    return CommVolume((world - 1) * local, (world - 1) * local, world * local)


def ring_attention_bytes(batch: int, seqlen: int, kv_heads: int, head_dim: int, world: int, *,
                         element_size: int = 2) -> CommVolume:
    """The ring alternative: W − 1 steps pass a K/V block on in the forward; the backward passes
    K/V again and dK/dV (fp32 partial sums kept in the input dtype here) around the ring."""
    local = 2 * batch * (seqlen / world) * kv_heads * head_dim * element_size
    return CommVolume((world - 1) * local, 2 * (world - 1) * local, 0.0)


def expected_destinations(top_k: int, experts: int, world: int) -> float:
    """Mean number of ranks a token is sent to when its k distinct experts are uniform over E
    (each rank holding E/W): W·(1 − C(E − E/W, k)/C(E, k))."""
    per_rank = experts // world
    return world * (1 - comb(experts - per_rank, top_k) / comb(experts, top_k))


def moe_bytes(tokens: int, hidden: int, top_k: int, experts: int, world: int, *,
              element_size: int = 2, capacity: int | None = None,
              weight_size: int = 4) -> CommVolume:
    """Expert-parallel MoE per rank with ``tokens`` tokens: each send row carries the token (H
    elements), its k local ids and k weights; the combine returns H elements per row; the
    backward sends d_out rows and returns d_x rows and k weight gradients. Dropless: the
    expected rows under uniform routing, tokens·expected_destinations; capacity: W·C rows,
    always (padding included). The (W − 1)/W share that leaves the rank is counted, plus the
    row-count exchange (2 int64 per rank pair) when dropless."""
    if capacity is None:
        rows = tokens * expected_destinations(top_k, experts, world) * (world - 1) / world
        counts = (world - 1) * 16
    else:
        rows, counts = (world - 1) * capacity, 0
    forward = rows * (2 * hidden * element_size + top_k * (4 + weight_size)) + counts
    backward = rows * (2 * hidden * element_size + top_k * weight_size)
    return CommVolume(forward, backward)
