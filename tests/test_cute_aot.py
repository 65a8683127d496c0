"""Every CuTe DSL kernel compiles for sm_90a and sm_100a at its production specialisation and a
small one, without a GPU; the PTX assembles with ptxas without spilling; figures are printed in
the test summary."""

import importlib.util
import shutil

import pytest

HAS_CUTE = (importlib.util.find_spec("cutlass") is not None
            and importlib.util.find_spec("cuda.bindings") is not None)
ARCHS = ("sm_90a", "sm_100a")


@pytest.mark.skipif(not HAS_CUTE, reason="nvidia-cutlass-dsl is not installed")
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) is not on PATH")
def test_every_cute_kernel_compiles_without_spills(aot_figures):
    from fusedops.backends.cute.aot import all_kernels
    from fusedops.backends.cute.compiler import ptxas_usage
    spilling, rows = [], 0
    for label, kernel in all_kernels():
        for arch in ARCHS:
            u = ptxas_usage(kernel, arch)
            rows += 1
            aot_figures.append(f"cute {label:<41} {u.kernel:<34} {arch:<8} regs {u.registers:>3}  "
                               f"spill {u.spill_bytes:>4} B  stack {u.stack_bytes:>3} B  shared "
                               f"{u.shared_bytes:>6} B")
            if u.spill_bytes or u.stack_bytes:
                spilling.append(f"{label} {arch}: {u.spill_bytes} B spilled, {u.stack_bytes} B stack")
    assert rows >= 2 * len(ARCHS), "no CuTe kernel was compiled"
    assert not spilling, spilling
