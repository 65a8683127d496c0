"""The implementations users would otherwise pick, found in this environment for the benchmarks:
mamba_ssm's Triton SSD and selective_state_update, FLA's chunk_simple_gla, vLLM's fused MoE.
Each ``find_*`` returns (callable, None) or (None, the reason it is unavailable), so a benchmark
row says why a peer is missing instead of silently leaving it out.

mamba_ssm's package __init__ imports its CUDA extensions; ``bench/pack_peers.sh`` carries the
sources without building them, so its Triton modules are imported here with the package
__init__ files skipped (they need nothing from them). FLA likewise.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types


def _bare_package(name: str) -> None:
    """Registers package ``name`` (and its parents) by their directories on sys.path without
    running their __init__.py."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        full = ".".join(parts[:i])
        if full in sys.modules:
            continue
        for root in sys.path:
            path = os.path.join(root, *parts[:i])
            if os.path.isdir(path):
                module = types.ModuleType(full)
                module.__path__ = [path]
                module.__spec__ = importlib.machinery.ModuleSpec(full, None, is_package=True)
                sys.modules[full] = module
                break
        else:
            raise ImportError(f"{full} is not on sys.path (bench/pack_peers.sh packs it)")


def _import(module: str, packages: tuple[str, ...]):
    try:
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001  (a package __init__ that needs what is not installed)
        for package in packages:
            for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
                del sys.modules[name]
            _bare_package(package)
        return importlib.import_module(module)


def find_mamba_chunk_scan():
    """mamba_ssm's mamba_chunk_scan_combined (its five-kernel Triton SSD)."""
    try:
        mod = _import("mamba_ssm.ops.triton.ssd_combined", ("mamba_ssm", "mamba_ssm.ops",
                                                           "mamba_ssm.ops.triton"))
        return mod.mamba_chunk_scan_combined, None
    except Exception as error:  # noqa: BLE001
        return None, f"mamba_ssm not importable ({type(error).__name__}: {error})"


def find_mamba_state_update():
    """mamba_ssm's selective_state_update (Triton)."""
    try:
        mod = _import("mamba_ssm.ops.triton.selective_state_update",
                      ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"))
        return mod.selective_state_update, None
    except Exception as error:  # noqa: BLE001
        return None, f"mamba_ssm not importable ({type(error).__name__}: {error})"


def find_fla_simple_gla():
    """FLA's chunk_simple_gla."""
    try:
        mod = _import("fla.ops.simple_gla", ("fla", "fla.ops"))
        return mod.chunk_simple_gla, None
    except Exception as error:  # noqa: BLE001
        return None, f"fla not importable ({type(error).__name__}: {error})"


def find_vllm_fused_moe():
    """vLLM's fused_experts (Triton fused MoE), when vLLM itself is installed."""
    if importlib.util.find_spec("vllm") is None:
        return None, "vllm is not installed (too large to carry; the row appears where it is)"
    try:
        mod = importlib.import_module("vllm.model_executor.layers.fused_moe")
        return mod.fused_experts, None
    except Exception as error:  # noqa: BLE001
        return None, f"vllm's fused MoE not importable ({type(error).__name__}: {error})"


def discover() -> dict[str, str]:
    """Each peer: "available" or why not."""
    out = {}
    for name, find in (("mamba_ssm chunk scan", find_mamba_chunk_scan),
                       ("mamba_ssm selective_state_update", find_mamba_state_update),
                       ("fla chunk_simple_gla", find_fla_simple_gla),
                       ("vllm fused_moe", find_vllm_fused_moe)):
        fn, reason = find()
        out[name] = "available" if fn is not None else reason
    return out


if __name__ == "__main__":
    for name, state in discover().items():
        print(f"{name:<36} {state}")
