"""The docs' examples run, the README's commands are what CI runs, and the CLI and benchmark
scripts work on this machine."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from helpers import HAS_CUDA

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def doc_pages():
    return [pytest.param(path, id=path.name) for path in DOC_FILES
            if "```python\n" in path.read_text()]


@pytest.mark.parametrize("path", doc_pages())
def test_docs_examples_run(path):
    """A page's python blocks run in order in one namespace (a tutorial builds on its earlier
    blocks); blocks starting with ``# gpu`` run only on a CUDA machine."""
    namespace = {}
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), re.S)):
        if block.startswith("# gpu") and not HAS_CUDA:
            continue
        exec(compile(block, f"<{path.name} block {i}>", "exec"), namespace)


def test_api_reference_is_current():
    from fusedops.apidoc import render
    assert (ROOT / "docs" / "api.md").read_text() == render(), \
        "docs/api.md is stale: python -m fusedops.apidoc > docs/api.md"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(commands) >= 2 and "fusedops demo" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def _run(*args, timeout=300):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("FUSEDOPS_CUTE_EMULATE", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_demo_passes():
    proc = _run("-m", "fusedops", "demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from fusedops.registry import FAMILIES
    for info in FAMILIES:
        assert info.title in proc.stdout, info.title
    assert "FAIL" not in proc.stdout
    if not HAS_CUDA:
        assert "triton (interpreter)" in proc.stdout and "cute (PTX emulator)" in proc.stdout


def test_check_reports_backends():
    proc = _run("-m", "fusedops", "check")
    assert proc.returncode == 0 and "torch   serves: engram_gate_saved_forward" in proc.stdout, proc.stderr


def test_console_script_is_installed():
    script = pathlib.Path(sys.executable).parent / "fusedops"
    assert script.exists(), f"{script}: the fusedops console script (pyproject [project.scripts])"


def test_memory_calculator_on_a_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(
        hidden_size=2688, hybrid_override_pattern="MEM*EM", mamba_num_heads=64, mamba_head_dim=64,
        n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128, num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, n_routed_experts=128, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, num_experts_per_tok=6)))
    proc = _run("-m", "fusedops", "memory", str(config), "--tokens", "8192", "--context", "65536")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:]}
    # recurrent state: 64·64·128 fp32 + conv history 3·(64·64 + 2·8·128) bf16; KV: 2·65536·2·128 bf16
    state_mib = (64 * 64 * 128 * 4 + 3 * (64 * 64 + 2 * 8 * 128) * 2) / 2 ** 20
    assert rows["mamba2"][0] == "3" and float(rows["mamba2"][1]) == pytest.approx(state_mib, abs=0.01)
    assert rows["attention"][0] == "1" and float(rows["attention"][1]) == 64.0
    assert rows["moe"][0] == "2" and float(rows["moe"][2]) == pytest.approx(232.25, abs=0.01)


def test_bench_command_runs_a_benchmark(tmp_path):
    proc = _run("-m", "fusedops", "bench", "moe", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1/1] bench/moe.py" in proc.stdout and (tmp_path / "moe.json").exists()
    proc = _run("-m", "fusedops", "bench", "nonsense")
    assert proc.returncode != 0 and "names: expected some of" in proc.stderr


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
