"""The torch backend: each contract written directly in torch, in fp32 (fp64 on request).

It is the readable reference the tests check the fast paths against and the CPU default. Its
programs compute with torch ops, so they allocate temporaries through torch's allocator (still
capturable in a CUDA Graph, whose private pool serves them), unlike the Triton and CuTe
programs. It serves every device torch runs on.
"""

from __future__ import annotations

import torch

NAME = "torch"


def unavailable_reason(device: torch.device) -> str | None:
    """Always None: torch runs wherever the tensors are."""
    return None
