#!/usr/bin/env bash
# Packs the Triton that CI compiles with (the version installed here) for the lent GPU machine,
# whose image has an older one, so the GPU runs the same compiler as the emulator and the kernel
# report. The wheel (285 MiB at 3.9.0, for the machine's Python 3.12) is larger than what one
# device call may carry (64 MiB with the working tree), so its runtime files (the AMD backend,
# CUPTI and the profiler left out: the check needs none of them) travel as an xz tarball cut in
# parts of 56 MiB under .carry/triton/, one part a call; the machine keeps ignored files while it
# stays warm (30 s), so the calls follow one another:
#   call k (each part):   carry [".carry/triton/part_aX"]            command: true
#   the last call:        carry [".carry/triton/part_aZ"]
#       mkdir -p .site && cat .carry/triton/part_* | xz -d | tar x -C .site &&
#       PYTHONPATH=$PWD/.site bash bench/gpu_check.sh
# gpu_check.sh prints which Triton it imported and warns when it is not .carry/triton/VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${TRITON_VERSION:-$(python3 -c "import importlib.metadata as m; print(m.version('triton'))" 2>/dev/null \
    || .venv/bin/python -c "import importlib.metadata as m; print(m.version('triton'))")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl -x 'triton/backends/amd/*' 'triton/backends/nvidia/lib/cupti*' \
    'triton/_C/libproton.so' 'triton/profiler/*')
rm -rf .carry/triton && mkdir -p .carry/triton
tar cf - -C "$work" triton "triton-$version.dist-info" | xz -6 -T0 | split -b 56m - .carry/triton/part_
echo "$version" > .carry/triton/VERSION
du -sh .carry/triton/part_*
