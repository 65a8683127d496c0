"""The docs' examples run, the README's commands are what CI runs, and the CLI and benchmark
scripts work on this machine."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import HAS_CUDA

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def python_blocks():
    for path in DOC_FILES:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
            yield pytest.param(block, id=f"{path.name}-{i}",
                               marks=pytest.mark.skipif(block.startswith("# gpu") and not HAS_CUDA,
                                                        reason="example needs a GPU"))


@pytest.mark.parametrize("code", list(python_blocks()))
def test_docs_example_runs(code):
    exec(compile(code, "<docs example>", "exec"), {})


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(commands) >= 2 and "fusedops demo" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def _run(*args, timeout=300):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_passes():
    proc = _run("-m", "fusedops", "demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "engram gate" in proc.stdout and "FAIL" not in proc.stdout
    if not HAS_CUDA:
        assert "triton (interpreter)" in proc.stdout


def test_check_reports_backends():
    proc = _run("-m", "fusedops", "check")
    assert proc.returncode == 0 and "torch   serves: engram gate" in proc.stdout, proc.stderr


def test_engram_benchmark_smoke(tmp_path):
    proc = _run("bench/engram_gate.py", "--quick", "--no-compile", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert "GB/s" in proc.stdout and (tmp_path / "r.json").exists()


def test_mamba2_benchmark_smoke(tmp_path):
    proc = _run("bench/mamba2_scan.py", "--quick", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert "fusedops torch" in proc.stdout and (tmp_path / "r.json").exists()


@pytest.mark.parametrize("script", ["bench/mamba2_decode.py", "bench/mamba2_state_storage.py",
                                    "bench/attention.py", "bench/moe.py"])
def test_inference_benchmarks_smoke(script, tmp_path):
    proc = _run(script, "--quick", "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r.json").exists()
