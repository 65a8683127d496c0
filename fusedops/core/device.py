"""Device binding and capability queries (cached, so kernels can be planned without a GPU)."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError


def bind_device(name: str, device: torch.device) -> torch.device:
    """Binds a bare ``cuda`` device to the current CUDA device (at plan construction)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError(f"{name}: declared on {device}, but CUDA is not available here")
        if device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def device_capability(index: int) -> tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)


@functools.cache
def multiprocessor_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def gpu_unavailable_reason(kernels: str, device: torch.device,
                           minimum: tuple[int, int]) -> str | None:
    """Why ``kernels`` cannot run on ``device`` (not CUDA, or below ``minimum`` capability)."""
    if device.type != "cuda":
        return f"{kernels} run on CUDA devices, not on {device.type}"
    cap = device_capability(device.index)
    if cap < minimum:
        return (f"{kernels} need compute capability >= {minimum[0]}.{minimum[1]}; "
                f"{device} has {cap[0]}.{cap[1]}")
    return None
