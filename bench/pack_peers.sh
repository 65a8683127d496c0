#!/usr/bin/env bash
# Packs the pure-Python peers the benchmarks compare against, for a GPU machine without a
# package registry, into .carry/peers (a site directory; about 3 MB):
#   mamba_ssm (its Triton SSD kernels and selective_state_update; the sources of the sdist, whose
#     CUDA extensions are not built: bench/peers.py imports the Triton modules without them),
#   fla-core / flash-linear-attention (FLA's chunk_simple_gla), and einops.
# On the device:  carry [".carry/peers"]  and run with  PYTHONPATH=$PWD/.carry/peers
# (bench/gpu_check.sh adds it when the directory exists).
set -euo pipefail
cd "$(dirname "$0")/.."
MAMBA=${MAMBA_SSM_VERSION:-2.3.2.post1}
FLA=${FLA_VERSION:-0.6.0}
rm -rf .carry/peers .carry/peers_dl && mkdir -p .carry/peers .carry/peers_dl
url=$(python3 -c "import json,urllib.request
d=json.load(urllib.request.urlopen('https://pypi.org/pypi/mamba-ssm/json'))
print(next(f['url'] for f in d['releases']['$MAMBA'] if f['packagetype']=='sdist'))")
curl -sL "$url" -o .carry/peers_dl/mamba.tar.gz
tar xzf .carry/peers_dl/mamba.tar.gz -C .carry/peers_dl
cp -r .carry/peers_dl/mamba_ssm-*/mamba_ssm .carry/peers/
python3 -m pip download -q --no-deps --only-binary=:all: -d .carry/peers_dl \
    "fla-core==$FLA" "flash-linear-attention==$FLA" einops
for wheel in .carry/peers_dl/*.whl; do (cd .carry/peers && unzip -qo "../../$wheel"); done
rm -rf .carry/peers_dl
du -sh .carry/peers
