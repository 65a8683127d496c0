"""A PTX emulator: runs the PTX that Triton and CuTe DSL compile for sm_80, sm_90a and sm_100a
on CPU memory.

It is how compiled kernels are checked on a machine without a GPU, and it checks more than
numerics: every global access must fall inside one of the buffers passed to the launch and be
aligned to its width; shared accesses must stay inside the CTA's shared memory; collectives must
find their warp (or warpgroup) converged and barriers every expected thread; asynchronous work
(cp.async, TMA copies, wgmma, tcgen05) is in flight until the instruction that retires it, and
touching its operands or results before that is a ``DataRace``; a CTA whose threads all wait
with nothing in flight is a ``Deadlock``; with ``Options(race_check=True)`` two warps touching
the same shared bytes between barriers (one writing) is a ``DataRace``, and
``Options(schedule="skewed")`` runs warps one at a time in a random order between barriers.
Shared and tensor memory start poisoned (all bits set), so a read of memory nobody wrote shows
as NaN / -1.

Execution model: every thread of a batch of CTAs is a lane of numpy arrays; registers hold raw
bits of their declared width. Each step runs the instruction at the lowest program counter
among runnable lanes, for the lanes at that counter (reconverging structured control flow).
Arithmetic is IEEE: ``.rn``/``.rz``/``.rm``/``.rp`` are rounded exactly (fma included);
``.approx`` instructions are computed exactly and rounded once, so they can differ from a GPU
by the approximation's error; tensor-core products are exact sums rounded once. Instructions
the emulator does not model raise ``UnsupportedPtx`` naming them when they execute.
"""

from .faults import DataRace, Deadlock, PtxFault, UnsupportedPtx
from .launch import launch, options_for, using
from .machine import Options
from .memory import Memory
from .parser import PtxProgram

__all__ = [
    "DataRace",
    "Deadlock",
    "Memory",
    "Options",
    "PtxFault",
    "PtxProgram",
    "UnsupportedPtx",
    "launch",
    "options_for",
    "using",
]
