"""The house rules that can be read from the source (docs/contributing.md): one-way
dependencies between the layers, read from every import (ast), no import circles, one job per
module, and one room per operator."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKENDS = ("torch", "triton", "cute")
# the design inputs, outside the repository
CITATIONS = ("spec" + "s/", "seed" + "s/", ".." + "/shared")


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
         "from .backends.triton import interpreter_active\n"
         "from .backends.cute.aot import ptxas_usage\n"),
        ("probe5", "fusedops.backends.ptx_emulator.probe", False,
         "from fusedops.core.target import compiling_for\nfrom . import machine\n"),
    ]
    found = violations(probes)
    assert [v.split(" imports ")[1].split(":")[0] for v in found] == [
        "fusedops.engram_gate.plans", "fusedops.backends.triton.runtime",
        "fusedops.engram_gate.contract", "fusedops.relu2_moe.plans",
        "fusedops.backends.triton.mamba2_scan.tiles", "fusedops.core.target"], found


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_states_its_one_job(path):
    """One job per module: its docstring's first line says what the module is (an empty
    package ``__init__`` aside); the layout check names the jobs of a family's modules."""
    text = path.read_text()
    if path.name == "__init__.py" and not text.strip():
        return
    doc = ast.get_docstring(ast.parse(text))
    assert doc and doc.splitlines()[0].strip(), (f"{path.relative_to(ROOT)}: no docstring "
                                                 f"stating its job")


def test_repository_is_self_contained():
    """Nothing cites the design inputs outside the repository (the contracts live in docs/)."""
    cited = []
    for path in [*sources(), *(ROOT / "tests").glob("*.py"), *(ROOT / "docs").glob("*.md"),
                 *(ROOT / "bench").glob("*.py"), ROOT / "README.md"]:
        for i, text in enumerate(path.read_text().splitlines(), 1):
            if any(marker in text for marker in CITATIONS):
                cited.append(f"{path.relative_to(ROOT)}:{i}")
    assert not cited, f"citations of files outside the repository: {cited}"


DATE = re.compile(r"20\d\d-\d\d-\d\d")


def test_no_dated_history_in_the_code():
    """Docstrings and comments state what a thing is and its contract; measurement history (a
    dated figure, a design it replaced) lives in docs/notes/ and the commit log."""
    dated = [f"{path.relative_to(ROOT)}:{i}" for path in sources()
             for i, text in enumerate(path.read_text().splitlines(), 1) if DATE.search(text)]
    assert not dated, f"dates in the code (move the history to docs/notes/): {dated}"


def test_every_package_is_installed():
    """pyproject.toml lists every package (a non-editable install would miss one it does not)."""
    import tomllib
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    packages = {module_name(p) for p in sources() if p.name == "__init__.py"}
    assert packages - listed == set(), (f"missing from pyproject.toml packages: "
                                        f"{sorted(packages - listed)}")
    assert listed - packages == set(), f"listed but not packages: {sorted(listed - packages)}"


# -- one room per operator (docs/contributing.md, "Where things live") ---------------------------
FAMILY_MODULES = ("contract", "plans", "oracle", "samples", "info")      # fusedops/<family>/
KERNEL_PACKAGE = ("program", "kernels*", "tiles", "cost*")              # backends/<b>/<family>/
OPTIONAL_KERNEL_MODULES = ("buffers", "strides")
SHARED_MACHINERY = {
    "torch": {"__init__", "common", "_autograd"},
    "triton": {"__init__", "aot", "runtime", "primitives", "rounding", "ssm_math", "l2_reuse"},
    "cute": {"__init__", "aot", "compiler", "device"},
}


def _matches(stem: str, pattern: str) -> bool:
    return stem == pattern or (pattern.endswith("*") and stem.startswith(pattern[:-1]))


def layout_problems(root: pathlib.Path, families) -> list[str]:
    """What the layout is missing or has out of place under ``root``, for registry entries
    ``families``: each family's package, doc, benchmarks and, per backend of its plans, its
    kernel package with the files every family's has; no family module at a backend's top
    level."""
    problems = []
    names = [info.name for info in families]
    for info in families:
        package = root / "fusedops" / info.name
        problems += [f"fusedops/{info.name}/{m}.py is missing" for m in FAMILY_MODULES
                     if not (package / f"{m}.py").exists()]
        tests = ["test_math", "test_plans"] + (["test_kernels"] if set(info.backends) - {"torch"}
                                               else [])
        problems += [f"tests/{info.name}/{m}.py is missing" for m in tests
                     if not (root / "tests" / info.name / f"{m}.py").exists()]
        if info.doc != f"docs/{info.name}.md" or not (root / info.doc).exists():
            problems.append(f"{info.name}: its page must be docs/{info.name}.md (has {info.doc})")
        problems += [f"{info.name}: bench/{b}.py must be named after the family and exist"
                     for b in info.bench if not b.startswith(info.name) or not
                     (root / "bench" / f"{b}.py").exists()]
        parts = {}
        for plan in info.plans:
            family, _, module = plan.backend_module.partition(".")
            if family != info.name or not module:
                problems.append(f"{plan.__name__}.backend_module: expected '{info.name}.<module>', "
                                f"got {plan.backend_module!r}")
                continue
            for backend in plan.backends:
                parts.setdefault(backend, set()).add(module)
        for backend, modules in parts.items():
            room = root / "backends" / backend / info.name
            stems = {p.stem for p in room.glob("*.py")}
            problems += [f"backends/{backend}/{info.name}/{m}.py is missing (a plan's "
                         f"backend_module)"
                         for m in sorted(modules) if m not in stems]
            if backend != "torch":
                problems += [f"backends/{backend}/{info.name}/ has no {pattern}.py"
                             for pattern in KERNEL_PACKAGE
                             if not any(_matches(s, pattern) for s in stems)]
                allowed = (*KERNEL_PACKAGE, *OPTIONAL_KERNEL_MODULES, "__init__", *modules)
                problems += [f"backends/{backend}/{info.name}/{s}.py: not a kernel-package name "
                             f"({', '.join(allowed)})" for s in sorted(stems)
                             if not any(_matches(s, pattern) for pattern in allowed)]
    for backend, shared in SHARED_MACHINERY.items():
        if not (root / "backends" / backend).is_dir():
            continue
        for path in sorted((root / "backends" / backend).glob("*.py")):
            if path.stem not in shared:
                problems.append(f"backends/{backend}/{path.name}: a backend's top level holds only "
                                f"shared machinery ({', '.join(sorted(shared))}); a family's "
                                f"modules go in backends/{backend}/<family>/")
        for path in sorted((root / "backends" / backend).iterdir()):
            if path.is_dir() and path.name != "__pycache__" and path.name not in names:
                problems.append(f"backends/{backend}/{path.name}/: not a registry family")
    return problems


