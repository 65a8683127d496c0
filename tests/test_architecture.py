"""The house rules that can be read from the source (docs/contributing.md): one-way
dependencies between the layers, read from every import (ast), and small modules."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = ("torch", "triton", "cute")
MAX_LINES = 600
CITATIONS = ("spec" + "s/", "seed" + "s/", ".." + "/shared")   # the design inputs, outside the repository


def module_name(path: pathlib.Path) -> str:
    """The installed module name of a source file (backends/ installs as fusedops.backends)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "backends":
        parts = ["fusedops", *parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[pathlib.Path]:
    return sorted(p for top in ("fusedops", "backends") for p in (ROOT / top).rglob("*.py"))


MODULES = {module_name(p) for p in sources()}


def imports(name: str, is_package: bool, text: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every fusedops import of module ``name`` (source
    ``text``), in functions too."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(text, name)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # "from package import module" names the module
            found += [(node.lineno, f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES
                       else target) for a in node.names]
    return [(line, t) for line, t in found if t == "fusedops" or t.startswith("fusedops.")]


EMULATOR = "fusedops.backends.ptx_emulator"


def layer(module: str) -> tuple[str, str | None]:
    """(layer, backend name) of a fusedops module: core, contract, emulator, backend or api."""
    parts = module.split(".")
    if module == "fusedops.errors" or parts[:2] == ["fusedops", "core"]:
        return "core", None
    if module == EMULATOR or module.startswith(EMULATOR + "."):
        return "emulator", None
    if len(parts) >= 3 and parts[2] == "contract":
        return "contract", None
    if parts[:2] == ["fusedops", "backends"]:
        return "backend", parts[2] if len(parts) > 2 else None
    return "api", None


RULES = {
    "core": "core imports only core (fusedops.core, fusedops.errors)",
    "contract": "a contract imports only core and other contracts",
    "emulator": "the PTX emulator imports only itself (the backends and tests use it)",
    "backend": "a backend imports only core, the operators' contracts, the PTX emulator and its "
               "own package",
    "api": "plans, ops, layers and tools reach a backend only through a plan (or the backend "
           "package's availability and aot API), never its modules",
}


def violations(files) -> list[str]:
    """Every import that breaks a rule, for ``files``: (display path, module name, is package,
    source text)."""
    found = []
    for shown, me, is_package, text in files:
        my_layer, my_backend = layer(me)
        for line, target in imports(me, is_package, text):
            their_layer, their_backend = layer(target)
            if my_layer == "core":
                ok = their_layer == "core"
            elif my_layer == "contract":
                ok = their_layer in ("core", "contract")
            elif my_layer == "emulator":
                ok = their_layer == "emulator"
            elif my_layer == "backend":
                ok = their_layer in ("core", "contract", "emulator") or (
                    their_layer == "backend" and their_backend == my_backend)
            else:
                parts = target.split(".")
                ok = their_layer not in ("backend", "emulator") or len(parts) <= 3 or (
                    len(parts) == 4 and parts[3] == "aot")
            if not ok:
                found.append(f"{shown}:{line} imports {target}: {RULES[my_layer]}")
    return found


def repository_files():
    return [(str(p.relative_to(ROOT)), module_name(p), p.name == "__init__.py", p.read_text())
            for p in sources()]


def test_dependencies_point_one_way():
    found = violations(repository_files())
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_rule_checker_sees_violations():
    """A backend importing a plan or another backend, core importing a contract, a contract
    importing a plan, the API reaching into a backend module and the emulator importing
    anything of the project outside itself are each caught."""
    probes = [
        ("probe1", "fusedops.backends.cute.probe", False,
         "from fusedops.engram_gate.plans import EngramGateSavedForward\n"
         "from ..triton import runtime\nfrom fusedops.core import desc\nfrom . import compiler\n"),
        ("probe2", "fusedops.core.probe", False, "from ..engram_gate.contract import DOT_CLAMP\n"),
        ("probe3", "fusedops.relu2_moe.contract", False, "from .plans import MoERouter\n"),
        ("probe4", "fusedops.memory", False, "from .backends.triton.mamba2_scan import tiles\n"
         "from .backends.triton import interpreter_active\nfrom .backends.cute.aot import ptxas_usage\n"),
        ("probe5", "fusedops.backends.ptx_emulator.probe", False,
         "from fusedops.core.target import compiling_for\nfrom . import machine\n"),
    ]
    found = violations(probes)
    assert [v.split(" imports ")[1].split(":")[0] for v in found] == [
        "fusedops.engram_gate.plans", "fusedops.backends.triton.runtime", "fusedops.engram_gate.contract",
        "fusedops.relu2_moe.plans", "fusedops.backends.triton.mamba2_scan.tiles", "fusedops.core.target"], found


def _is_kernel_file(text: str) -> bool:
    return "@triton.jit" in text or "@cute.kernel" in text


@pytest.mark.parametrize("path", [p for p in sources() if not _is_kernel_file(p.read_text())],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (> {MAX_LINES}): split it by job"


def test_repository_is_self_contained():
    """Nothing cites the design inputs outside the repository (the contracts live in docs/)."""
    cited = []
    for path in [*sources(), *(ROOT / "tests").glob("*.py"), *(ROOT / "docs").glob("*.md"),
                 *(ROOT / "bench").glob("*.py"), ROOT / "README.md"]:
        for i, text in enumerate(path.read_text().splitlines(), 1):
            if any(marker in text for marker in CITATIONS):
                cited.append(f"{path.relative_to(ROOT)}:{i}")
    assert not cited, f"citations of files outside the repository: {cited}"


def test_every_package_is_installed():
    """pyproject.toml lists every package (a non-editable install would miss one it does not)."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(p) for p in sources() if p.name == "__init__.py"}
    assert packages - listed == set(), f"missing from pyproject.toml packages: {sorted(packages - listed)}"
    assert listed - packages == set(), f"listed but not packages: {sorted(listed - packages)}"
