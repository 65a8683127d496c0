"""Mamba2 chunked scan: the plans' contract. Construction and validation errors naming the argument, options,
views and strides, the status word, host checks, eager wrappers and torch ops, CUDA Graph capture.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fusedops
import fusedops.ops
from fusedops import Mamba2ChunkScanBackward, Mamba2ChunkScanForward, TensorDesc
from fusedops.core.status import Status
from fusedops.errors import ValidationError
from fusedops.plan import EAGER_PLANS
from fusedops.mamba2_scan import samples
from fusedops.mamba2_scan.info import INFO
from fusedops.mamba2_scan.oracle import scan_with_gradients
from fusedops.testing import HostReads

from helpers import DEVICE, requires_cuda

from .support import ALL, CPU, FORWARD_NAMES, GRADS, SCAN_BACKENDS, _descs, _with_cu, run


def test_oracle_names_every_result():
    case = samples.small("varlen", torch.float64, device=CPU)
    assert set(run(case, "torch")) == set(INFO.oracle(case))
    assert set(scan_with_gradients(case.tensors)) >= {"y", "final_states", *GRADS}


# -- 3. validation --------------------------------------------------------------------------------
def _base_inputs(**kw):
    t = samples.make(2, 20, 4, 8, 2, 8, torch.bfloat16, seed=12, device=DEVICE, **kw).tensors
    return {k: t[k] for k in ("x", "dt", "A", "B", "C")}, t


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.zeros(2, 20, 32, dtype=torch.bfloat16)), r"x: expected a 4-d tensor \[b, l, h, p\]"),
    (dict(dt=torch.zeros(2, 20, 4, dtype=torch.float16)), r"dt: expected dtype bfloat16 or float32, got float16"),
    (dict(A=torch.zeros(4, dtype=torch.bfloat16)), r"A: expected dtype float32, got bfloat16"),
    (dict(B=torch.zeros(2, 20, 3, 8, dtype=torch.bfloat16)), r"B: expected shape \[b, l, g, n\] with .* g >= 1 dividing h = 4"),
    (dict(C=torch.zeros(2, 20, 2, 4, dtype=torch.bfloat16)), r"C: expected shape \[b, l, g, n\] like B = \[2, 20, 2, 8\]"),
    (dict(chunk_size=48), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got 48"),
    (dict(chunk_size=64.0), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got 64.0"),
    (dict(chunk_size=True), r"chunk_size: expected one of \(16, 32, 64, 128, 256\), got True"),
    (dict(D=torch.zeros(3)), r"D: expected shape \[h\] = \[4\] or \[h, p\] = \[4, 8\], got \[3\]"),
    (dict(initial_states=torch.zeros(3, 4, 8, 8)), r"initial_states: expected shape \[b, h, p, n\] = \[2, 4, 8, 8\]"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)), r"x: expected b == 1 with cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 20], dtype=torch.int64)), r"cu_seqlens: expected dtype int32, got int64"),
    (dict(dt_limit=(1.0, 0.5)), r"dt_limit: expected lo <= hi"),
    (dict(dt_softplus=1), r"dt_softplus: expected a bool, got 1"),
    (dict(x=torch.zeros(2, 20, 8, 4, dtype=torch.bfloat16).transpose(2, 3)), r"x: expected the last dimension contiguous"),
    (dict(seq_idx=torch.zeros(2, 20, dtype=torch.int64)), r"^seq_idx: expected dtype int32, got int64"),
    (dict(seq_idx=torch.zeros(2, 21, dtype=torch.int32)), r"^seq_idx: expected shape \[b, l\] like x's first two dims = \[2, 20\]"),
])
def test_construction_errors(change, match):
    core, _ = _base_inputs()
    args = dict(core, chunk_size=16)
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    with pytest.raises(ValidationError, match=match):
        Mamba2ChunkScanForward(**args, backend="torch")


def test_execute_errors_and_properties():
    core, t = _base_inputs(z=True)
    fwd = Mamba2ChunkScanForward(**core, chunk_size=16, z=t["z"], backend="torch").compile()
    y = torch.empty_like(t["x"])
    fin = torch.empty(2, 4, 8, 8, device=DEVICE)
    with pytest.raises(ValidationError, match=r"z: expected a torch.Tensor, got NoneType"):
        fwd.execute(*core.values(), y, fin, fwd.allocate_saved())
    with pytest.raises(ValidationError, match=r"D: this plan was built without D"):
        fwd.execute(*core.values(), y, fin, fwd.allocate_saved(), z=t["z"], D=torch.zeros(4, device=DEVICE))
    with pytest.raises(ValidationError, match=r"y: must not overlap x"):
        fwd.execute(*core.values(), t["x"], fin, fwd.allocate_saved(), z=t["z"])
    assert fwd.problem.max_segments == 4 and fwd.problem.states_bytes == 4 * 4 * 8 * 8 * 2   # bf16
    assert fwd.saved_size == 0 and fwd.saved_states_bytes == fwd.problem.states_bytes


def test_saved_and_workspace_formulas():
    """The Triton program's saved buffer: the segment-start states in state_dtype (unless
    recomputed) and y before the gate; the forward and backward declare the same layout; the
    backward's dH1 workspace is in the input dtype."""
    pytest.importorskip("triton")
    descs = _descs(2, 8192, 128, 64, 8, 128)
    fwd = Mamba2ChunkScanForward(**descs, chunk_size=256, dt_softplus=True, backend="torch")
    p = fwd.problem
    assert p.max_segments == 64 and p.states_bytes == 64 * 128 * 64 * 128 * 2     # bf16 states
    triton_fwd = fwd.kernel_program("triton")
    assert triton_fwd.saved.size == p.states_bytes + 2 * 8192 * 128 * 64 * 2
    bwd = Mamba2ChunkScanBackward(**descs, dy=descs["x"], chunk_size=256, dt_softplus=True,
                                  backend="torch")
    assert bwd.kernel_program("triton").saved.size == triton_fwd.saved.size
    _, dstates_dtype, dstates_numel = bwd.kernel_program("triton").workspace.offsets["dstates"]
    assert (dstates_dtype, dstates_numel) == (torch.bfloat16, 64 * 128 * 64 * 128)   # dH1, bf16
    fp32_descs = _descs(2, 8192, 128, 64, 8, 128, dtype=torch.float32)
    fp32_bwd = Mamba2ChunkScanBackward(**fp32_descs, dy=fp32_descs["x"], chunk_size=256,
                                       backend="torch")
    assert fp32_bwd.kernel_program("triton").workspace.offsets["dstates"][1] == torch.float32
    recompute = Mamba2ChunkScanForward(**descs, chunk_size=256, recompute_states=True, backend="torch")
    assert recompute.kernel_program("triton").saved.size == 2 * 8192 * 128 * 64 * 2
    assert recompute.saved_states_bytes == 0
    fp32 = Mamba2ChunkScanForward(**descs, chunk_size=256, state_dtype=torch.float32, backend="torch")
    assert fp32.kernel_program("triton").saved.size == 2 * p.states_bytes + 2 * 8192 * 128 * 64 * 2
    varlen = Mamba2ChunkScanForward(**_descs(1, 8192, 128, 64, 8, 128, nseq=10), chunk_size=256,
                                    backend="torch")
    assert varlen.problem.max_segments == 32 + 10


