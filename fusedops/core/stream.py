"""Stream handles for execute(current_stream=...) and the eager wrappers' allocation stream."""

from __future__ import annotations

import contextlib
import enum

import torch

from ..errors import ValidationError

# CUDA's special stream handles (cuda_runtime_api.h / cuda.h)
DEFAULT_STREAM_HANDLE = 0       # the NULL stream: the legacy default stream in torch's build
LEGACY_STREAM_HANDLE = 1        # cudaStreamLegacy / CU_STREAM_LEGACY
PER_THREAD_STREAM_HANDLE = 2    # cudaStreamPerThread / CU_STREAM_PER_THREAD


class HandleKind(enum.Enum):
    """What a raw stream handle names."""

    DEFAULT = "the legacy default stream"
    PER_THREAD = "the calling thread's default stream"
    CREATED = "a created stream"


def handle_kind(handle: int) -> HandleKind:
    """Classifies a raw CUDA stream handle: 0 and 1 (cudaStreamLegacy) name the legacy default
    stream, 2 (cudaStreamPerThread) the per-thread default stream, anything else a created
    stream. Negative handles are refused."""
    if handle < 0:
        raise ValidationError(f"current_stream: expected a non-negative stream handle, got {handle}")
    if handle in (DEFAULT_STREAM_HANDLE, LEGACY_STREAM_HANDLE):
        return HandleKind.DEFAULT
    if handle == PER_THREAD_STREAM_HANDLE:
        return HandleKind.PER_THREAD
    return HandleKind.CREATED


def resolve_stream(current_stream, device: torch.device) -> int | None:
    """Returns the raw CUDA stream handle to launch on (None for CPU plans).

    Accepts None (torch's current stream on the plan's device), an int handle (0, 1 and 2 are
    CUDA's special handles, see ``handle_kind``), a ``torch.cuda.Stream``/``ExternalStream``, a
    cuda-python ``CUstream`` or any object implementing ``__cuda_stream__``.
    """
    if device.type != "cuda":
        if current_stream is not None:
            raise ValidationError(
                f"current_stream: expected None for a plan on {device}, got {current_stream!r}")
        return None
    if current_stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(current_stream, bool):
        raise ValidationError(f"current_stream: expected a stream or an int handle, got {current_stream!r}")
    if isinstance(current_stream, int):
        handle_kind(current_stream)
        return current_stream
    if isinstance(current_stream, torch.cuda.Stream):
        if current_stream.device != device:
            raise ValidationError(
                f"current_stream: expected a stream on {device}, got one on {current_stream.device}")
        return current_stream.cuda_stream
    if hasattr(current_stream, "__cuda_stream__"):
        return int(current_stream.__cuda_stream__()[1])
    try:
        handle = int(current_stream)
    except (TypeError, ValueError):
        raise ValidationError(
            "current_stream: expected None, an int handle, a torch.cuda.Stream or a CUstream, "
            f"got {type(current_stream).__name__}") from None
    handle_kind(handle)
    return handle


def torch_stream(handle: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream object for a raw handle on ``device``: torch's default stream for the
    legacy default handles (0 and 1), an ExternalStream for the per-thread default stream and
    for created streams."""
    if handle_kind(handle) is HandleKind.DEFAULT:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(handle, device=device)


def allocation_stream(current_stream, device: torch.device):
    """Context under which eager wrappers allocate, so memory is tied to the launch stream."""
    if device.type != "cuda" or current_stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch_stream(resolve_stream(current_stream, device), device))
