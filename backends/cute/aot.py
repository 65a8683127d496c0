"""Ahead-of-time compiles of CuTe DSL kernels for a GPU architecture, and their resource figures
from ``ptxas -v``. No GPU needed."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .compiler import CuteKernel, compile_ptx


@dataclass(frozen=True)
class PtxasUsage:
    kernel: str
    arch: str
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int
    barriers: int


def ptxas_usage(kernel: CuteKernel, arch: str) -> PtxasUsage:
    """Compiles ``kernel`` for ``arch`` keeping its PTX, assembles it with ``ptxas -v`` and
    reads registers, spills and stack; shared memory is the static amount plus the kernel's
    declared dynamic shared memory."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(compile_ptx(kernel, arch))
        proc = subprocess.run(["ptxas", f"-arch={arch}", "-v", ptx_path, "-o", ptx_path + ".cubin"],
                              capture_output=True, text=True, check=True)
    text = proc.stdout + proc.stderr
    used = re.findall(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?", text)
    spills = sum(int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text))
    stack = sum(int(s) for s in re.findall(r"(\d+) bytes stack frame", text))
    registers = max(int(u[0]) for u in used)
    barriers = max(int(u[1] or 0) for u in used)
    shared = max(int(u[2] or 0) for u in used) + kernel.dynamic_shared_bytes
    return PtxasUsage(kernel.name, arch, registers, spills, stack, shared, barriers)


def assemble(kernel: CuteKernel, arch: str) -> tuple[str, bytes]:
    """(PTX, cubin) of ``kernel`` for ``arch``: the PTX cute.compile produces, assembled by
    ptxas (the CUDA toolkit's, on PATH)."""
    ptx = compile_ptx(kernel, arch)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        subprocess.run(["ptxas", f"-arch={arch}", ptx_path, "-o", ptx_path + ".cubin"],
                       capture_output=True, text=True, check=True)
        with open(ptx_path + ".cubin", "rb") as f:
            return ptx, f.read()