@pytest.mark.parametrize("cu,match", [
    ([3, 5, 5, 21, 22, 41], r"^cu_seqlens: expected offsets starting at 0, got cu_seqlens\[0\] = 3$"),
    ([0, 5, 30, 21, 22, 41], r"^cu_seqlens: expected non-decreasing offsets, got cu_seqlens\[3\] = 21 "
                             r"< cu_seqlens\[2\] = 30$"),
    ([0, 5, 5, 21, 22, 42], r"^cu_seqlens: expected offsets up to the 41 packed tokens, got "
                            r"cu_seqlens\[5\] = 42$"),
])
def test_check_inputs_names_the_bad_entry(cu, match, monkeypatch):
    """check_inputs=True (or FUSEDOPS_CHECK_INPUTS=1) checks cu_seqlens on the host before
    anything runs: the eager wrappers, the torch op and plan.check_index_values."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=33, device=DEVICE), cu)
    t = case.tensors
    fwd = {k: t[k] for k in ("x", "dt", "A", "B", "C", *samples.OPTIONAL)}
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_forward(**fwd, **case.options, check_inputs=True, backend="torch")
    saved = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_backward(**fwd, dy=t["dy"], saved=saved, **case.options,
                                            check_inputs=True, backend="torch")
    options = {k: v for k, v in case.options.items() if k != "recompute_states"}
    with pytest.raises(ValidationError, match=match):
        fusedops.ops.mamba2_chunk_scan(**fwd, **options, check_inputs=True, backend="torch")
    plan = Mamba2ChunkScanForward(**fwd, **case.options, backend="torch")
    with pytest.raises(ValidationError, match=match):
        plan.check_index_values(cu_seqlens=t["cu_seqlens"])
    monkeypatch.setenv("FUSEDOPS_CHECK_INPUTS", "1")
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_forward(**fwd, **case.options, backend="torch")
    y, _, _ = fusedops.mamba2_chunk_scan_forward(**fwd, **case.options, check_inputs=False,
                                                 backend="torch")
    assert torch.isfinite(y).all()


def test_status_word_validation():
    core, _ = _base_inputs()
    for status, match in ((torch.zeros(1, dtype=torch.int64), r"^status: expected dtype int32, got int64"),
                          (torch.zeros(2, dtype=torch.int32),
                           r"^status: expected shape \[1\] = \[1\], got \[2\]")):
        with pytest.raises(ValidationError, match=match):
            Mamba2ChunkScanForward(**core, chunk_size=16, status=status.to(DEVICE), backend="torch")
    plan = Mamba2ChunkScanForward(**core, chunk_size=16, backend="torch").compile()
    with pytest.raises(ValidationError, match=r"^status: this plan was built without status"):
        plan.execute(*core.values(), *plan.allocate_outputs().values(),
                     status=torch.zeros(1, dtype=torch.int32, device=DEVICE))


def _eager_calls():
    """(label, fn(**options)) for every eager wrapper and torch op of the scan."""
    core, t = _base_inputs()
    dy = t["dy"]
    saved = torch.empty(0, dtype=torch.uint8, device=DEVICE)
    return [
        ("forward", lambda **o: fusedops.mamba2_chunk_scan_forward(*core.values(), **o)),
        ("backward", lambda **o: fusedops.mamba2_chunk_scan_backward(*core.values(), dy, saved, **o)),
        ("torch op", lambda **o: fusedops.ops.mamba2_chunk_scan(*core.values(), **o)),
    ]


WRONG_OPTIONS = [("chunk_size", 64.0), ("chunk_size", "64"), ("chunk_size", True),
                 ("dt_softplus", 1), ("dt_limit", object()), ("dt_limit", (0.0,)),
                 ("recompute_states", "yes"), ("backend", 3), ("backend", "cudnn"),
                 ("current_stream", "stream"), ("check_inputs", 1)]


@pytest.mark.parametrize("label,index", [("forward", 0), ("backward", 1), ("torch op", 2)])
@pytest.mark.parametrize("option,value", WRONG_OPTIONS,
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(WRONG_OPTIONS)])
def test_wrong_typed_options_raise_validation_errors(label, index, option, value):
    """chunk_size=64.0 is refused (not truncated to 64) by the eager wrappers and the torch op,
    like every wrongly typed option: a ValidationError naming the option, not a TypeError."""
    fn = _eager_calls()[index][1]
    params = inspect.signature({"forward": fusedops.mamba2_chunk_scan_forward,
                                "backward": fusedops.mamba2_chunk_scan_backward,
                                "torch op": fusedops.ops.mamba2_chunk_scan}[label]).parameters
    if option not in params:
        pytest.skip(f"{label} takes no {option}")
    with pytest.raises(ValidationError, match=rf"^{option}: expected"):
        fn(**{option: value}, **({} if option == "backend" else {"backend": "torch"}))


def test_refused_chunk_size_does_not_poison_the_eager_plan_cache():
    """chunk_size=64.0: refused by the plans, the eager wrappers and the torch op before the
    eager plan cache is consulted; a later chunk_size=64 call builds and runs its plan."""
    core, _ = _base_inputs()
    with pytest.raises(ValidationError, match=r"^chunk_size: expected one of"):
        Mamba2ChunkScanForward(**core, chunk_size=64.0, backend="torch")
    size = len(EAGER_PLANS)
    for _, fn in _eager_calls():
        with pytest.raises(ValidationError,
                           match=r"^chunk_size: expected one of \(16, 32, 64, 128, 256\), got 64.0"):
            fn(chunk_size=64.0, backend="torch")
        assert len(EAGER_PLANS) == size
    y, _, _ = fusedops.mamba2_chunk_scan_forward(*core.values(), 64, backend="torch")
    size = len(EAGER_PLANS)
    again, _, _ = fusedops.mamba2_chunk_scan_forward(*core.values(), 64, backend="torch")
    assert len(EAGER_PLANS) == size and torch.equal(again, y)
    y_op, _ = fusedops.ops.mamba2_chunk_scan(*core.values(), 64, backend="torch")
    assert torch.equal(y_op, y)



def test_torch_backend_reads_no_index_value_on_the_host():
    """The torch backend sanitises and reports with device ops only (capturable, no sync)."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=34, device=DEVICE),
                    [0, 50, 5, 21, 22, 41])
    t = case.tensors
    args = {k: t[k] for k in ("x", "dt", "A", "B", "C", *samples.OPTIONAL)}
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    fwd = Mamba2ChunkScanForward(**args, **case.options, status=status, backend="torch").compile()
    bwd = Mamba2ChunkScanBackward(**args, dy=t["dy"], dfinal_states=t["dfinal_states"],
                                  **case.options, status=status, backend="torch").compile()
    outputs = fwd.allocate_outputs()
    grads = bwd.allocate_outputs()
    with HostReads() as mode:
        fwd.execute(**args, **outputs, status=status)
        bwd.execute(**args, dy=t["dy"], saved=outputs["saved"], dfinal_states=t["dfinal_states"],
                    **grads, status=status)
    assert mode.reads == [] and int(status) == Status.CU_SEQLENS


