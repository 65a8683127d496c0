"""Routed ReLU2 MoE: the plans' contract. Construction and validation errors naming the argument, options,
views and strides, the status word, host checks, eager wrappers and torch ops, CUDA Graph capture.
"""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops import MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward, TensorDesc
from fusedops.core.status import Status
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.relu2_moe.samples import router_logits

from helpers import DEVICE, requires_cuda

from .support import (BACKENDS, EXPERT_NAMES, KERNELS, _bad_ids_case, _status, experts_case,
                      run_experts)


@pytest.mark.parametrize("change,match", [
    (dict(w_down=torch.zeros(4, 24, 16)), r"w_down: expected shape \[E, H, I\] = \[4, 16, 24\], got \[4, 24, 16\]"),
    (dict(topk_ids=torch.zeros(8, 2)), r"topk_ids: expected dtype int32, got float32"),
    (dict(topk_weights=torch.zeros(8, 3)), r"topk_weights: expected shape \[t, k\] like topk_ids = \[8, 2\]"),
    (dict(topk_weights=torch.zeros(8, 2, dtype=torch.float16)), r"topk_weights: expected dtype float32"),
    (dict(w_up=torch.zeros(4, 24, 16, dtype=torch.float16)), r"w_up: expected dtype float32, got float16"),
    (dict(shared_w_up=torch.zeros(8, 16)), r"shared_w_up, shared_w_down: expected both"),
    (dict(shared_w_up=torch.zeros(8, 16), shared_w_down=torch.zeros(16, 9)),
     r"shared_w_down: expected shape \[H, I_shared\] = \[16, 8\], got \[16, 9\]"),
    (dict(x=torch.zeros(0, 16), topk_ids=torch.zeros(0, 2, dtype=torch.int32),
          topk_weights=torch.zeros(0, 2)), r"x: expected t, H >= 1"),
])
def test_experts_validation(change, match):
    case = experts_case(8, 16, 4, 24, 2)
    args = {n: case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")}
    args.update({k: v.to(DEVICE) for k, v in change.items()})
    with pytest.raises(ValidationError, match=match):
        ReLU2MoEForward(**args)


def test_backward_validation_and_float64_needs_torch():
    case = experts_case(8, 16, 4, 24, 2)
    args = [case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights", "d_out")]
    with pytest.raises(ValidationError, match=r"weight_grad_dtype: expected float32, got torch.float16"):
        ReLU2MoEBackward(*args, weight_grad_dtype=torch.float16)
    with pytest.raises(ValidationError, match=r"weight_grad_dtype: expected bfloat16 or .*, got torch.int32"):
        ReLU2MoEBackward(*args, weight_grad_dtype=torch.int32)
    f16 = experts_case(8, 16, 4, 24, 2, dtype=torch.float16)
    f16_args = [f16[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights", "d_out")]
    with pytest.raises(ValidationError, match=r"weight_grad_dtype: expected float32 or float16, got torch.bfloat16"):
        ReLU2MoEBackward(*f16_args, weight_grad_dtype=torch.bfloat16, backend="torch")
    with pytest.raises(ValidationError, match=r"accumulate: expected a bool"):
        ReLU2MoEBackward(*args, accumulate=1)
    if KERNELS:
        f64 = experts_case(8, 16, 4, 24, 2, dtype=torch.float64)
        with pytest.raises(UnsupportedError, match="float64"):
            ReLU2MoEForward(*(f64[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")),
                            backend=KERNELS[0])


@pytest.mark.parametrize("options,match", [
    (dict(top_k=9), r"top_k: expected at most E = 8 experts, got 9"),
    (dict(top_k=2, n_group=3), r"n_group: expected a divisor of E = 8"),
    (dict(top_k=2, n_group=8), r"giving groups of >= 2 experts"),
    (dict(top_k=2, n_group=4, topk_group=5), r"topk_group: expected at most n_group = 4, got 5"),
    (dict(top_k=5, n_group=4, topk_group=2), r"top_k: expected at most topk_group · E / n_group = 4"),
    (dict(top_k=2, routed_scaling_factor=float("inf")), r"routed_scaling_factor: expected a finite float"),
    (dict(top_k=2, correction_bias=torch.zeros(7)), r"correction_bias: expected shape \[E\] = \[8\]"),
    (dict(top_k=0), r"top_k: expected an int >= 1, got 0"),
])
def test_router_validation(options, match):
    options = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    with pytest.raises(ValidationError, match=match):
        MoERouter(torch.zeros(4, 8, device=DEVICE), **options)
    with pytest.raises(ValidationError, match=r"topk_ids: expected \[t, k\] with t = 4 like logits and 1 <= k <= E = 8"):
        MoERouterBackward(torch.zeros(4, 8, device=DEVICE), torch.zeros(4, 9, dtype=torch.int32, device=DEVICE),
                          torch.zeros(4, 9, device=DEVICE))
    with pytest.raises(ValidationError, match=r"d_topk_weights: expected shape \[t, k\] like topk_ids"):
        MoERouterBackward(torch.zeros(4, 8, device=DEVICE),
                          torch.zeros(4, 2, dtype=torch.int32, device=DEVICE),
                          torch.zeros(4, 3, device=DEVICE))


@requires_cuda
@pytest.mark.gpu
def test_gpu_graph_capture_with_changing_routing():
    case = experts_case(512, 256, 16, 128, 4, shared=128, dtype=torch.bfloat16, seed=32)
    logits = torch.randn(512, 16, device=DEVICE)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = dict(shared_w_up=case["shared_w_up"], shared_w_down=case["shared_w_down"])
    router = MoERouter(logits, top_k=4, routed_scaling_factor=2.5).compile()
    fwd = ReLU2MoEForward(*(case[n] for n in names), **shared).compile()
    bwd = ReLU2MoEBackward(*(case[n] for n in names), case["d_out"], **shared).compile()
    out, saved, ws_f, ws_b = (torch.empty_like(case["x"]), fwd.allocate_saved(),
                              fwd.allocate_workspace(), bwd.allocate_workspace())
    grads = {n: torch.empty(bwd.desc(n).shape, dtype=bwd.desc(n).dtype, device=DEVICE)
             for n in bwd.gradient_names}
    ids, weights = case["topk_ids"], case["topk_weights"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            router.execute(logits, weights, ids)
            fwd.execute(case["x"], case["w_up"], case["w_down"], ids, weights, out, saved, **shared,
                        workspace=ws_f)
            bwd.execute(case["x"], case["w_up"], case["w_down"], ids, weights, case["d_out"], saved,
                        **grads, **shared, workspace=ws_b)
    for skew in (0.0, 8.0):   # balanced, then almost every token to expert 3
        logits.copy_(torch.randn(512, 16, device=DEVICE))
        logits[:, 3] += skew
        graph.replay()
        torch.cuda.synchronize()
        w, i = fusedops.moe_router(logits, 4, routed_scaling_factor=2.5)
        assert torch.equal(i, ids) and torch.equal(w, weights)
        expected = run_experts("triton", dict(case, topk_ids=i, topk_weights=w))
        assert torch.equal(out, expected["out"])
        for name, value in grads.items():
            assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_inputs_names_the_argument_and_entry(backend, monkeypatch):
    case, _ = _bad_ids_case()
    args = {n: case[n] for n in EXPERT_NAMES}
    message = r"topk_ids: expected entries in \[0, 6\) or -1 \(padding\), got topk_ids\[3, 1\] = 6"
    with pytest.raises(ValidationError, match=message):
        fusedops.relu2_moe_forward(**args, backend=backend, check_inputs=True)
    out, saved = fusedops.relu2_moe_forward(**args, backend=backend, check_inputs=False)
    with pytest.raises(ValidationError, match=message):
        fusedops.relu2_moe_backward(**args, d_out=case["d_out"], saved=saved, backend=backend,
                                    check_inputs=True)
    logits = torch.zeros(10, 6, device=DEVICE)
    with pytest.raises(ValidationError, match=message):
        fusedops.moe_router_backward(logits, case["topk_ids"], torch.zeros(10, 3, device=DEVICE),
                                     backend=backend, check_inputs=True)
    with pytest.raises(ValidationError, match=message):
        fusedops.ops.relu2_moe(**args, backend=backend, check_inputs=True)
    monkeypatch.setenv("FUSEDOPS_CHECK_INPUTS", "1")
    with pytest.raises(ValidationError, match=message):
        fusedops.relu2_moe_forward(**args, backend=backend)
    plan = ReLU2MoEForward(*args.values(), backend=backend)
    with pytest.raises(ValidationError, match=message):
        plan.check_index_values(topk_ids=case["topk_ids"])
    padded, _ = _bad_ids_case(padding_only=True)
    plan.check_index_values(topk_ids=padded["topk_ids"])             # -1 is padding: accepted
    fusedops.relu2_moe_forward(**{n: padded[n] for n in EXPERT_NAMES}, backend=backend)


def test_status_word_is_checked_sticky_and_compiled_out_when_absent():
    case = experts_case(8, 16, 4, 24, 2)
    args = [case[n] for n in EXPERT_NAMES]
    for bad, match in ((torch.zeros(1, dtype=torch.int64), r"status: expected dtype int32"),
                       (torch.zeros(2, dtype=torch.int32), r"status: expected shape \[1\] = \[1\]")):
        with pytest.raises(ValidationError, match=match):
            ReLU2MoEForward(*args, status=bad.to(DEVICE))
        with pytest.raises(ValidationError, match=match):
            MoERouterBackward(torch.zeros(8, 4, device=DEVICE), case["topk_ids"],
                              case["topk_weights"], status=bad.to(DEVICE))
    plan = ReLU2MoEForward(*args, backend="torch").compile()
    out, saved = torch.empty_like(case["x"]), plan.allocate_saved()
    with pytest.raises(ValidationError, match=r"status: this plan was built without status"):
        plan.execute(*args, out, saved, status=_status())
    # sticky: the word keeps the bits of earlier executes (and bits fusedops never sets)
    status = _status().fill_(0x100)
    plan = ReLU2MoEForward(*args, status=TensorDesc((1,), torch.int32, device=DEVICE),
                           backend="torch").compile()
    bad = case["topk_ids"].clone()
    bad[2, 1] = 4
    plan.execute(*args[:3], bad, args[4], out, saved, status=status)
    plan.execute(*args, out, saved, status=status)
    assert int(status.item()) == 0x100 | Status.EXPERT_ID


@pytest.mark.parametrize("call", [
    lambda c: fusedops.moe_router(c["logits"], "2"),
    lambda c: fusedops.moe_router(c["logits"], 2, n_group=2.0),
    lambda c: fusedops.moe_router(c["logits"], 2, norm_topk_prob=1),
    lambda c: fusedops.moe_router(c["logits"], 2, routed_scaling_factor="2.5"),
    lambda c: fusedops.moe_router(c["logits"], 2, backend=5),
    lambda c: fusedops.moe_router(c["logits"], 2, current_stream="now"),
    lambda c: fusedops.moe_router_backward(c["logits"], c["topk_ids"], c["topk_weights"],
                                           norm_topk_prob=None),
    lambda c: fusedops.moe_router_backward(c["logits"], c["topk_ids"], c["topk_weights"],
                                           check_inputs="yes"),
    lambda c: fusedops.relu2_moe_forward(*(c[n] for n in EXPERT_NAMES), is_inference=1),
    lambda c: fusedops.relu2_moe_forward(*(c[n] for n in EXPERT_NAMES), check_inputs=1),
    lambda c: fusedops.relu2_moe_backward(*(c[n] for n in EXPERT_NAMES), c["d_out"], c["saved"],
                                          weight_grad_dtype="float32"),
    lambda c: fusedops.relu2_moe_backward(*(c[n] for n in EXPERT_NAMES), c["d_out"], c["saved"],
                                          backend=None),
    lambda c: fusedops.ops.moe_router(c["logits"], 2.0),
    lambda c: fusedops.ops.moe_router(c["logits"], True),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, n_group="1"),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, norm_topk_prob="yes"),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, routed_scaling_factor=object()),
    lambda c: fusedops.ops.moe_router(c["logits"], 2, backend=3),
    lambda c: fusedops.ops.relu2_moe(*(c[n] for n in EXPERT_NAMES), backend=["torch"]),
    lambda c: fusedops.ops.relu2_moe(*(c[n] for n in EXPERT_NAMES), check_inputs="no"),
], ids=lambda f: "")
def test_wrong_typed_options_raise_validation_error(call):
    case = experts_case(8, 16, 4, 24, 2)
    case["logits"] = torch.zeros(8, 4, device=DEVICE)
    case["saved"] = fusedops.relu2_moe_forward(*(case[n] for n in EXPERT_NAMES))[1]
    with pytest.raises(ValidationError, match=r"^(top_k|n_group|norm_topk_prob|routed_scaling_factor|"
                                              r"backend|current_stream|check_inputs|is_inference|"
                                              r"weight_grad_dtype): expected"):
        call(case)


# -- 6. strided activations ------------------------------------------------------------------------
STRIDED_DTYPES = {"torch": torch.float32, "triton": torch.bfloat16}


def _in_wider(tensor, extra, fill=0.0, offset=0):
    """(buffer, view): ``tensor`` [rows, width] in columns [offset, offset + width) of a wider
    buffer [rows, width + extra] filled with ``fill`` (a slice of a fused projection)."""
    rows, width = tensor.shape
    buffer = torch.full((rows, width + extra), fill, dtype=tensor.dtype, device=tensor.device)
    view = buffer[:, offset:offset + width]
    view.copy_(tensor)
    return buffer, view


def _padding_untouched(buffer, offset, width):
    """Every column of ``buffer`` outside [offset, offset + width) still NaN."""
    outside = torch.ones(buffer.shape[1], dtype=torch.bool, device=buffer.device)
    outside[offset:offset + width] = False
    return bool(torch.isnan(buffer[:, outside].float()).all())


def _router_and_experts(backend, case, logits, *, outputs=None):
    """Router, router backward, experts forward and backward through their plans with the
    given activations (x, d_out and logits: tensors or views) writing into ``outputs`` (out,
    d_x, d_logits: fresh contiguous tensors when None)."""
    names = ("w_up", "w_down", "topk_ids", "topk_weights")
    x, d_out = case["x"], case["d_out"]
    t, H = x.shape
    E, k = case["w_up"].shape[0], case["topk_ids"].shape[1]
    outputs = outputs or dict(out=torch.empty(t, H, dtype=x.dtype, device=DEVICE),
                              d_x=torch.empty(t, H, dtype=x.dtype, device=DEVICE),
                              d_logits=torch.empty(t, E, device=DEVICE))
    router = MoERouter(logits, top_k=k, routed_scaling_factor=2.5, backend=backend).compile()
    weights, ids = torch.empty(t, k, device=DEVICE), torch.empty(t, k, dtype=torch.int32, device=DEVICE)
    router.execute(logits, weights, ids)
    d_weights = torch.linspace(-1.0, 1.0, t * k, device=DEVICE).reshape(t, k)
    router_bwd = MoERouterBackward(logits, ids, d_weights, routed_scaling_factor=2.5,
                                   backend=backend).compile()
    router_bwd.execute(logits, ids, d_weights, outputs["d_logits"])
    shared = dict(shared_w_up=case["shared_w_up"], shared_w_down=case["shared_w_down"])
    params = [case[n] for n in names]
    fwd = ReLU2MoEForward(x, *params, **shared, backend=backend).compile()
    saved = fwd.allocate_saved()
    fwd.execute(x, *params, outputs["out"], saved, **shared, workspace=fwd.allocate_workspace())
    bwd = ReLU2MoEBackward(x, *params, d_out, **shared, backend=backend).compile()
    grads = {n: torch.full(bwd.desc(n).shape, float("nan"), dtype=bwd.desc(n).dtype, device=DEVICE)
             for n in bwd.gradient_names if n != "d_x"}
    bwd.execute(x, *params, d_out, saved, outputs["d_x"], grads["d_topk_weights"],
                grads["d_w_up"], grads["d_w_down"], **shared, d_shared_w_up=grads["d_shared_w_up"],
                d_shared_w_down=grads["d_shared_w_down"], workspace=bwd.allocate_workspace())
    return dict(topk_weights=weights, topk_ids=ids, saved=saved, **grads,
                **{n: v.clone() for n, v in outputs.items()})


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_go_in_and_out_without_copies(backend):
    """logits, x and d_out as views of wider buffers (router logits in the middle of a fused
    projection, x after other columns, d_out with rows 0 apart: one row broadcast to every
    token), and out, d_x and d_logits written straight into views of NaN-filled wider buffers:
    the same bits as the contiguous run, nothing written beside."""
    dtype = STRIDED_DTYPES[backend]
    case = experts_case(19, 32, 8, 48, 2, shared=40, dtype=dtype, seed=41)
    case["d_out"] = case["d_out"][3].expand(19, 32)          # row stride 0
    logits, _ = router_logits(19, 8, bias=False, seed=42, device=DEVICE)
    expected = _router_and_experts(backend, dict(case, d_out=case["d_out"].contiguous()), logits)
    _, x = _in_wider(case["x"], 40, offset=16)                 # columns [16, 48) of 72
    _, logits_view = _in_wider(logits, 28, offset=12)          # columns [12, 20) of 36
    buffers = dict(out=_in_wider(torch.empty_like(case["x"]), 8, float("nan"), offset=8),
                   d_x=_in_wider(torch.empty_like(case["x"]), 24, float("nan")),
                   d_logits=_in_wider(torch.empty_like(logits), 4, float("nan"), offset=4))
    result = _router_and_experts(backend, dict(case, x=x), logits_view,
                                 outputs={n: view for n, (_, view) in buffers.items()})
    for name, value in expected.items():
        if name == "saved" and backend != "torch":
            continue                # bytes nothing writes (row padding) differ run to run
        assert torch.equal(result[name], value), name
    for name, (buffer, view) in buffers.items():
        offset = view.storage_offset()
        assert _padding_untouched(buffer, offset, view.shape[1]), name


def test_strided_views_fill_the_same_saved_dispatch_and_u():
    """The kernels' saved buffer (dispatch and u) is the same whether x is a view or not (the
    bytes the forward writes; row padding aside)."""
    if not KERNELS:
        pytest.skip("needs a kernel backend")
    case = experts_case(19, 32, 8, 48, 2, dtype=torch.bfloat16, seed=43)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    _, x = _in_wider(case["x"], 8)
    plain = ReLU2MoEForward(*(case[n] for n in names), backend=KERNELS[0]).compile()
    layout = plain.kernel_program(KERNELS[0]).saved
    runs = []
    for xs in (case["x"], x):
        saved = torch.zeros(plain.saved_size, dtype=torch.uint8, device=DEVICE)
        plain.execute(xs, *(case[n] for n in names[1:]), torch.empty_like(case["x"]), saved,
                      workspace=plain.allocate_workspace())
        runs.append(saved)
    assert torch.equal(runs[0], runs[1]) and layout.size == plain.saved_size


def test_strides_must_keep_rows_aligned():
    """Rows of a view must start 16 bytes apart (and 16-byte aligned), the last dimension
    contiguous; a row that is not a whole number of 16-byte vectors (E = 6 fp32 logits: 24
    bytes) is taken contiguous only. The refusals name the tensor."""
    case = experts_case(8, 32, 4, 24, 2, dtype=torch.bfloat16)
    names = ("w_up", "w_down", "topk_ids", "topk_weights")
    params = [case[n] for n in names]
    misaligned = torch.zeros(8, 35, dtype=torch.bfloat16, device=DEVICE)[:, :32]  # rows 70 B apart
    with pytest.raises(ValidationError, match=r"x: expected strides of multiples of 16 bytes"):
        ReLU2MoEForward(misaligned, *params)
    with pytest.raises(ValidationError, match=r"x: expected the last dimension contiguous"):
        ReLU2MoEForward(torch.zeros(32, 8, dtype=torch.bfloat16, device=DEVICE).T, *params)
    with pytest.raises(ValidationError, match=r"x: expected .*16"):
        ReLU2MoEForward(torch.zeros(8, 48, dtype=torch.bfloat16, device=DEVICE)[:, 1:33], *params)
    with pytest.raises(ValidationError, match=r"d_out: expected strides of multiples of 16 bytes"):
        ReLU2MoEBackward(case["x"], *params, misaligned)
    plan = ReLU2MoEForward(case["x"], *params, backend="torch").compile()
    saved = plan.allocate_saved()
    with pytest.raises(ValidationError, match=r"out: expected the last dimension contiguous and "
                                              r"the other strides multiples of 16 bytes"):
        plan.execute(case["x"], *params, misaligned, saved)
    with pytest.raises(ValidationError, match=r"x: expected the last dimension contiguous and"):
        plan.execute(misaligned, *params, torch.empty_like(case["x"]), saved)
    logits = torch.zeros(8, 4, device=DEVICE)
    router_bwd = MoERouterBackward(logits, case["topk_ids"], case["topk_weights"],
                                   backend="torch").compile()
    with pytest.raises(ValidationError, match=r"d_logits: expected the last dimension contiguous"):
        router_bwd.execute(logits, case["topk_ids"], case["topk_weights"],
                           torch.zeros(8, 5, device=DEVICE)[:, :4])
    # E = 6 fp32: contiguous rows are 24 bytes apart, so logits are taken contiguous only
    odd = torch.zeros(8, 6, device=DEVICE)
    plan = MoERouter(odd, top_k=2, backend="torch").compile()
    plan.execute(odd, torch.empty(8, 2, device=DEVICE),
                 torch.empty(8, 2, dtype=torch.int32, device=DEVICE))
    wide = torch.zeros(8, 8, device=DEVICE)[:, :6]
    with pytest.raises(ValidationError, match=r"logits: expected a contiguous tensor \(a view needs "
                                              r"rows of a multiple of 16 bytes; 6 float32 "
                                              r"elements make 24\)"):
        MoERouter(wide, top_k=2)
    with pytest.raises(ValidationError, match=r"logits: expected a contiguous tensor, got strides"):
        plan.execute(wide, torch.empty(8, 2, device=DEVICE),
                     torch.empty(8, 2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValidationError, match=r"w_up: expected a contiguous tensor"):
        ReLU2MoEForward(case["x"], case["w_up"].transpose(1, 2).contiguous().transpose(1, 2),
                        *params[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_ops_take_views_without_copies(backend):
    """fusedops.ops.moe_router and relu2_moe take logits, x and d_out as views: forward and
    backward dispatch no aten::contiguous or aten::clone (the torch profiler's op list), with
    the same results and gradients as contiguous inputs; a layout the kernels cannot read (a
    transposed x) is copied, not refused."""
    dtype = STRIDED_DTYPES[backend]
    case = experts_case(12, 32, 8, 24, 2, shared=16, dtype=dtype, seed=44)
    logits, _ = router_logits(12, 8, bias=False, seed=45, device=DEVICE)
    params = {n: case[n].clone().requires_grad_() for n in ("w_up", "w_down")}
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}

    def run(x, logits, d_out):
        x = x.detach().requires_grad_()
        logits = logits.detach().requires_grad_()
        w, ids = fusedops.ops.moe_router(logits, 2, routed_scaling_factor=2.5, backend=backend)
        out = fusedops.ops.relu2_moe(x, params["w_up"], params["w_down"], ids, w, **shared,
                                     backend=backend)
        x_grad, logits_grad, w_up_grad = torch.autograd.grad(out, (x, logits, params["w_up"]), d_out)
        return out, x_grad, logits_grad, w_up_grad

    _, d_out = _in_wider(case["d_out"], 16, offset=8)
    expected = run(case["x"], logits, case["d_out"])
    x_view = _in_wider(case["x"], 24, offset=8)[1]             # columns [8, 40) of 56
    logits_view = _in_wider(logits, 8, offset=4)[1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = run(x_view, logits_view, d_out)
    copies = [e.key for e in prof.key_averages() if e.key in ("aten::contiguous", "aten::clone")]
    assert not copies, copies
    for got, want in zip(result, expected):
        assert torch.equal(got, want)
    assert result[0].is_contiguous() and result[1].shape == x_view.shape
    transposed = run(case["x"].T.contiguous().T, logits, case["d_out"])
    assert torch.equal(transposed[0], expected[0])
    # the fake implementations describe what the real ops return for views (contiguous outputs)
    router_args = (logits_view, None, 2, 1, 1, True, 2.5, backend)
    w, ids = torch.ops.fusedops.moe_router_fwd(*router_args)
    args = (x_view, case["w_up"], case["w_down"], ids, w, *shared.values(), backend)
    _, saved = torch.ops.fusedops.relu2_moe_fwd(*args)
    for op, op_args in ((torch.ops.fusedops.moe_router_fwd, router_args),
                        (torch.ops.fusedops.moe_router_bwd, (logits_view, ids, w, True, 2.5, backend)),
                        (torch.ops.fusedops.relu2_moe_fwd, args),
                        (torch.ops.fusedops.relu2_moe_bwd, (*args[:5], d_out, saved, *args[5:]))):
        torch.library.opcheck(op, op_args, test_utils=("test_schema", "test_faketensor"))
