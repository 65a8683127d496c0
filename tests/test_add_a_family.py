"""The layout, tried: a throwaway family (tests/add_a_family/template: registry entry, contract,
float64 oracle, torch reference, one Triton kernel with its tile table and cost, its tests,
page and benchmark), laid out as docs/contributing.md's "Add an operator family" says, passes
the layout check, the plan-contract tests and its own tests without a line outside its room."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
TEMPLATE = HERE / "add_a_family" / "template"

# the family's folders joined to the installed packages, and its entry to the registry, before
# pytest collects the plan-contract tests from the registry
BOOTSTRAP = """
import sys
import fusedops, fusedops.backends.torch, fusedops.backends.triton, fusedops.registry as registry
root = sys.argv[1]
fusedops.__path__.append(root + "/fusedops")
fusedops.backends.torch.__path__.append(root + "/backends/torch")
fusedops.backends.triton.__path__.append(root + "/backends/triton")
from fusedops.row_scale.info import INFO
registry.FAMILIES = registry.FAMILIES + (INFO,)
if sys.argv[2] == "layout":
    sys.path.insert(0, sys.argv[3])
    from test_architecture import layout_problems
    import pathlib
    print(layout_problems(pathlib.Path(root), [INFO]))
    sys.exit(0)
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def _run(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", BOOTSTRAP, str(root), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_a_new_family_in_the_layout_passes_the_contract_tests(tmp_path):
    root = tmp_path / "room"
    shutil.copytree(TEMPLATE, root)
    layout = _run(root, "layout", str(HERE))
    assert layout.returncode == 0 and layout.stdout.strip() == "[]", layout.stdout + layout.stderr
    proc = _run(root, "-q", "-p", "no:cacheprovider", "-k", "RowScale",
                str(HERE / "test_plan_contract.py"), str(root / "tests" / "row_scale"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary and " passed" in summary, summary


def test_the_layout_check_sees_what_the_new_family_lacks(tmp_path):
    root = tmp_path / "room"
    shutil.copytree(TEMPLATE, root)
    (root / "backends" / "triton" / "row_scale" / "cost.py").unlink()
    layout = _run(root, "layout", str(HERE))
    assert "backends/triton/row_scale/ has no cost*.py" in layout.stdout, (layout.stdout
                                                                           + layout.stderr)
