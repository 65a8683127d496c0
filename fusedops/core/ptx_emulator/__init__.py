"""A PTX emulator: runs the PTX that CuTe DSL compiled for sm_90a/sm_100a on CPU memory.

It is how the CuTe kernels' numerics are checked on a machine without a GPU (the role the Triton
interpreter plays for Triton kernels), and it checks more than numerics: every global access
must fall inside one of the buffers passed to the launch and be aligned to its width, shared
accesses must stay inside the declared shared memory, ``shfl.sync`` must find every lane of
its member mask converged, and ``bar.sync`` every live thread of the CTA; a violation raises
``PtxFault`` naming the instruction, the thread and the address. Shared memory starts poisoned
(all bits set), so a read of shared memory no thread wrote shows up as NaN / -1.

Execution model: all threads of a batch of CTAs are lanes of numpy arrays (registers hold raw
bits in uint64). Each step runs the instruction at the lowest program counter among live
lanes, for the lanes at that counter, which reconverges structured control flow at its join
points. Arithmetic is IEEE: ``.rn``/``.rm``/``.rp``/``.rz`` are rounded exactly (fma included);
the ``.approx`` instructions are computed exactly, so results can differ from hardware by the
approximation's error (a few ulp). The instruction set is the subset the project's kernels
compile to; anything else raises ``PtxFault`` naming the opcode.
"""

from .faults import PtxFault
from .memory import Memory
from .program import PtxProgram

__all__ = ["Memory", "PtxFault", "PtxProgram"]
