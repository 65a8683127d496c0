"""The machines fusedops counts on, written once: each architecture family's data-centre GPU
(SMs, L2, the per-SM limits occupancy comes from) for the plans' grids, the cost models' L2
rule and the kernel report, and the products' peak rates for the report's roofline; and the one
wave count every grid-sizing rule uses.

Peak figures are the vendors' dense (no structured sparsity) tensor-core rates and HBM
bandwidths, each with its source: ceilings for the roofline model, not measurements (``bench/``
measures the achievable copy bandwidth and matmul rate in the same run as a kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """One architecture family's data-centre GPU. ``arch``: the tile-table family (sm_80,
    sm_90, sm_100); ``target``: the compile target whose code runs on it; ``l2_bytes``: the L2
    the cost models' re-reads hit in; the rest: per-SM resources (CUDA C++ Programming Guide,
    compute capabilities table), occupancy being the fewest CTAs any of them allows."""

    arch: str
    target: str
    name: str
    sms: int
    l2_bytes: int
    shared_bytes: int = 233472           # per SM: 228 KiB on sm_90 / sm_100
    registers: int = 65536
    register_granularity: int = 256      # registers are allocated per warp in these units
    max_registers_per_thread: int = 255
    shared_reserved_per_cta: int = 1024  # the driver's per-CTA reservation
    max_threads: int = 2048
    max_ctas: int = 32


MACHINES = {
    "sm_80": Machine("sm_80", "sm_80", "A100", 108, 40 * 10**6, shared_bytes=167936),
    "sm_90": Machine("sm_90", "sm_90a", "H100/H200 SXM", 132, 50 * 10**6),
    "sm_100": Machine("sm_100", "sm_100a", "B200", 148, 126 * 10**6),  # both dies' L2 halves
}


def machine(arch: str) -> Machine:
    """The machine of ``arch``: a tile-table family (``sm_90``) or a compile target
    (``sm_90a``)."""
    return MACHINES[arch.removesuffix("a")]


@dataclass(frozen=True)
class Gpu:
    """A product and its peak rates: dense tensor-core bf16/fp16 with fp32 accumulation,
    CUDA-core fp32, HBM bandwidth."""

    name: str
    arch: str                  # the compile target whose code runs on it
    sms: int
    bf16_tflops: float
    fp32_tflops: float
    hbm_tbps: float
    source: str


GPUS = (
    Gpu("H100 SXM", "sm_90a", MACHINES["sm_90"].sms, 989.4, 66.9, 3.35,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity, "
        "FP32 67 TFLOPS, 3.35 TB/s HBM3"),
    Gpu("H200 SXM", "sm_90a", MACHINES["sm_90"].sms, 989.4, 66.9, 4.8,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute (BF16 1,979 TFLOPS "
        "with sparsity), 4.8 TB/s HBM3e"),
    Gpu("B200", "sm_100a", MACHINES["sm_100"].sms, 2250.0, 80.0, 8.0,
        "NVIDIA DGX B200 / HGX B200 datasheets, per GPU: FP16/BF16 4.5 PFLOPS with sparsity, "
        "FP32 80 TFLOPS, 8 TB/s HBM3e"),
)


def gpus_for(arch: str) -> tuple[Gpu, ...]:
    """The modelled products that run ``arch`` code (a compile target)."""
    return tuple(g for g in GPUS if g.arch == arch)


def waves(programs: int, sms: int, ctas_per_sm: int = 1) -> float:
    """How many waves a grid of ``programs`` CTAs takes on ``sms`` SMs holding ``ctas_per_sm``
    each (infinite when none fits)."""
    return programs / (ctas_per_sm * sms) if ctas_per_sm else math.inf


def wave_efficiency(programs: int, sms: int, ctas_per_sm: int = 1) -> float:
    """How full a grid keeps the SMs over its waves: the waves over their ceiling (1.0: the
    last wave is full)."""
    w = waves(programs, sms, ctas_per_sm)
    return w / math.ceil(w)
