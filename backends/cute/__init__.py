"""The CuTe DSL backend: kernels for Hopper (sm_90a) and Blackwell (sm_100a).

Kernels are compiled with ``cute.compile(..., options="--gpu-arch ...")`` at plan compile time
(the same call compiles them to PTX without a GPU in CI), cached process-wide by plan-time values,
and launched on the caller's stream. Needs nvidia-cutlass-dsl >= 4.7 and cuda-python.
"""
