"""Device-side helpers shared by the CuTe kernels."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def block_allreduce_sum(values: cute.Tensor, scratch: cute.Tensor, slot: cutlass.Int32,
                        COUNT: cutlass.Constexpr, NWARPS: cutlass.Constexpr):
    """Replaces each of the COUNT fp32 ``values`` of every thread by its sum over the thread
    block. ``scratch`` is shared memory of shape (COUNT, NWARPS, slots); consecutive calls must
    alternate ``slot`` so that no warp overwrites a slot another warp is still reading. The
    order of additions is fixed (butterfly in the warp, then warps in order): deterministic."""
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    for c in cutlass.range_constexpr(COUNT):
        total = cute.arch.warp_reduction_sum(values[c])
        if lane == 0:
            scratch[c, warp, slot] = total
    cute.arch.barrier()
    for c in cutlass.range_constexpr(COUNT):
        partial = Float32(0.0)
        if lane < NWARPS:
            partial = scratch[c, lane, slot]
        values[c] = cute.arch.warp_reduction_sum(partial)
