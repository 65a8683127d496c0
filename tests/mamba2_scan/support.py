"""Mamba2 chunked scan: inputs, runners and comparisons the family's test modules share."""

from __future__ import annotations

import torch

import fusedops
import fusedops.ops
from fusedops import Mamba2ChunkScanForward, TensorDesc
from fusedops.mamba2_scan import samples
from fusedops.mamba2_scan.info import INFO
from fusedops.opinfo import Case, Tolerance
from fusedops.testing import assert_close

from helpers import BACKENDS, DEVICE


SCAN_BACKENDS = [b for b in BACKENDS if b in Mamba2ChunkScanForward.backends]

CPU = torch.device("cpu")

GRADS = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dinitial_states")


# Kernel backends against the fp32 torch reference. The Triton kernels, like mamba_ssm's, round
# the operands of their tensor-core products to the input dtype (decay-weighted C·B, dt-scaled B,
# the fp32 states), so their error is a few units of that dtype's rounding, not one.
KERNEL_TOLERANCE = {
    torch.float32: Tolerance(2e-5, 2e-4, "fp32 products, sums in another order"),
    torch.float16: Tolerance(3e-3, 2e-2, "fp16 operands of the tensor-core products"),
    torch.bfloat16: Tolerance(2.5e-2, 1e-1, "bf16 operands of the tensor-core products"),
}


def run(case: Case, backend: str, **kwargs) -> dict:
    """Forward and backward through the plans with caller buffers (the family's runner)."""
    return INFO.run(case, backend, **kwargs)


def compare(result, expected, tolerance, names=None):
    for name in names or expected:
        if name in result:
            assert_close(result[name], expected[name], tolerance, name)


def _descs(b, l, h, p, g, n, *, nseq=None, z=True, dtype=torch.bfloat16):
    d = lambda *shape, dt=dtype: TensorDesc(shape, dt, device="cpu")  # noqa: E731
    return dict(x=d(b, l, h, p), dt=d(b, l, h), A=d(h, dt=torch.float32), B=d(b, l, g, n),
                C=d(b, l, g, n), D=d(h, dt=torch.float32), z=d(b, l, h, p) if z else None,
                dt_bias=d(h, dt=torch.float32),
                cu_seqlens=None if nseq is None else d(nseq + 1, dt=torch.int32))


def _scan_with_status(case: Case, backend: str, status_value: int = 0):
    """Forward and backward through the eager wrappers with a status word each; returns
    (results by name, forward status, backward status)."""
    t = case.tensors
    fwd_tensors = {k: t[k] for k in ("x", "dt", "A", "B", "C", *samples.OPTIONAL)}
    fwd_status = torch.full((1,), status_value, dtype=torch.int32, device=DEVICE)
    bwd_status = torch.full((1,), status_value, dtype=torch.int32, device=DEVICE)
    y, final, saved = fusedops.mamba2_chunk_scan_forward(**fwd_tensors, **case.options,
                                                         status=fwd_status, backend=backend)
    grads = fusedops.mamba2_chunk_scan_backward(**fwd_tensors, dy=t["dy"], saved=saved,
                                                dfinal_states=t["dfinal_states"], **case.options,
                                                status=bwd_status, backend=backend)
    return dict(y=y, final_states=final, **grads), int(fwd_status), int(bwd_status)


def _with_cu(case: Case, cu: list[int]) -> Case:
    tensors = dict(case.tensors, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEVICE))
    return Case(f"{case.label} cu_seqlens={cu}", tensors, case.options)


FORWARD_NAMES = ("x", "dt", "A", "B", "C", *samples.OPTIONAL)

ALL = dict(D="h", z=True, dt_bias=True, initial_states=True, dfinal=True)


# -- 4c. sequence ids ------------------------------------------------------------------------------
SEQ_IDX = {
    "batch": [[0] * 10 + [1] * 20 + [2] * 7,        # a change mid-chunk, and one at a chunk start
              [0] * 37,                              # one sequence: the initial state throughout
              [3] * 5 + [4] * 31 + [5]],             # not starting at 0: no initial state; 1 token
    "one-row": [[0] * 16 + [1] * 16 + [2] * 5],      # changes exactly at chunk boundaries
}


def _seq_case(dtype, kind, seed, **overrides):
    ids = SEQ_IDX[kind]
    options = dict(ALL, **overrides)
    case = samples.make(len(ids), 37, 4, 8, 2, 16, dtype, seed=seed, device=DEVICE, **options)
    tensors = dict(case.tensors, seq_idx=torch.tensor(ids, dtype=torch.int32, device=DEVICE))
    return Case(f"{case.label} seq_idx {kind}", tensors, case.options)


def _seq_run(case, backend, status=None):
    t = case.tensors
    names = (*FORWARD_NAMES, "seq_idx")
    y, final, saved = fusedops.mamba2_chunk_scan_forward(**{k: t[k] for k in names}, **case.options,
                                                         status=status, backend=backend)
    grads = fusedops.mamba2_chunk_scan_backward(**{k: t[k] for k in names}, dy=t["dy"], saved=saved,
                                                dfinal_states=t["dfinal_states"], **case.options,
                                                status=status, backend=backend)
    return dict(y=y, final_states=final, **grads)


# -- 5. the performance model, the tile table, autotune candidates -------------------------------
def _production(label: str):
    """(forward plan, backward plan) of the registry's production shape ``label``, on the CPU."""
    (calls,) = [calls for name, calls in samples.production() if name == label]
    return tuple(call.build("torch") for call in calls)


def with_options(case: Case, **options) -> Case:
    return Case(case.label, case.tensors, {**case.options, **options})
