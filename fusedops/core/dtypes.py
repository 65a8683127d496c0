"""dtype policies written once: names, sizes and the accumulator rule."""

from __future__ import annotations

import torch

FLOAT_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)
"""The activation dtypes the kernel backends take."""

REFERENCE_DTYPE = torch.float64
"""float64 selects reference precision: served by the torch backend only."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (dispatches no torch operator)."""
    return dtype.itemsize


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of reductions, saved statistics, fp32 parameters and weight gradients of an
    operator whose activations are ``dtype``: fp32, or float64 in a float64 (reference) plan."""
    return torch.float64 if dtype == REFERENCE_DTYPE else torch.float32


def kernel_dtype_reason(kernels: str, dtype: torch.dtype) -> str | None:
    """Why a kernel backend cannot take ``dtype`` activations (None if it can)."""
    if dtype in FLOAT_ACTIVATIONS:
        return None
    return f"the {kernels} take bf16/fp16/fp32, not {dtype_name(dtype)} (use backend='torch')"
