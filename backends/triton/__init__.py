"""The Triton backend: production kernels for SM80+ GPUs, also run by the CPU interpreter in tests.

Kernels are compiled through ``triton.compile`` from an explicit specialisation (``KernelSpec``),
the same one for the GPU launcher and for ahead-of-time compiles for sm_90/sm_100 without a GPU.
Kernels must work on triton 3.6 through 3.9: no block pointers.
"""
