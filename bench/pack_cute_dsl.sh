#!/usr/bin/env bash
# Packs nvidia-cutlass-dsl for the lent H200 (Python 3.12, CUDA 13; the image does not have it)
# into .carry/. Its cu13 library wheel is larger than what one device call may carry (64 MiB), so
# it travels as an xz tarball (63 MiB at 4.8.1) in a call of its own and is unpacked into .site/ (ignored, kept while
# the machine stays warm):
#   call 1: carry [".carry/cute_libs_cu13.tar.xz"]
#           mkdir -p .site && tar xJf .carry/cute_libs_cu13.tar.xz -C .site
#   call 2: carry [".carry/wheels"]
#           python3 -m pip install -q --no-index --no-deps --target .site .carry/wheels/*.whl &&
#           PYTHONPATH=$PWD/.site:$PWD/.site/nvidia_cutlass_dsl/dsl_packages bash bench/gpu_check.sh
set -euo pipefail
version=${CUTE_DSL_VERSION:-4.8.1}
cd "$(dirname "$0")/.."
rm -rf .carry && mkdir -p .carry/wheels .carry/libs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .carry/wheels "nvidia-cutlass-dsl==$version" \
    "nvidia-cutlass-dsl-libs-base==$version" "nvidia-cutlass-dsl-libs-core==$version" \
    "nvidia-cutlass-dsl-libs-cu13==$version"
(cd .carry/libs && unzip -q ../wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
tar cf - -C .carry/libs . | xz -9 -T2 > .carry/cute_libs_cu13.tar.xz
rm -rf .carry/libs .carry/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl
du -sh .carry/cute_libs_cu13.tar.xz .carry/wheels
