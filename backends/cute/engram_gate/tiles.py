"""Engram gate (CuTe DSL): how a CTA covers a row (``row_geometry``), its shared memory, and
how many token blocks the backward splits into, per architecture.
"""

import math
from dataclasses import dataclass

import torch

from fusedops.core.dtypes import element_size
from fusedops.core.target import target_arch
from fusedops.engram_gate.contract import token_blocks


MIN_WARPS = 4               # on a padding tie, CTAs of at least this many warps win
MAX_WARPS = 32
MAX_VECTORS = 8             # 16-byte vectors a thread holds per row (32 registers)
# forward: x vectors (all streams) a thread keeps in registers between the reduction and the
# output; beyond it x is re-read (from L1/L2, the same CTA read it just before) and only the
# shared value stays in registers.
MAX_HELD_VECTORS = 8
# backward CTAs to aim for, per architecture: about five per SM
TARGET_CTAS = {"sm_90": 640,     # 132 SMs (H100/H200)
               "sm_100": 740,    # 148 SMs (B200)
               "sm_80": 540}     # 108 SMs (A100): only the emulator runs the cute kernels there
REDUCE_THREADS = 128        # grad_weight reduction: one 16-byte fp32 vector per thread
MAX_SHARED_BYTES = 227 * 1024   # dynamic shared memory a CTA may opt into on sm_90 and sm_100


@dataclass(frozen=True)
class RowGeometry:
    """How a CTA covers a row of D elements: ``threads`` threads each own ``iters`` 16-byte
    vectors of ``vec`` elements, vector i of thread t at tidx + i * threads (coalesced)."""

    vec: int
    threads: int
    iters: int

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def slots(self) -> int:
        """Vectors the CTA covers: the row's, padded to a multiple of the threads."""
        return self.threads * self.iters


def row_geometry(hidden: int, dtype: torch.dtype) -> RowGeometry:
    """The warps that pad the row least (the vector count of D, not a power of two), each
    thread holding at most MAX_VECTORS vectors; on a tie MIN_WARPS or more, then the fewest
    (smaller CTAs, several per SM). Rows wider than MAX_WARPS * 32 * MAX_VECTORS vectors take
    MAX_WARPS warps and as many vectors per thread as they need."""
    vec = 16 // element_size(dtype)
    vectors = hidden // vec
    best, best_key = None, None
    for warps in range(1, MAX_WARPS + 1):
        threads = 32 * warps
        iters = math.ceil(vectors / threads)
        if iters > MAX_VECTORS:
            continue
        key = (iters * threads - vectors, warps < MIN_WARPS, warps)
        if best_key is None or key < best_key:
            best, best_key = RowGeometry(vec, threads, iters), key
    if best is None:
        best = RowGeometry(vec, 32 * MAX_WARPS, math.ceil(vectors / (32 * MAX_WARPS)))
    return best


def _round16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


def forward_shared_bytes(problem, geo: RowGeometry) -> int:
    """The reduction's scratch: 3·S fp32 sums per warp."""
    return 4 * 3 * problem.streams * geo.warps


def private_rows_shared(geo: RowGeometry) -> bool:
    """Whether the backward's private weight and partial rows (``private_rows``) go to shared
    memory: when they fit a CTA's, beside the dgate scratch."""
    return backward_shared_bytes(geo, True) <= MAX_SHARED_BYTES


def backward_shared_bytes(geo: RowGeometry, shared: bool) -> int:
    """The dgate scratch (two slots per warp), then, when ``shared``, the private weight and
    grad_weight partial rows (an fp32 slot of VEC elements per vector the CTA covers)."""
    return _round16(4 * 2 * geo.warps) + (2 * 4 * geo.vec * geo.slots if shared else 0)


def backward_blocks(problem) -> tuple[int, int]:
    """(tokens per block, blocks): one CTA per (stream or grad_v, block), about TARGET_CTAS of
    the plan's architecture."""
    target = TARGET_CTAS[target_arch(problem.device)]
    return token_blocks(problem.tokens, max(1, target // (problem.streams + 1)))
