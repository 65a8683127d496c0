"""The API reference (docs/api.md), generated from the public docstrings and signatures:
``python -m fusedops.apidoc > docs/api.md``; a test keeps the file current. Operator families
come from the registry; the other sections from each module's ``__all__``."""

from __future__ import annotations

import importlib
import inspect
import sys

MODULES = (
    ("fusedops.layers", "Layers"),
    ("fusedops.distributed", "Beyond one GPU (torch.distributed)"),
    ("fusedops.compat", "Drop-in compatibility"),
    ("fusedops.memory", "Memory arithmetic"),
    ("fusedops.testing", "Testing helpers"),
    ("fusedops.errors", "Errors"),
)
_METHODS = ("compile", "execute", "allocate_outputs", "allocate_workspace", "allocate_saved",
            "allocate_state", "forward", "from_config")


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
        for method in _METHODS:
            member = getattr(obj, method, None)
            if member is not None and getattr(member, "__doc__", None) and callable(member):
                target = member.__func__ if isinstance(member, classmethod) else member
                summary = " ".join(inspect.cleandoc(target.__doc__).split("\n\n")[0].split())
                lines += [f"- `{method}{_signature(target)}`: {summary}"]
        lines.append("")
    return lines


def _module_names(module) -> list[str]:
    return [n for n in getattr(module, "__all__", ()) if not n.startswith("_")
            and (inspect.isclass(getattr(module, n)) or inspect.isfunction(getattr(module, n)))]


def render() -> str:
    from .registry import FAMILIES
    out = ["# API reference", "",
           "Generated from the docstrings by `python -m fusedops.apidoc` (the tests check it is "
           "current). Contracts in prose: the operator pages.", ""]
    for info in FAMILIES:
        out += [f"## {info.title} ([{info.doc.removeprefix('docs/')}]({info.doc.removeprefix('docs/')}))", ""]
        for obj in (*info.plans, *info.eager):
            out += _entry("fusedops", obj.__name__, obj)
        for obj in info.torch_ops:
            out += _entry("fusedops.ops", obj.__name__, obj)
    for module_name, title in MODULES:
        module = importlib.import_module(module_name)
        out += [f"## {title} (`{module_name}`)", ""]
        for name in _module_names(module):
            out += _entry(module_name, name, getattr(module, name))
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
