#!/usr/bin/env bash
# The GPU check for a lent CUDA machine, in under 8 minutes on one H200: the test suite (GPU tests
# included; the AOT compiles and the kernel report, CPU work that CI runs, are left out), the
# index-data fuzz cases under compute-sanitizer memcheck, every benchmark of the registry with
# its peers (carried by bench/pack_peers.sh, found by bench/peers.py), and a one-page summary.
# Logs, JSON and plots go to $OUT (default bench_out).
#   bash bench/gpu_check.sh            on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --dry-run  on any machine: the same steps on tiny CPU shapes (CI runs
#                                      it, so the first GPU run cannot fail on a script error)
set -uo pipefail
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# a fresh autotune record in $OUT: the autotuned rows time every candidate, and the summary lists
# them (which tile-table entries a GPU prefers)
export FUSEDOPS_CACHE_DIR="$OUT/fusedops_cache"
PY=${PYTHON:-python3}
if [ -d .carry/peers ]; then export PYTHONPATH="$PWD/.carry/peers${PYTHONPATH:+:$PYTHONPATH}"; fi
status=0
step() {  # step SECONDS LOG COMMAND...: run with a time limit, tee the log, remember a failure
    local limit=$1 log=$2; shift 2
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" || { echo "FAILED ($log): $*"; status=1; }
}
if [ $DRY = 0 ]; then
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
fi
# the compiler that runs: CI compiles (the emulator, the kernel report) with the Triton of
# .carry/triton/VERSION, carried here by bench/pack_triton.sh
$PY -c "import triton; print('triton', triton.__version__, 'from', triton.__file__)" | tee "$OUT/triton.log"
if [ -f .carry/triton/VERSION ] && ! grep -q "triton $(cat .carry/triton/VERSION) " "$OUT/triton.log"; then
    echo "WARNING: CI compiles with triton $(cat .carry/triton/VERSION); this run uses another" | tee -a "$OUT/triton.log"
fi
step 60 check.log $PY -m fusedops check
step 60 peers.log $PY bench/peers.py
if [ $DRY = 0 ]; then
    step 60 pytest.log $PY -m pytest -q -x -rs -m gpu tests
    if command -v compute-sanitizer >/dev/null; then
        step 40 memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 \
            $PY -m pytest -q -x tests/test_index_fuzz.py -k "triton or cute"
    else
        echo "compute-sanitizer is not on PATH: the fuzz cases run without memcheck" | tee "$OUT/memcheck.log"
        step 40 memcheck.log $PY -m pytest -q -x tests/test_index_fuzz.py
    fi
fi
QUICK=()
[ $DRY = 1 ] && QUICK=(--quick)
DRY_LIMIT=240   # the dry run's tiny shapes run on CPU (the Triton interpreter), not against the clock
# seconds per benchmark on one H200, Triton compiles and the peers' autotuning included; the
# check's steps add up to about 7.5 minutes
declare -A LIMIT=([engram_gate]=30 [mamba2_scan]=110 [mamba2_inference]=30
                  [mamba2_inference_state_storage]=15
                  [gqa_attention]=70 [relu2_moe]=90)
for name in $($PY -c "from fusedops.__main__ import benchmarks; print(' '.join(benchmarks()))"); do
    limit=${LIMIT[$name]:-60}
    [ $DRY = 1 ] && limit=$DRY_LIMIT
    step "$limit" "bench_$name.log" $PY "bench/$name.py" "${QUICK[@]}" \
        --json "$OUT/$name.json" --png "$OUT/$name.png"
done
step 30 summary.log $PY bench/summary.py "$OUT"
exit $status
