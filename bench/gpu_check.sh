#!/usr/bin/env bash
# The GPU check for a lent CUDA machine: the test suite (GPU tests included; the AOT compile tests,
# CPU-only work that CI runs, are left out) and every benchmark, in under 8 minutes on one H200.
# Logs, JSON and plots go to $OUT (default bench_out).
# Run from the repository root: bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
$PY -m fusedops check
status=0
timeout 150 $PY -m pytest -q -x -rs -k "not aot" tests 2>&1 | tee "$OUT/pytest.log" || status=1
timeout 45 $PY bench/engram_gate.py --json "$OUT/engram_gate.json" --png "$OUT/engram_gate.png" \
    2>&1 | tee "$OUT/bench_engram_gate.log" || status=1
timeout 75 $PY bench/mamba2_scan.py --json "$OUT/mamba2_scan.json" --png "$OUT/mamba2_scan.png" \
    2>&1 | tee "$OUT/bench_mamba2_scan.log" || status=1
timeout 45 $PY bench/mamba2_decode.py --json "$OUT/mamba2_decode.json" --png "$OUT/mamba2_decode.png" \
    2>&1 | tee "$OUT/bench_mamba2_decode.log" || status=1
timeout 90 $PY bench/attention.py --json "$OUT/attention.json" --png "$OUT/attention.png" \
    2>&1 | tee "$OUT/bench_attention.log" || status=1
timeout 75 $PY bench/moe.py --tokens 8192 32768 --json "$OUT/moe.json" --png "$OUT/moe.png" \
    2>&1 | tee "$OUT/bench_moe.log" || status=1
exit $status
