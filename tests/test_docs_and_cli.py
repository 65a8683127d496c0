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


def _run(*args, timeout=1800):   # a guard against a hang, far above a 10x slower run
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("FUSEDOPS_EMULATE", None)
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


def test_memory_reads_what_transformers_writes(tmp_path):
    """A config saved by transformers (its time_step_limit holds an encoded infinity) reads back
    from the directory or the file; a broken file or field is one line naming it."""
    transformers = pytest.importorskip("transformers")
    transformers.NemotronHConfig().save_pretrained(tmp_path)
    for target in (tmp_path, tmp_path / "config.json"):
        proc = _run("-m", "fusedops", "memory", str(target), "--tokens", "1024")
        assert proc.returncode == 0 and "mamba2" in proc.stdout, proc.stderr
    (tmp_path / "broken.json").write_text("{broken")
    (tmp_path / "field.json").write_text(json.dumps(dict(hybrid_override_pattern="M", mamba_num_heads=None)))
    for name, field in (("broken.json", "not a valid JSON file"), ("field.json", "mamba_num_heads")):
        proc = _run("-m", "fusedops", "memory", str(tmp_path / name))
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
        assert name in proc.stderr and field in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bench_command_runs_a_benchmark(tmp_path):
    proc = _run("-m", "fusedops", "bench", "mamba2_inference_state_storage", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[1/1] bench/mamba2_inference_state_storage.py" in proc.stdout
    assert (tmp_path / "mamba2_inference_state_storage.json").exists()
    proc = _run("-m", "fusedops", "bench", "nonsense")
    assert proc.returncode != 0 and "names: expected some of" in proc.stderr


def test_bench_host_overhead_lists_every_plan_wrapper_and_op(tmp_path):
    """``fusedops bench host_overhead --quick``: a row per registry plan's execute(), eager
    wrapper and torch op, beside torch's op-call floor measured in the same run. Times are not
    checked (shared machines run many times slower at times): only that each row has one."""
    from fusedops.registry import FAMILIES
    proc = _run("-m", "fusedops", "bench", "host_overhead", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "host_overhead.json").read_text())["rows"]
    listed = {(row["kind"], row["case"]) for row in rows}
    expected = {("floor", "torch.add (1 element)"), ("floor", "empty custom op")}
    for info in FAMILIES:
        expected |= {("execute", f"{plan.__name__}.execute") for plan in info.plans}
        expected |= {("eager", fn.__name__) for fn in info.eager}
        expected |= {("torch op", fn.__name__) for fn in info.torch_ops}
    assert expected - listed == set()
    assert all(isinstance(row["us"], float) and row["us"] > 0 for row in rows)


def test_gpu_check_dry_run(tmp_path):
    """bench/gpu_check.sh --dry-run: the GPU check's steps on tiny CPU shapes (peer discovery,
    every registry benchmark writing its JSON and plot, the summary), so the first GPU run
    cannot fail on a script error."""
    from fusedops.__main__ import benchmarks
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for name in benchmarks():
        assert (tmp_path / f"{name}.json").exists(), name
    assert "mamba_ssm chunk scan" in (tmp_path / "peers.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {row["benchmark"] for row in summary}, "the summary lists no benchmark"


def test_gpu_check_summary_lists_the_autotune_record(tmp_path, monkeypatch):
    """The summary ends with the autotune record the run left in $OUT/fusedops_cache (the
    script points FUSEDOPS_CACHE_DIR there): every tuned plan's candidates with their times,
    the winner marked, so one GPU run says which tile-table entries to change."""
    from dataclasses import replace
    from fusedops.backends.triton.mamba2_scan.tiles import ScanTiles
    from fusedops.plan import autotune
    assert 'FUSEDOPS_CACHE_DIR="$OUT/fusedops_cache"' in (ROOT / "bench/gpu_check.sh").read_text()
    monkeypatch.setenv("FUSEDOPS_CACHE_DIR", str(tmp_path / "fusedops_cache"))
    key = "H200 | torch=2.13.0 | triton | mamba2_chunk_scan | backward | [('heads', 128)]"
    entry, apart = ScanTiles(), replace(ScanTiles(), DX_IN_DBC=False)
    autotune._store(key, 1, [entry, apart], [2.5, 2.0])
    report = dict(title="scan", device="H200", rows=[
        dict(case="b=1", impl="fusedops triton", us=10.0), dict(case="b=1", impl="peer", us=20.0)])
    (tmp_path / "scan.json").write_text(json.dumps(report))
    proc = _run("bench/summary.py", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "triton mamba2_chunk_scan backward" in out
    assert f" #0     2.500  {entry!r}" in out and f"*#1     2.000  {apart!r}" in out
    (tuned,) = json.loads((tmp_path / "autotune_summary.json").read_text())
    assert tuned["winner"] == 1 and [ms for _, ms in tuned["candidates"]] == [2.5, 2.0]
