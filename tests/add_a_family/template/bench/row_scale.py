"""Times the row scale's eager forward at N = 8192, D = 4096 (a family that exists to try the
layout): python bench/row_scale.py [--quick]."""

import sys
import time

import torch

import fusedops.row_scale as row_scale

n, d = (64, 256) if "--quick" in sys.argv else (8192, 4096)
device = "cuda" if torch.cuda.is_available() else "cpu"
x, w = torch.randn(n, d, device=device), torch.randn(d, device=device)
row_scale.row_scale_forward(x, w, backend="torch")
start = time.perf_counter()
for _ in range(10):
    row_scale.row_scale_forward(x, w, backend="torch")
if device == "cuda":
    torch.cuda.synchronize()
print(f"row_scale_forward N={n} D={d} torch: {(time.perf_counter() - start) * 100:.3f} ms")
