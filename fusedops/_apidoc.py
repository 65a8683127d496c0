"""The API reference (docs/api.md), generated from the public docstrings and signatures:
``python -m fusedops._apidoc > docs/api.md``; a test keeps the file current."""

from __future__ import annotations

import importlib
import inspect
import sys

SECTIONS = (
    ("fusedops", "Plans and eager wrappers", None),
    ("fusedops.ops", "Differentiable torch ops", ("engram_gate", "mamba2_chunk_scan", "gqa_attention",
                                                  "moe_router", "relu2_moe")),
    ("fusedops.layers", "Layers", ("EngramGate", "Mamba2Mixer", "GQAAttention", "ReLU2MoE",
                                   "Mamba2State", "KVState", "GatedRMSNorm")),
    ("fusedops.compat", "Drop-in compatibility", ("mamba_chunk_scan_combined", "selective_state_update",
                                                  "flash_attn_func", "flash_attn_varlen_func",
                                                  "flash_attn_with_kvcache")),
    ("fusedops.memory", "Memory arithmetic", ("HybridCacheConfig", "model_bytes", "load_nemotron_h_config")),
    ("fusedops.errors", "Errors", ("FusedOpsError", "ValidationError", "UnsupportedError", "PlanStateError")),
)
_SKIP = {"errors", "ops", "layers", "TupleDict"}


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _entry(module: str, name: str, obj) -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"### `{module}.{name}`", "", f"```text\n{kind} {name}{_signature(obj)}\n```", ""]
    lines += [inspect.cleandoc(obj.__doc__ or "(undocumented)"), ""]
    if inspect.isclass(obj):
        for method in ("compile", "execute", "allocate_workspace", "allocate_saved", "allocate_state",
                       "forward", "from_config"):
            member = obj.__dict__.get(method) or (getattr(obj, method, None) if method in
                                                   ("compile", "allocate_workspace") else None)
            if member is not None and getattr(member, "__doc__", None) and callable(member):
                target = member.__func__ if isinstance(member, classmethod) else member
                summary = " ".join(inspect.cleandoc(target.__doc__).split("\n\n")[0].split())
                lines += [f"- `{method}{_signature(target)}`: {summary}"]
        lines.append("")
    return lines


def render() -> str:
    out = ["# API reference", "",
           "Generated from the docstrings by `python -m fusedops._apidoc` (the tests check it is "
           "current). Contracts in prose: the operator pages.", ""]
    for module_name, title, names in SECTIONS:
        module = importlib.import_module(module_name)
        names = names or [n for n in module.__all__ if n not in _SKIP and not n.startswith("_")]
        out += [f"## {title} (`{module_name}`)", ""]
        for name in names:
            out += _entry(module_name, name, getattr(module, name))
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