# -- 4b. strided views -----------------------------------------------------------------------------
STRIDED_DTYPES = {"torch": torch.float32, "triton": torch.bfloat16}


def _in_wider(tensor, extra, fill=0.0, offset=0):
    """(buffer, view): ``tensor`` [..., h, w] (or [..., w]) as columns [offset, offset + h·w) of
    a wider buffer [..., h·w + extra] filled with ``fill`` (a slice of a fused projection)."""
    width = tensor.shape[-1] * (tensor.shape[-2] if tensor.dim() == 4 else 1)
    buffer = torch.full((*tensor.shape[:2], width + extra), fill, dtype=tensor.dtype,
                        device=tensor.device)
    view = buffer[..., offset:offset + width]
    view = view.unflatten(-1, tensor.shape[-2:]) if tensor.dim() == 4 else view
    view.copy_(tensor)
    return buffer, view


def _projection_views(t):
    """x, B, C and z as slices of one in-projection-like buffer (x after 16 other columns), dt
    as a slice of another, dy as a view of a wider buffer: what a Mamba2 layer hands the scan."""
    x, B, C, z = t["x"], t["B"], t["C"], t["z"]
    widths = [16, x[0, 0].numel(), B[0, 0].numel(), C[0, 0].numel(), z[0, 0].numel(), 8]
    proj = torch.zeros(*x.shape[:2], sum(widths), dtype=x.dtype, device=x.device)
    views, start = {}, widths[0]
    for name, width in zip(("x", "B", "C", "z"), widths[1:]):
        views[name] = proj[..., start:start + width].unflatten(-1, t[name].shape[-2:])
        views[name].copy_(t[name])
        start += width
    _, views["dt"] = _in_wider(t["dt"], 24, offset=8)
    _, views["dy"] = _in_wider(t["dy"], 16, offset=8)
    return views


