"""Every Triton kernel compiles ahead of time for sm_90 and sm_100 at its production
specialisations, without spilling; the resource figures are printed in the test summary."""

import json
import os
import subprocess
import sys

import pytest

from helpers import HAS_TRITON

ARCHS = (90, 100)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_aot_compile_every_kernel_for_sm90_and_sm100(aot_figures):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run([sys.executable, "-m", "fusedops.backends.triton.aot", "--json", "--arch",
                           *map(str, ARCHS)], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    from fusedops.backends.triton.aot import OPERATOR_MODULES
    assert rows, "no kernel was compiled"
    labels = {r["label"] for r in rows}
    for label in labels:
        assert {r["arch"] for r in rows if r["label"] == label} == set(ARCHS), label
    for r in rows:
        aot_figures.append(f"{r['label']:<46} {r['kernel']:<34} sm_{r['arch']:<4} regs {r['registers']:>3}  "
                           f"local {r['local_bytes']:>4} B  shared {r['shared_bytes']:>6} B  warps {r['num_warps']}")
    spilling = [f"{r['label']} sm_{r['arch']}: {r['local_bytes']} B local" for r in rows if r["local_bytes"]]
    assert not spilling, f"register spills in {spilling} (modules: {OPERATOR_MODULES})"
    over_budget = [r["label"] for r in rows if r["registers"] * 32 * r["num_warps"] > 65536]
    assert not over_budget, f"kernels that cannot launch one CTA per SM: {over_budget}"
