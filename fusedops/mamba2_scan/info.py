"""The chunked scan's registry entry."""

from __future__ import annotations

import torch

from ..opinfo import OpInfo, Tolerance
from . import samples
from .oracle import oracle
from .ops import mamba2_chunk_scan
from .plans import (Mamba2ChunkScanBackward, Mamba2ChunkScanForward, mamba2_chunk_scan_backward,
                    mamba2_chunk_scan_forward)

TOLERANCES = {
    torch.float64: Tolerance(1e-11, 1e-10, "float64 chunked vs float64 recurrence"),
    torch.float32: Tolerance(2e-5, 2e-4, "fp32 products, sums in another order than the "
                             "recurrence's"),
    torch.float16: Tolerance(3e-3, 2e-2, "fp16 operands of the tensor-core products (the "
                             "decay-weighted C·B, the dt-scaled B, the fp32 states), outputs "
                             "rounded once"),
    torch.bfloat16: Tolerance(2.5e-2, 1e-1, "bf16 operands of the tensor-core products (the "
                              "decay-weighted C·B, the dt-scaled B, the fp32 states), outputs "
                              "rounded once"),
}


def tolerance(name: str, dtype: torch.dtype) -> Tolerance:
    """Every result, every backend, against the float64 recurrence: the Triton kernels, like
    mamba_ssm's, round the operands of their tensor-core products to the input dtype, so their
    error is a few units of that dtype's rounding (the torch backend's is within it)."""
    return TOLERANCES[dtype]


INFO = OpInfo(
    name="mamba2_scan", title="Mamba2 chunked scan (SSD)", doc="docs/mamba2_scan.md",
    plans=(Mamba2ChunkScanForward, Mamba2ChunkScanBackward),
    eager=(mamba2_chunk_scan_forward, mamba2_chunk_scan_backward), torch_ops=(mamba2_chunk_scan,),
    cases=samples.cases, production=samples.production, plan_calls=samples.plan_calls,
    run=samples.run, oracle=oracle, tolerance=tolerance,
    demo_limit=2.5e-2,   # bf16 operands of the tensor-core products (the Triton kernels)
    bench=("mamba2_scan",), index_fuzz=samples.index_fuzz)