def _run_views(case, backend, views, outputs):
    """Forward and backward through the plans with the given inputs (``views``) writing y, dx,
    ddt, dB, dC and dz into ``outputs``."""
    t = dict(case.tensors, **views)
    fwd = Mamba2ChunkScanForward(**{k: t[k] for k in FORWARD_NAMES}, **case.options,
                                 backend=backend).compile()
    out = dict(fwd.allocate_outputs(), y=outputs["y"])
    fwd.execute(**{k: t[k] for k in FORWARD_NAMES}, **out, workspace=fwd.allocate_workspace())
    bwd = Mamba2ChunkScanBackward(**{k: t[k] for k in FORWARD_NAMES}, dy=t["dy"],
                                  dfinal_states=t["dfinal_states"], **case.options,
                                  backend=backend).compile()
    grads = dict(bwd.allocate_outputs(), **{k: outputs[k] for k in ("dx", "ddt", "dB", "dC", "dz")})
    bwd.execute(**{k: t[k] for k in FORWARD_NAMES}, dy=t["dy"], saved=out["saved"],
                dfinal_states=t["dfinal_states"], **grads, workspace=bwd.allocate_workspace())
    return dict(y=out["y"], final_states=out["final_states"],
                **{k: grads[k] for k in bwd.gradient_names})


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed-uncovered"])
def test_strided_views_go_in_and_out_without_copies(backend, packed):
    """x, B, C, z as slices of one projection, dt and dy as views of wider buffers, and y, dx,
    ddt, dB, dC, dz written straight into views of NaN-filled wider buffers: the same bits as
    the contiguous run, nothing written beside (packed: tokens no sequence covers, zeroed in
    place)."""
    dtype = STRIDED_DTYPES[backend]
    if packed:
        case = samples.make(1, 37, 8, 8, 2, 16, dtype, seed=40, device=DEVICE, lengths=[5, 0, 20, 12],
                            **ALL)
        case.tensors["cu_seqlens"] = torch.tensor([0, 5, 5, 25, 30], dtype=torch.int32, device=DEVICE)
    else:
        case = samples.make(2, 37, 8, 8, 2, 16, dtype, seed=40, device=DEVICE, **ALL)
    t = case.tensors
    contiguous = dict(y=torch.empty_like(t["x"]), dx=torch.empty_like(t["x"]),
                      dz=torch.empty_like(t["x"]), ddt=torch.empty_like(t["dt"]),
                      dB=torch.empty_like(t["B"]), dC=torch.empty_like(t["C"]))
    expected = _run_views(case, backend, {}, contiguous)
    likes = dict(y="x", dx="x", dz="x", ddt="dt", dB="B", dC="C")
    buffers = {name: _in_wider(torch.empty_like(t[like]), 16, float("nan"), offset=8)
               for name, like in likes.items()}
    result = _run_views(case, backend, _projection_views(t),
                        {name: view for name, (_, view) in buffers.items()})
    for name, value in expected.items():
        assert torch.equal(result[name], value), name
    for name, (buffer, view) in buffers.items():
        assert torch.isnan(buffer[..., :8].float()).all() and torch.isnan(buffer[..., -8:].float()).all(), name


