"""Ahead-of-time compiles of Triton kernel specs for a GPU architecture, and their resource
figures from the cubin. No GPU needed, but not in a process running the interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .runtime import KernelSpec, check_scratch, compile_spec  # noqa: F401 (the AOT API)


@dataclass(frozen=True)
class ResourceUsage:
    kernel: str
    arch: int
    registers: int
    local_bytes: int      # per-thread local memory: register spills or stack arrays
    shared_bytes: int
    num_warps: int

    def row(self) -> str:
        return (f"{self.kernel:<40} sm_{self.arch:<4} regs {self.registers:>3}  local "
                f"{self.local_bytes:>4} B  shared {self.shared_bytes:>6} B  warps {self.num_warps}")


def gpu_target(arch: int):
    """Triton's GPUTarget for sm_``arch`` (90, 100...)."""
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", arch, 32)


def cuobjdump_path() -> str:
    """The cuobjdump shipped inside the triton wheel."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(spec: KernelSpec, arch: int) -> ResourceUsage:
    """AOT-compiles ``spec`` for sm_``arch`` and reads registers, local (spill) and shared
    memory from the cubin with cuobjdump."""
    compiled = compile_spec(spec, gpu_target(arch))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump_path(), "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", text))
    return ResourceUsage(spec.name, arch, int(fields["REG"]),
                         int(fields["LOCAL"]) + int(fields.get("STACK", 0)),
                         max(int(fields["SHARED"]), int(compiled.metadata.shared)), spec.num_warps)
