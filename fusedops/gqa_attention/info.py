"""GQA attention's registry entry."""

from __future__ import annotations

import torch

from ..core.dtypes import accumulator_dtype
from ..opinfo import OpInfo, Tolerance
from . import samples
from .ops import gqa_attention
from .oracle import oracle
from .decode import GQAAttentionDecode, gqa_attention_decode
from .plans import (GQAAttentionBackward, GQAAttentionForward, gqa_attention_backward,
                    gqa_attention_forward)

KERNEL_TOLERANCE = {
    torch.float64: Tolerance(1e-12, 1e-11, "float64 against float64"),
    torch.float32: Tolerance(2e-6, 2e-5, "fp32 products, online softmax in another order"),
    torch.float16: Tolerance(2e-3, 1e-2, "fp16 operands of the products (P rounded to fp16)"),
    torch.bfloat16: Tolerance(1.5e-2, 6e-2, "bf16 operands of the products (P rounded to bf16)"),
}
"""o and the gradients: the kernels round P (and dS) to the input dtype before the products, as
FlashAttention does; fp32 and float64 inputs keep exact products."""

STORED_EXACTLY = Tolerance(0.0, 0.0, "the cache holds the appended values (or their e4m3 "
                           "rounding of fp32 value / scale) exactly")


def tolerance(name: str, dtype: torch.dtype) -> Tolerance:
    """o, dq, dk, dv: KERNEL_TOLERANCE of the input dtype; lse: of its fp32 (float64)
    accumulator; k_cache, v_cache (decode): exact."""
    if name in ("k_cache", "v_cache"):
        return STORED_EXACTLY
    if name == "lse":
        return KERNEL_TOLERANCE[accumulator_dtype(dtype)]
    return KERNEL_TOLERANCE[dtype]


INFO = OpInfo(
    name="gqa_attention", title="GQA attention", doc="docs/gqa_attention.md",
    plans=(GQAAttentionForward, GQAAttentionBackward, GQAAttentionDecode),
    eager=(gqa_attention_forward, gqa_attention_backward, gqa_attention_decode),
    torch_ops=(gqa_attention,),
    cases=samples.cases, production=samples.production, plan_calls=samples.plan_calls,
    run=samples.run, oracle=oracle, tolerance=tolerance,
    demo_limit=2.5e-2,   # tensor-core products with bf16 operands (P rounded to bf16)
    bench=("gqa_attention",), index_fuzz=samples.index_fuzz,
    sample_kinds=("small", "edge", "decode"),
    emulated_cases=("small:3",))