def test_strides_must_keep_rows_aligned():
    """Views need rows of whole 16-byte vectors with the other strides multiples of 16 bytes;
    an operand whose rows are not whole vectors (4 bf16 heads of dt: 8 bytes) is taken
    contiguous only, and a contiguous tensor of any size is always taken."""
    core, t = _base_inputs()
    x = torch.zeros(2, 20, 4, 9, dtype=torch.bfloat16, device=DEVICE)[..., :8]   # rows 18 bytes apart
    with pytest.raises(ValidationError, match=r"^x: expected strides of multiples of 16 bytes"):
        Mamba2ChunkScanForward(**dict(core, x=x), chunk_size=16, backend="torch")
    _, dt = _in_wider(t["dt"], 8)
    with pytest.raises(ValidationError, match=r"^dt: expected a contiguous tensor \(a view needs rows of a "
                                              r"multiple of 16 bytes; 4 bfloat16 elements make 8\)"):
        Mamba2ChunkScanForward(**dict(core, dt=dt), chunk_size=16, backend="torch")
    assert Mamba2ChunkScanForward(**dict(core, dt=dt.contiguous()), chunk_size=16, backend="torch")
    plan = Mamba2ChunkScanForward(**core, chunk_size=16, backend="torch").compile()
    out = plan.allocate_outputs()
    y = torch.zeros(2, 20, 4, 9, dtype=torch.bfloat16, device=DEVICE)[..., :8]
    with pytest.raises(ValidationError, match=r"^y: expected the last dimension contiguous and the other "
                                              r"strides multiples of 16 bytes"):
        plan.execute(*core.values(), y, out["final_states"], out["saved"])