def test_every_family_lives_in_its_own_room():
    from fusedops.registry import FAMILIES
    assert layout_problems(ROOT, FAMILIES) == []


def test_the_layout_check_says_what_is_missing(tmp_path):
    """A family without its plans tests, whose kernel package lacks its tile table, with a stray
    module at the Triton backend's top level and a doc under another name, is reported for
    each."""
    import shutil
    from dataclasses import replace
    from fusedops.registry import family
    for top in ("fusedops/engram_gate", "backends/triton/engram_gate", "backends/torch/engram_gate",
                "backends/cute/engram_gate", "tests/engram_gate"):
        shutil.copytree(ROOT / top, tmp_path / top)
    for backend, shared in SHARED_MACHINERY.items():
        for stem in shared:
            source = ROOT / "backends" / backend / f"{stem}.py"
            if source.exists():
                shutil.copy(source, tmp_path / "backends" / backend / f"{stem}.py")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "engram_gate.md").write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "engram_gate.py").write_text("")
    (tmp_path / "backends/triton/engram_gate/tiles.py").unlink()
    (tmp_path / "tests/engram_gate/test_plans.py").unlink()
    (tmp_path / "backends/triton/engram_gate/notes.py").write_text("")
    (tmp_path / "backends/triton/engram_kernels.py").write_text("")
    info = replace(family("engram_gate"), doc="docs/gate.md")
    assert layout_problems(tmp_path, [info]) == [
        "tests/engram_gate/test_plans.py is missing",
        "engram_gate: its page must be docs/engram_gate.md (has docs/gate.md)",
        "backends/triton/engram_gate/ has no tiles.py",
        "backends/triton/engram_gate/notes.py: not a kernel-package name (program, kernels*, "
        "tiles, cost*, buffers, strides, __init__, program)",
        "backends/triton/engram_kernels.py: a backend's top level holds only shared machinery "
        "(__init__, aot, l2_reuse, primitives, rounding, runtime, ssm_math); a family's modules "
        "go in backends/triton/<family>/"]


def module_level_imports(name: str, is_package: bool, text: str) -> set[str]:
    """The fusedops modules that module ``name`` imports when it is imported (not those its
    functions import when called)."""
    tree = ast.parse(text, name)
    kinds = (ast.Import, ast.ImportFrom, ast.If, ast.Try)
    top = ast.Module(body=[node for node in tree.body if isinstance(node, kinds)], type_ignores=[])
    return {target for _, target in imports(name, is_package, ast.unparse(top))} & MODULES


def import_cycles(files) -> list[list[str]]:
    """The strongly connected components (more than one module) of the module-level import
    graph."""
    graph = {me: module_level_imports(me, is_package, text) - {me}
             for _, me, is_package, text in files}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles():
    """No two modules import each other, directly or around a loop, when they are imported."""
    assert import_cycles(repository_files()) == []


def test_the_circle_check_sees_a_circle():
    probes = [("a", "fusedops.probe_a", False, "from .probe_b import x\n"),
              ("b", "fusedops.probe_b", False, "from . import probe_c\n"),
              ("c", "fusedops.probe_c", False, "import fusedops.probe_a\n"),
              ("d", "fusedops.probe_d", False, "def f():\n    from .probe_a import y\n")]
    global MODULES
    saved, MODULES = MODULES, MODULES | {"fusedops.probe_a", "fusedops.probe_b", "fusedops.probe_c",
                                         "fusedops.probe_d"}
    try:
        assert import_cycles(probes) == [
            ["fusedops.probe_a", "fusedops.probe_b", "fusedops.probe_c"]]
    finally:
        MODULES = saved


def test_every_long_test_exists_and_says_why():
    """tests/long_tests.py names only tests that exist, each with a reason."""
    from long_tests import LONG_TESTS
    missing = []
    for node, reason in LONG_TESTS.items():
        path, _, name = node.partition("::")
        source = ROOT / path
        defined = source.exists() and any(
            isinstance(n, ast.FunctionDef) and n.name == name
            for n in ast.parse(source.read_text()).body)
        if not defined or not reason.strip():
            missing.append(node)
    assert missing == []
