"""Compiling one kernel for one architecture and reading what the compiler made of it: resources
from the cubin (registers, spills, shared memory, barriers) and the instruction mix from its SASS
(tensor-core MMA kind and count, TMA and cp.async copies, barriers). No GPU needed; triton's
wheel ships cuobjdump, and ptxas assembles the CuTe DSL kernels' PTX."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

# SASS opcode classes the rules look at
MMA_KINDS = {
    "HGMMA": "wgmma",            # sm_90 warpgroup MMA
    "HMMA": "mma.sync",          # warp-level MMA (sm_80 style)
    "UTCHMMA": "tcgen05",        # sm_100 tensor-core MMA from tensor memory
    "UTCQMMA": "tcgen05",
    "UTCIMMA": "tcgen05",
    "UTCMMA": "tcgen05",
}
COPY_KINDS = {"UTMALDG": "tma load", "UTMASTG": "tma store", "UBLKCP": "bulk copy",
              "LDGSTS": "cp.async"}
BARRIER_OPS = ("BAR", "SYNCS")

_OPCODE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)", re.M)
# the wait on outstanding wgmma groups: "0x0" waits for every one (a synchronous MMA), "0x1" or
# more leaves that many in flight while the warpgroup goes on (loads, softmax, the next issue)
_WGMMA_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
# one SASS instruction: its opcode (after a predicate)
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)")
# floating-point math (the softmax's max, exponentials, sums and scalings; conversions)
_FLOAT_MATH = re.compile(r"^(F(ADD|MUL|FMA|MNMX|SEL|SETP|2F|2FP)|MUFU|H(ADD2|MUL2|FMA2))\b")
OVERLAP_MIN = 8
"""Floating-point instructions issued while a wgmma group is in flight that count as overlap: a
thread's share of the smallest score tile the kernels exponentiate (64 x 16 on a warpgroup: 8
scores), so incidental scheduling of a stray instruction does not count."""


@dataclass(frozen=True)
class Compiled:
    """What one kernel compiled to for one architecture."""

    arch: str
    registers: int
    spill_bytes: int             # local memory per thread: spills and stack arrays
    shared_bytes: int            # static + dynamic, per CTA
    opcodes: dict = field(default_factory=dict)      # SASS opcode -> count
    wgmma_in_flight: int = 0     # the most wgmma groups any wait leaves outstanding
    wgmma_overlap: int = 0       # the most float instructions issued under a wgmma in flight

    def count(self, *prefixes: str) -> int:
        return sum(n for op, n in self.opcodes.items() if op.startswith(prefixes))

    @property
    def mma(self) -> dict[str, int]:
        """MMA kind ("wgmma", "mma.sync", "tcgen05") -> instruction count."""
        out: dict[str, int] = collections.Counter()
        for op, n in self.opcodes.items():
            if op in MMA_KINDS:
                out[MMA_KINDS[op]] += n
        return dict(out)

    @property
    def wgmma_async(self) -> bool | None:
        """Whether the warpgroup MMAs overlap other work: some wait on them leaves a group in
        flight (Triton's pipelined wgmma), or the warpgroup issues at least OVERLAP_MIN
        floating-point instructions between a wgmma's issue and the wait that retires it (the
        next block's scores computed under the softmax of this one). False: every product is
        waited for before any other math; None: no wgmma."""
        if "HGMMA" not in self.opcodes:
            return None
        return self.wgmma_in_flight > 0 or self.wgmma_overlap >= OVERLAP_MIN

    @property
    def copies(self) -> dict[str, int]:
        out: dict[str, int] = collections.Counter()
        for op, n in self.opcodes.items():
            if op in COPY_KINDS:
                out[COPY_KINDS[op]] += n
        return dict(out)

    @property
    def barriers(self) -> int:
        return self.count(*BARRIER_OPS)


def tool(name: str) -> str:
    """A CUDA binary tool: from triton's wheel when it ships one, else PATH."""
    import triton
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return bundled if os.path.exists(bundled) else name


def read_cubin(cubin: bytes, arch: str, extra_shared: int = 0) -> tuple[Compiled, str]:
    """(resources and SASS opcode counts, SASS text) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([tool("cuobjdump"), "-sass", f.name], check=True,
                              capture_output=True, text=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED|STACK):(\d+)", usage))
    opcodes = dict(collections.Counter(_OPCODE.findall(sass)))
    return Compiled(arch, int(fields.get("REG", 0)),
                    int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
                    int(fields.get("SHARED", 0)) + extra_shared, opcodes, wgmma_in_flight(sass),
                    wgmma_overlap(sass)), sass


def wgmma_in_flight(sass: str) -> int:
    """The most warpgroup-MMA groups any wait in ``sass`` leaves outstanding (0: every wgmma is
    waited for at once, or there is none)."""
    return max((int(n, 16) for n in _WGMMA_WAIT.findall(sass)), default=0)


def wgmma_overlap(sass: str) -> int:
    """The most floating-point instructions (``_FLOAT_MATH``) the warpgroup issues, in program
    order, between a wgmma issue (the first HGMMA after a WARPGROUP.ARRIVE) and the next
    WARPGROUP.DEPBAR: math that runs while the tensor cores work. 0 when every product is
    waited for before any other math, or without wgmma."""
    best = count = 0
    issued = False
    for line in sass.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        op = match.group(1)
        if op.startswith("HGMMA"):
            issued = True
        elif op.startswith("WARPGROUP.DEPBAR"):
            best, count, issued = max(best, count), 0, False
        elif issued and _FLOAT_MATH.match(op):
            count += 1
    return best


TRITON_TARGETS = {"sm_80": 80, "sm_90a": 90, "sm_100a": 100}


def compile_triton(spec, arch: str, read: bool = True):
    """(Compiled, {"ptx", "sass", "cubin"}) of a Triton KernelSpec for ``arch``; without
    ``read``, (None, {}) once it compiled and its scratch is checked (the cubin not read back)."""
    from ..backends.triton.aot import check_scratch, compile_spec, gpu_target
    compiled = compile_spec(spec, gpu_target(TRITON_TARGETS[arch]))
    check_scratch(spec, compiled)
    if not read:
        return None, {}
    result, sass = read_cubin(compiled.asm["cubin"], arch)
    shared = max(result.shared_bytes, int(compiled.metadata.shared))
    result = Compiled(arch, result.registers, result.spill_bytes, shared, result.opcodes,
                      result.wgmma_in_flight, result.wgmma_overlap)
    return result, dict(ptx=compiled.asm["ptx"], sass=sass, cubin=compiled.asm["cubin"])


def compile_cute(kernel, arch: str, read: bool = True):
    """(Compiled, {"ptx", "sass", "cubin"}) of a CuteKernel for ``arch`` (PTX through ptxas);
    without ``read``, (None, {}) once it assembled."""
    from ..backends.cute.aot import assemble
    ptx, cubin = assemble(kernel, arch)
    if not read:
        return None, {}
    result, sass = read_cubin(cubin, arch, extra_shared=kernel.dynamic_shared_bytes)
    return result, dict(ptx=ptx, sass=sass, cubin=cubin)