def test_torch_op_hands_views_to_the_plans(monkeypatch):
    """fusedops.ops.mamba2_chunk_scan passes the layer's slices to the plans as they are (no
    copy), copies only a layout the plans cannot read (a transposed gradient), and its
    gradients through views equal those through contiguous tensors."""
    case = samples.make(2, 20, 8, 8, 2, 16, torch.float32, seed=41, device=DEVICE, D="h", z=True,
                        dt_bias=True)
    t = case.tensors
    views = _projection_views(t)
    seen = {}
    original = fusedops.mamba2_scan.ops.mamba2_chunk_scan_forward

    def spy(x, dt, A, B, C, *args, **kwargs):
        seen.update(x=x, dt=dt, B=B, C=C, z=kwargs["z"])
        return original(x, dt, A, B, C, *args, **kwargs)
    monkeypatch.setattr(fusedops.mamba2_scan.ops, "mamba2_chunk_scan_forward", spy)
    leaves = {k: views[k].detach().requires_grad_() if k in views else t[k]
              for k in ("x", "dt", "B", "C", "z")}
    args = dict(chunk_size=16, D=t["D"], dt_bias=t["dt_bias"], dt_softplus=True, backend="torch")
    y, _ = fusedops.ops.mamba2_chunk_scan(leaves["x"], leaves["dt"], t["A"], leaves["B"], leaves["C"],
                                          z=leaves["z"], **{k: v for k, v in args.items() if k != "chunk_size"},
                                          chunk_size=16)
    for name in ("x", "dt", "B", "C", "z"):
        assert seen[name].data_ptr() == views[name].data_ptr(), name
        assert seen[name].stride() == views[name].stride(), name
    y.backward(t["dy"])
    dense = {k: t[k].clone().requires_grad_() for k in ("x", "dt", "B", "C", "z")}
    y2, _ = fusedops.ops.mamba2_chunk_scan(dense["x"], dense["dt"], t["A"], dense["B"], dense["C"],
                                           z=dense["z"], **args)
    y2.backward(t["dy"])
    assert torch.equal(y, y2)
    for name in dense:
        assert torch.equal(leaves[name].grad, dense[name].grad), name


