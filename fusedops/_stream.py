"""Stream-handle resolution for execute(current_stream=...)."""

from __future__ import annotations

import contextlib

import torch

from .errors import ValidationError


def resolve_stream(current_stream, device: torch.device) -> int | None:
    """Returns the raw CUDA stream handle to launch on (None for CPU plans).

    Accepts None (torch's current stream on the plan's device), an int handle, a
    ``torch.cuda.Stream``/``ExternalStream``, a cuda-python ``CUstream`` or any object
    implementing ``__cuda_stream__``.
    """
    if device.type != "cuda":
        if current_stream is not None:
            raise ValidationError(
                f"current_stream: expected None for a plan on {device}, got {current_stream!r}")
        return None
    if current_stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(current_stream, int):
        return current_stream
    if isinstance(current_stream, torch.cuda.Stream):
        if current_stream.device != device:
            raise ValidationError(
                f"current_stream: expected a stream on {device}, got one on {current_stream.device}")
        return current_stream.cuda_stream
    if hasattr(current_stream, "__cuda_stream__"):
        return int(current_stream.__cuda_stream__()[1])
    try:
        return int(current_stream)
    except (TypeError, ValueError):
        raise ValidationError(
            "current_stream: expected None, an int handle, a torch.cuda.Stream or a CUstream, "
            f"got {type(current_stream).__name__}") from None


def allocation_stream(current_stream, device: torch.device):
    """Context under which eager wrappers allocate, so memory is tied to the launch stream."""
    if device.type != "cuda" or current_stream is None:
        return contextlib.nullcontext()
    handle = resolve_stream(current_stream, device)
    return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=device))
