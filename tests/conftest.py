"""Test session setup.

Without a GPU the Triton kernels run under the Triton interpreter, which must be chosen before
triton is first imported; this file is imported before any test module, so it decides here. The
CuTe kernels run, compiled for sm_90a, in the PTX emulator (FUSEDOPS_EMULATE=1; the Triton
interpreter takes precedence for Triton kernels in this process: their compiled code runs on the
emulator in subprocesses, tests/test_emulated_kernels.py).
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could select the interpreter")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("FUSEDOPS_EMULATE", "1")

# Small ops on few shared cores are many times slower with torch's thread pool, and a process
# forked after the pool started (the index-fuzz children) can hang in it.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

AOT_FIGURES_KEY = pytest.StashKey[list]()


def pytest_configure(config):
    config.stash[AOT_FIGURES_KEY] = []


def pytest_collection_modifyitems(config, items):
    """Marks the tests of ``long_tests.LONG_TESTS`` (over 10 s on one core, each with its
    reason) ``long``."""
    from long_tests import LONG_TESTS
    for item in items:
        reason = LONG_TESTS.get(item.nodeid.split("[")[0])
        if reason:
            item.add_marker(pytest.mark.long(reason=reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(AOT_FIGURES_KEY, [])
    if rows:
        terminalreporter.section("AOT resource figures (registers, spills, shared memory)")
        for row in rows:
            terminalreporter.write_line(row)


@pytest.fixture
def aot_figures(request):
    """Rows appended here are printed in the test summary."""
    return request.config.stash[AOT_FIGURES_KEY]
collect_ignore = ["add_a_family"]   # a throwaway family's files, run by test_add_a_family.py