@pytest.mark.parametrize("ids,match", [
    ([[0, 0, 1, 0]], r"^seq_idx: expected ids non-decreasing along a row, got seq_idx\[0, 3\] = 0 < "
                     r"seq_idx\[0, 2\] = 1$"),
    ([[0, 0, -1, -1]], r"^seq_idx: expected non-negative ids, got seq_idx\[0, 2\] = -1$"),
])
def test_check_inputs_names_the_bad_seq_idx(ids, match):
    case = samples.make(1, 4, 2, 8, 1, 8, torch.float32, seed=46, device=DEVICE)
    t = case.tensors
    seq_idx = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    core = [t[k] for k in ("x", "dt", "A", "B", "C")]
    with pytest.raises(ValidationError, match=match):
        fusedops.mamba2_chunk_scan_forward(*core, 16, seq_idx=seq_idx, check_inputs=True,
                                           backend="torch")
    with pytest.raises(ValidationError, match=match):
        fusedops.ops.mamba2_chunk_scan(*core, 16, seq_idx=seq_idx, check_inputs=True,
                                       backend="torch")


def test_seq_idx_and_segment_states_validation():
    core, _ = _base_inputs()
    seq_idx = torch.zeros(2, 20, dtype=torch.int32, device=DEVICE)
    packed = {k: v[:1] for k, v in core.items() if k != "A"}
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValidationError, match=r"^seq_idx: expected None with cu_seqlens"):
        Mamba2ChunkScanForward(**packed, A=core["A"], chunk_size=16, cu_seqlens=cu,
                               seq_idx=seq_idx[:1], backend="torch")
    with pytest.raises(ValidationError, match=r"^segment_states: expected None with cu_seqlens"):
        Mamba2ChunkScanForward(**packed, A=core["A"], chunk_size=16, cu_seqlens=cu, backend="torch",
                               segment_states=TensorDesc((3, 4, 8, 8), torch.float32, device=DEVICE))
    with pytest.raises(ValidationError, match=r"^segment_states: expected shape \[b·ceil\(l / chunk_size\), "
                                              r"h, p, n\] = \[4, 4, 8, 8\]"):
        Mamba2ChunkScanForward(**core, chunk_size=16, backend="torch",
                               segment_states=TensorDesc((3, 4, 8, 8), torch.float32, device=DEVICE))


def _varlen_case(seed):
    return samples.make(1, 3000, 16, 64, 2, 64, torch.bfloat16, seed=seed, device=DEVICE,
                        chunk=256, lengths=[700, 1, 0, 256, 2043], **samples.ALL_OPTIONS)


@requires_cuda
@pytest.mark.gpu
def test_gpu_varlen_and_graph_capture():
    """Forward and backward captured together in one graph, replayed on new inputs copied into
    the same buffers: equal to a fresh run."""
    t = _varlen_case(21).tensors
    opts = {k: t[k] for k in ("D", "z", "dt_bias", "initial_states", "cu_seqlens")}
    core = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    fwd = Mamba2ChunkScanForward(**core, chunk_size=256, dt_softplus=True, **opts).compile()
    bo = dict(opts, dfinal_states=t["dfinal_states"])
    bwd = Mamba2ChunkScanBackward(**core, dy=t["dy"], chunk_size=256, dt_softplus=True, **bo).compile()
    y, fin = torch.empty_like(t["x"]), torch.empty(fwd.desc("final_states").shape, device=DEVICE)
    saved, ws_f, ws_b = fwd.allocate_saved(), fwd.allocate_workspace(), bwd.allocate_workspace()
    grads = bwd.allocate_outputs()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fwd.execute(*core.values(), y, fin, saved, **opts, workspace=ws_f)
        with torch.cuda.graph(graph, stream=stream):
            fwd.execute(*core.values(), y, fin, saved, **opts, workspace=ws_f)
            bwd.execute(*core.values(), t["dy"], saved, **grads, **bo, workspace=ws_b)
    fresh = _varlen_case(22)
    for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "dy", "dfinal_states"):
        t[k].copy_(fresh.tensors[k])
    for buf in (y, fin, ws_f, ws_b, *grads.values()):
        buf.fill_(255 if buf.dtype == torch.uint8 else float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = run(fresh, "triton")
    for name, value in dict(y=y, final_states=fin, **grads).items():
        assert torch.equal(value, expected[name]), name
