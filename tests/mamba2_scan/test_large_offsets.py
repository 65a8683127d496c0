"""No int32 overflow in the scan kernels' addressing: the Triton forward and backward run (under
the interpreter, on the CPU) on views whose element offsets pass 2^31 (mamba_ssm's kernels fail
past ~61K tokens at h = 128, where x alone holds 2^29 elements and byte offsets pass 2^31), and
give bitwise the results of contiguous copies. The views are columns of one buffer whose token
rows lie 8 MiB apart: 9 GiB of address space of which only the touched rows (a page each) are
ever backed by memory. Run in a subprocess, so that a wrapped offset (a fault, not an error)
fails this test alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = r"""
import torch
from fusedops import Mamba2ChunkScanBackward, Mamba2ChunkScanForward

L, H, P, G, N, Q = 1100, 2, 16, 1, 16, 256
ROW = 2 ** 21                                # floats between tokens: (L - 1) * ROW > 2^31
gen = torch.Generator().manual_seed(0)
rnd = lambda *s: torch.randn(*s, generator=gen)
small = dict(x=rnd(1, L, H, P), B=rnd(1, L, G, N), C=rnd(1, L, G, N), dy=rnd(1, L, H, P))
dt, A = rnd(1, L, H) * 0.5, -torch.rand(H, generator=gen) - 0.5
D, dt_bias, h0 = rnd(H), rnd(H), rnd(1, H, P, N)

buf = torch.empty(L * ROW, dtype=torch.float32)          # virtual: rows are touched one by one
widths = dict(x=H * P, y=H * P, dy=H * P, dx=H * P, B=G * N, C=G * N, dB=G * N, dC=G * N)
views, col = {}, 0
for name, width in widths.items():
    rows = H if name in ("x", "y", "dy", "dx") else G
    views[name] = buf.as_strided((1, L, rows, width // rows), (L * ROW, ROW, width // rows, 1), col)
    col += width
for name in ("x", "B", "C", "dy"):
    views[name].copy_(small[name])
assert views["dC"].storage_offset() + (L - 1) * ROW > 2 ** 31


def run(t):
    opts = dict(chunk_size=Q, D=D, dt_bias=dt_bias, dt_softplus=True, initial_states=h0)
    fwd = Mamba2ChunkScanForward(t["x"], dt, A, t["B"], t["C"], **opts, backend="triton").compile()
    out = fwd.allocate_outputs(exclude=("y",))
    fwd.execute(t["x"], dt, A, t["B"], t["C"], t["y"], out["final_states"], out["saved"], D=D,
                dt_bias=dt_bias, initial_states=h0, workspace=fwd.allocate_workspace())
    bwd = Mamba2ChunkScanBackward(t["x"], dt, A, t["B"], t["C"], t["dy"], **opts,
                                  backend="triton").compile()
    grads = bwd.allocate_outputs(exclude=("dx", "dB", "dC"))
    bwd.execute(t["x"], dt, A, t["B"], t["C"], t["dy"], out["saved"], t["dx"], grads["ddt"],
                grads["dA"], t["dB"], t["dC"], D=D, dt_bias=dt_bias, initial_states=h0,
                **{k: v for k, v in grads.items() if k not in ("ddt", "dA")},
                workspace=bwd.allocate_workspace())
    return dict(y=t["y"], final_states=out["final_states"], dx=t["dx"], dB=t["dB"], dC=t["dC"],
                **grads)


far = run(views)
near = run(dict(small, y=torch.empty(1, L, H, P), dx=torch.empty(1, L, H, P),
                dB=torch.empty(1, L, G, N), dC=torch.empty(1, L, G, N)))
for name, value in near.items():
    assert torch.equal(far[name], value), name
    assert torch.isfinite(value).all(), name
print("OK", sorted(near))
"""


def test_views_past_int32_offsets_match_contiguous_copies():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.startswith("OK"), proc.stdout + proc.stderr[-4000:]
