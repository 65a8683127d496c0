"""The operator registry: one entry (``fusedops.opinfo.OpInfo``) per operator family.

Tests, the demonstration, ``fusedops check``, the AOT compiles, the kernel report, the API
reference and the benchmarks iterate ``FAMILIES``; adding an operator family adds one line here.
"""

from __future__ import annotations

from .engram.info import INFO as ENGRAM_GATE
# PORT mamba2: from .mamba2.info import INFO as MAMBA2_SCAN
# PORT mamba2_inference: from .mamba2_inference.info import INFO as MAMBA2_INFERENCE
# PORT attention: from .attention.info import INFO as GQA_ATTENTION
# PORT moe: from .moe.info import INFO as RELU2_MOE
from .opinfo import OpInfo

FAMILIES: tuple[OpInfo, ...] = (
    ENGRAM_GATE,
    # PORT mamba2: MAMBA2_SCAN,
    # PORT mamba2_inference: MAMBA2_INFERENCE,
    # PORT attention: GQA_ATTENTION,
    # PORT moe: RELU2_MOE,
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
