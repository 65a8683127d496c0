"""The GPUs the kernel report models, and the limits occupancy is computed from.

Peak figures are the vendors' dense (no structured sparsity) tensor-core rates and HBM
bandwidths, each with its source. They are ceilings for the roofline model, not measurements:
``bench/`` measures the achievable copy bandwidth and matmul rate in the same run as a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.target import MULTIPROCESSORS


@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str                  # the compile target whose code runs on it
    sms: int
    bf16_tflops: float         # dense tensor-core bf16/fp16, fp32 accumulate
    fp32_tflops: float         # CUDA-core fp32 (non-tensor)
    hbm_tbps: float            # HBM bandwidth, TB/s
    source: str


GPUS = (
    Gpu("H100 SXM", "sm_90a", 132, 989.4, 66.9, 3.35,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity, "
        "FP32 67 TFLOPS, 3.35 TB/s HBM3"),
    Gpu("H200 SXM", "sm_90a", 132, 989.4, 66.9, 4.8,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute (BF16 1,979 TFLOPS "
        "with sparsity), 4.8 TB/s HBM3e"),
    Gpu("B200", "sm_100a", 148, 2250.0, 80.0, 8.0,
        "NVIDIA DGX B200 / HGX B200 datasheets, per GPU: FP16/BF16 4.5 PFLOPS with sparsity, "
        "FP32 80 TFLOPS, 8 TB/s HBM3e"),
)


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources of an architecture (CUDA C++ Programming Guide, compute capabilities
    table): occupancy is the fewest CTAs any of them allows."""

    arch: str
    registers: int = 65536
    register_granularity: int = 256      # registers are allocated per warp in these units
    max_registers_per_thread: int = 255
    shared_bytes: int = 233472           # 228 KiB per SM on sm_90 / sm_100
    shared_reserved_per_cta: int = 1024  # the driver's per-CTA reservation
    max_threads: int = 2048
    max_ctas: int = 32
    sms: int = 132


LIMITS = {
    "sm_80": SmLimits("sm_80", shared_bytes=167936, sms=MULTIPROCESSORS["sm_80"]),
    "sm_90a": SmLimits("sm_90a", sms=MULTIPROCESSORS["sm_90"]),
    "sm_100a": SmLimits("sm_100a", sms=MULTIPROCESSORS["sm_100"]),
}


def gpus_for(arch: str) -> tuple[Gpu, ...]:
    """The modelled GPUs that run ``arch`` code."""
    return tuple(g for g in GPUS if g.arch == arch)
