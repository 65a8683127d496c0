"""The operator registry: one entry (``fusedops.opinfo.OpInfo``) per operator family.

Tests, the demonstration, ``fusedops check``, the AOT compiles, the kernel report, the API
reference and the benchmarks iterate ``FAMILIES``; adding an operator family adds one line here.
"""

from __future__ import annotations

from .engram_gate.info import INFO as ENGRAM_GATE
from .mamba2_scan.info import INFO as MAMBA2_SCAN
from .mamba2_inference.info import INFO as MAMBA2_INFERENCE
from .gqa_attention.info import INFO as GQA_ATTENTION
from .relu2_moe.info import INFO as RELU2_MOE
from .opinfo import OpInfo

FAMILIES: tuple[OpInfo, ...] = (
    ENGRAM_GATE,
    MAMBA2_SCAN,
    MAMBA2_INFERENCE,
    GQA_ATTENTION,
    RELU2_MOE,
)


def family(name: str) -> OpInfo:
    """The entry named ``name``."""
    for info in FAMILIES:
        if info.name == name:
            return info
    raise KeyError(f"{name!r}: the registry has {[i.name for i in FAMILIES]}")


def all_plans() -> list[type]:
    """Every plan class, family by family."""
    return [plan for info in FAMILIES for plan in info.plans]
