"""Which GPU architecture's tile table a kernel is specialised for.

Tile tables have one entry per architecture family: ``sm_80`` (Ampere and Ada: mma.sync, cp.async,
up to 164 KiB of shared memory), ``sm_90`` (Hopper: wgmma, TMA, 228 KiB) and ``sm_100``
(Blackwell: tcgen05, TMA, 228 KiB). On a CUDA device the compute capability decides; elsewhere
(the CPU interpreter and emulator) the Hopper table is used. ``FUSEDOPS_TARGET_ARCH`` overrides
both, and ``compiling_for(arch)`` overrides for a block (the kernel report compiles every arch's
table without a GPU).

``FUSEDOPS_EMULATE=1`` runs the kernel backends on CPU tensors by compiling their kernels for the
target architecture (``FUSEDOPS_TARGET_ARCH``, default sm_90a) and executing the PTX on the
project's PTX emulator (``skewed``: warps in a random order between barriers); Triton's own
interpreter, when selected (``TRITON_INTERPRET=1``), takes precedence for Triton kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

from ..errors import ValidationError
from .device import device_capability, multiprocessor_count
from .machines import machine

ARCHS = ("sm_80", "sm_90", "sm_100")
TARGET_ENV = "FUSEDOPS_TARGET_ARCH"
EMULATE_ENV = "FUSEDOPS_EMULATE"
EMULATED_TARGETS = {"sm_80": "sm_80", "sm_90": "sm_90a", "sm_100": "sm_100a"}
"""The compile target of each tile-table family (the 'a' targets: wgmma and tcgen05 need them)."""
EMULATION_MODES = ("0", "1", "skewed")
_OVERRIDE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fusedops_target_arch",
                                                                       default=None)


def normalise_arch(arch: str) -> str:
    """``sm_90a`` -> ``sm_90``; refuses anything but the three table families."""
    name = arch.removesuffix("a")
    if name not in ARCHS:
        raise ValidationError(f"arch: expected one of {', '.join(ARCHS)} (or with an 'a' suffix), "
                              f"got {arch!r}")
    return name


def arch_of_capability(capability: tuple[int, int]) -> str:
    """The tile-table family of a compute capability: 8.x -> sm_80, 9.x -> sm_90, 10.x and
    later -> sm_100 (12.x consumer Blackwell, with 99 KiB of shared memory, takes sm_80)."""
    major = capability[0]
    if major >= 12 or major < 9:
        return "sm_80"
    return "sm_90" if major == 9 else "sm_100"


def target_arch(device: torch.device) -> str:
    """The tile-table family kernels for ``device`` are specialised for."""
    override = target_override()
    if override:
        return override
    if device.type == "cuda":
        return arch_of_capability(device_capability(device.index))
    return "sm_90"


def target_override() -> str | None:
    """The tile-table family forced for every device (``compiling_for``, else
    ``FUSEDOPS_TARGET_ARCH``), or None when each device's capability decides: part of every
    cache key of plans built from tile tables."""
    override = _OVERRIDE.get() or os.environ.get(TARGET_ENV)
    return normalise_arch(override) if override else None


def multiprocessors(device: torch.device) -> int:
    """SMs a plan on ``device`` sizes its grids for: a CUDA device's own count, else that of
    ``target_arch``'s data-centre part (``machines.MACHINES``: plans built on the CPU, the
    kernel report)."""
    if device.type == "cuda":
        return multiprocessor_count(device.index)
    return machine(target_arch(device)).sms


@contextlib.contextmanager
def compiling_for(arch: str):
    """Within the block, ``target_arch`` answers ``arch`` for every device."""
    token = _OVERRIDE.set(normalise_arch(arch))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def emulation_mode() -> str | None:
    """The PTX emulator's schedule for CPU tensors ("lockstep" or "skewed"), or None when
    ``FUSEDOPS_EMULATE`` is unset or 0."""
    if "FUSEDOPS_CUTE_EMULATE" in os.environ:
        raise ValidationError("FUSEDOPS_CUTE_EMULATE: replaced by FUSEDOPS_EMULATE=1 (for every "
                              "kernel backend), with FUSEDOPS_TARGET_ARCH for the architecture")
    value = os.environ.get(EMULATE_ENV, "0") or "0"
    if value not in EMULATION_MODES:
        raise ValidationError(f"{EMULATE_ENV}: expected one of {', '.join(EMULATION_MODES)}, "
                              f"got {value!r}")
    return None if value == "0" else ("skewed" if value == "skewed" else "lockstep")


def emulated_target() -> str | None:
    """The target (sm_80, sm_90a, sm_100a) whose compiled code the PTX emulator runs for CPU
    tensors (``target_override()``'s family, sm_90a by default), or None without emulation."""
    if emulation_mode() is None:
        return None
    return EMULATED_TARGETS[target_override() or "sm_90"]
