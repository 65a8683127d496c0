"""Mamba2 chunked selective scan (SSD): contract, plans, eager wrappers, torch op, samples and
oracle. See docs/mamba2_scan.md."""

from .contract import ACTIVATION_DTYPES, CHUNK_SIZES, SOFTPLUS_THRESHOLD, ScanProblem
from .plans import (Mamba2ChunkScanBackward, Mamba2ChunkScanForward, mamba2_chunk_scan_backward,
                    mamba2_chunk_scan_forward)

__all__ = ["Mamba2ChunkScanBackward", "Mamba2ChunkScanForward", "mamba2_chunk_scan_backward",
           "mamba2_chunk_scan_forward"]
