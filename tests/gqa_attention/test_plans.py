"""GQA attention: the plans' contract. Construction and validation errors naming the argument, options,
views and strides, the status word, host checks, eager wrappers and torch ops, CUDA Graph capture.
"""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops import GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward
from fusedops.core.status import Status, read_status
from fusedops.errors import ValidationError

from helpers import DEVICE, requires_cuda

from .support import BACKENDS, _decode_case, decode_inputs, packed, qkv, run


# -- 5. validation -------------------------------------------------------------------------------
def test_decode_validation():
    t = decode_inputs(2, 1, 8, 2, 32, 64, [3, 4])
    with pytest.raises(ValidationError, match=r"k_scale: expected an fp32 tensor \[1\] or \[h_kv\] with an FP8 cache"):
        GQAAttentionDecode(**dict(t, k_cache=t["k_cache"].to(torch.float8_e4m3fn),
                                  v_cache=t["v_cache"].to(torch.float8_e4m3fn)))
    with pytest.raises(ValidationError, match=r"k_cache: expected a page size that is a multiple of 16, got 10"):
        GQAAttentionDecode(**dict(t, k_cache=torch.zeros(8, 10, 2, 32, device=DEVICE),
                                  v_cache=torch.zeros(8, 10, 2, 32, device=DEVICE)),
                           block_table=torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValidationError, match=r"cache_seqlens: expected dtype int32, got int64"):
        GQAAttentionDecode(**dict(t, cache_seqlens=t["cache_seqlens"].long()))
    with pytest.raises(ValidationError, match=r"k_scale, v_scale: only for a float8_e4m3fn cache"):
        GQAAttentionDecode(**t, k_scale=torch.ones(1, device=DEVICE), v_scale=torch.ones(1, device=DEVICE))
    for bad in (0, 2.0, True, "4"):
        with pytest.raises(ValidationError, match=r"num_splits: expected an int >= 1"):
            GQAAttentionDecode(**t, num_splits=bad)
    assert GQAAttentionDecode(**t).problem.num_splits == 1
    assert GQAAttentionDecode(**t, num_splits=3).problem.num_splits == 3


@pytest.mark.parametrize("change,match", [
    (dict(k=torch.zeros(2, 9, 3, 16)), r"k: expected h_kv >= 1 dividing h_q = 4, got h_kv = 3"),
    (dict(v=torch.zeros(2, 9, 2, 8)), r"v: expected shape like k = \[2, 9, 2, 16\]"),
    (dict(q=torch.zeros(2, 9, 4, 16, dtype=torch.float16)), r"k: expected dtype float16, got float32"),
    (dict(window_size=(-2, 0)), r"window_size: expected values >= -1"),
    (dict(window_size=(2.0, 0)), r"window_size: expected a pair \(left, right\) of ints"),
    (dict(window_size=(True, -1)), r"window_size: expected a pair \(left, right\) of ints"),
    (dict(window_size=(1, 2, 3)), r"window_size: expected a pair \(left, right\) of ints"),
    (dict(softmax_scale=float("nan")), r"softmax_scale: expected a finite float > 0"),
    (dict(softmax_scale=True), r"softmax_scale: expected a finite float > 0, got True"),
    (dict(softmax_scale=0.0), r"softmax_scale: expected a finite float > 0"),
    (dict(softmax_scale="0.1"), r"softmax_scale: expected a finite float > 0"),
    (dict(causal=1), r"causal: expected a bool, got 1"),
    (dict(max_seqlen_q=4.0), r"max_seqlen_q: expected an int >= 0, got 4.0"),
    (dict(max_seqlen_k=True), r"max_seqlen_k: expected an int >= 0, got True"),
])
def test_training_validation(change, match):
    q, k, v, _ = qkv(2, 9, 9, 4, 2, 16)
    args = dict(q=q, k=k, v=v)
    args.update({k_: (v_.to(DEVICE) if isinstance(v_, torch.Tensor) else v_) for k_, v_ in change.items()})
    with pytest.raises(ValidationError, match=match):
        GQAAttentionForward(**args)


def test_options_are_normalised():
    q, k, v, _ = qkv(1, 4, 4, 2, 1, 16)
    plan = GQAAttentionForward(q, k, v, window_size=[3, 2], softmax_scale=1)
    assert plan.window_size == (3, 2) and plan.problem.window == (3, 2)
    assert plan.problem.scale == 1.0 and isinstance(plan.softmax_scale, float)
    assert GQAAttentionForward(q, k, v).problem.scale == 0.25


def test_torch_op_refuses_what_the_plan_refuses():
    import fusedops.ops  # noqa: F401  (registers the op)
    q, k, v, _ = qkv(1, 4, 4, 2, 1, 16)
    with pytest.raises(ValidationError, match=r"softmax_scale: expected a finite float > 0, got True"):
        fusedops.ops.gqa_attention(q, k, v, softmax_scale=True)
    with pytest.raises(ValidationError, match=r"window_size: expected a pair \(left, right\) of ints"):
        fusedops.ops.gqa_attention(q, k, v, window_size=(1.5, -1))


def test_packed_requires_static_maxima():
    (q, k, v, _), opts = packed([3, 4], [3, 4], 4, 2, 16)
    with pytest.raises(ValidationError, match=r"max_seqlen_q: expected an int >= 0 \(the longest "
                                              r"sequence\) with packed sequences, got None"):
        GQAAttentionForward(q, k, v, **dict(opts, max_seqlen_q=None))
    with pytest.raises(ValidationError, match=r"max_seqlen_k: expected an int >= 0, got -1"):
        GQAAttentionForward(q, k, v, **dict(opts, max_seqlen_k=-1))
    loose = GQAAttentionForward(q, k, v, **dict(opts, max_seqlen_k=100))
    assert loose.max_seqlen_k == 100 and loose.problem.seqlen_k == 7   # no sequence covers more
    with pytest.raises(ValidationError, match=r"cu_seqlens_q, cu_seqlens_k: expected both"):
        GQAAttentionForward(q, k, v, cu_seqlens_q=opts["cu_seqlens_q"], max_seqlen_q=4, max_seqlen_k=4)


@requires_cuda
@pytest.mark.gpu
def test_gpu_graph_capture_of_training_and_decode_steps():
    """Captured once, the training step replays on new inputs and the decode step replays as
    the cache grows (cache_seqlens advanced inside the graph)."""
    q, k, v, do = qkv(2, 1000, 1000, 32, 8, 128, torch.bfloat16, seed=21)
    fwd = GQAAttentionForward(q, k, v, causal=True).compile()
    o, lse = torch.empty_like(q), torch.empty(2, 32, 1000, device=DEVICE)
    bwd = GQAAttentionBackward(q, k, v, o, lse, do, causal=True).compile()
    dq, dk, dv, ws = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), bwd.allocate_workspace()
    t = decode_inputs(4, 1, 32, 8, 128, 4096, [100, 2000, 4000, 0], torch.bfloat16)
    dec = GQAAttentionDecode(**t).compile()
    o_d, lse_d, ws_d = torch.empty_like(t["q"]), torch.empty(4, 32, 1, device=DEVICE), dec.allocate_workspace()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            fwd.execute(q, k, v, o, lse)
            bwd.execute(q, k, v, o, lse, do, dq, dk, dv, workspace=ws)
            dec.execute(*t.values(), o_d, lse_d, workspace=ws_d)
            t["cache_seqlens"].add_(1)
    fresh = qkv(2, 1000, 1000, 32, 8, 128, torch.bfloat16, seed=22)
    for dst, src in zip((q, k, v, do), fresh):
        dst.copy_(src)
    for buf in (o, dq, dk, dv, o_d):
        buf.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = run("triton", *fresh, causal=True)
    for name, value in dict(o=o, dq=dq, dk=dk, dv=dv).items():
        assert torch.equal(value, expected[name]), name
    assert t["cache_seqlens"].tolist() == [101, 2001, 4001, 1] and torch.isfinite(o_d).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_status_word_is_sticky_and_absent_status_still_clamps(backend):
    (q, k, v, _), opts = packed([3, 5], [4, 6], 4, 2, 16, seed=32)
    status = torch.full((1,), int(Status.SLOT_INDEX), dtype=torch.int32, device=DEVICE)
    fusedops.gqa_attention_forward(q, k, v, status=status, backend=backend, **opts)
    assert read_status(status) == Status.SLOT_INDEX            # valid offsets: nothing added
    bad = dict(opts, cu_seqlens_q=torch.tensor([0, 3, 50], dtype=torch.int32, device=DEVICE))
    with_status = fusedops.gqa_attention_forward(q, k, v, status=status, backend=backend, **bad)
    assert read_status(status) == Status.SLOT_INDEX | Status.CU_SEQLENS
    without = fusedops.gqa_attention_forward(q, k, v, backend=backend, **bad)
    assert torch.equal(with_status["o"], without["o"]) and torch.equal(with_status["lse"], without["lse"])
    with pytest.raises(ValidationError, match=r"status: expected dtype int32, got int64"):
        GQAAttentionForward(q, k, v, **opts, status=torch.zeros(1, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValidationError, match=r"status: expected shape \[1\] = \[1\], got \[2\]"):
        GQAAttentionDecode(**decode_inputs(2, 1, 8, 2, 32, 64, [3, 4]),
                           status=torch.zeros(2, dtype=torch.int32, device=DEVICE))


def test_check_inputs_names_the_argument_and_the_entry(monkeypatch):
    g = torch.Generator().manual_seed(34)
    q, k, v = torch.randn(20, 4, 16, generator=g), torch.randn(20, 2, 16, generator=g), torch.randn(20, 2, 16, generator=g)

    def forward(cu_q, cu_k, max_q=20, max_k=20, **kw):
        return fusedops.gqa_attention_forward(
            q, k, v, cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_q=max_q,
            max_seqlen_k=max_k, backend="torch", **kw)
    for cu_q, cu_k, max_q, match in [
            ([0, 8, 30], [0, 8, 20], 20, r"cu_seqlens_q: expected offsets up to the 20 packed tokens, got cu_seqlens_q\[2\] = 30"),
            ([1, 8, 20], [0, 8, 20], 20, r"cu_seqlens_q: expected offsets starting at 0, got cu_seqlens_q\[0\] = 1"),
            ([0, 8, 20], [0, 9, 7], 20, r"cu_seqlens_k: expected non-decreasing offsets, got cu_seqlens_k\[2\] = 7 < cu_seqlens_k\[1\] = 9"),
            ([0, 15, 20], [0, 8, 20], 10, r"cu_seqlens_q: expected sequences of at most max_seqlen_q = 10 tokens, got cu_seqlens_q\[1\] - cu_seqlens_q\[0\] = 15")]:
        with pytest.raises(ValidationError, match=match):
            forward(cu_q, cu_k, max_q, check_inputs=True)
        forward(cu_q, cu_k, max_q)                                  # unchecked: clamped, no error
        monkeypatch.setenv("FUSEDOPS_CHECK_INPUTS", "1")
        with pytest.raises(ValidationError, match=match):
            forward(cu_q, cu_k, max_q)
        monkeypatch.delenv("FUSEDOPS_CHECK_INPUTS")
    o, lse = forward([0, 8, 20], [0, 8, 20], check_inputs=True)
    with pytest.raises(ValidationError, match=r"cu_seqlens_k: expected offsets up to the 20"):
        fusedops.gqa_attention_backward(q, k, v, o, lse, torch.ones_like(q), cu_seqlens_q=torch.tensor([0, 8, 20], dtype=torch.int32),
                                        cu_seqlens_k=torch.tensor([0, 8, 21], dtype=torch.int32), max_seqlen_q=20,
                                        max_seqlen_k=20, check_inputs=True, backend="torch")
    from fusedops.ops import gqa_attention as attention_op
    with pytest.raises(ValidationError, match=r"cu_seqlens_q: expected offsets starting at 0, got cu_seqlens_q\[0\] = 2"):
        attention_op(q, k, v, cu_seqlens_q=torch.tensor([2, 8, 20], dtype=torch.int32),
                                   cu_seqlens_k=torch.tensor([0, 8, 20], dtype=torch.int32), max_seqlen_q=20,
                                   max_seqlen_k=20, check_inputs=True, backend="torch")
    # decode: cache lengths first, then the pages the rows need; nothing is written when refused
    case, t = _decode_case(True, lengths=(5, 0, 94, 40))
    t = {n_: (v_.cpu() if isinstance(v_, torch.Tensor) else v_) for n_, v_ in t.items()}
    table = t["block_table"].clone()
    table[3, 2] = 10_000
    table[1, 4] = -1                            # not needed by row 1: not an error
    before = t["k_cache"].clone()
    with pytest.raises(ValidationError, match=rf"block_table: expected entries in \[0, {t['k_cache'].shape[0]}\), got block_table\[3, 2\] = 10000"):
        fusedops.gqa_attention_decode(**dict(t, block_table=table), check_inputs=True, backend="torch")
    with pytest.raises(ValidationError, match=r"cache_seqlens: expected cache_seqlens\[1\] in \[0, 94\] \(room for 2 new tokens in a capacity of 96: block_table's 6 pages of 16\), got -3"):
        fusedops.gqa_attention_decode(**dict(t, cache_seqlens=torch.tensor([5, -3, 94, 40], dtype=torch.int32)),
                                      check_inputs=True, backend="torch")
    assert torch.equal(before, t["k_cache"])
    plan = GQAAttentionDecode(**t, backend="torch")
    plan.check_index_values(cache_seqlens=t["cache_seqlens"], block_table=t["block_table"])
    with pytest.raises(ValidationError, match=r"block_table: expected entries in"):
        plan.check_index_values(cache_seqlens=t["cache_seqlens"], block_table=table)


WRONG_OPTIONS = [("check_inputs", "yes"), ("backend", 3), ("status", [0]),
                 ("current_stream", "the default")]


def test_wrong_typed_options_of_the_eager_wrappers_and_the_torch_op_name_the_option():
    from fusedops.ops import gqa_attention as attention_op
    (q, k, v, do), opts = packed([3, 5], [4, 6], 4, 2, 16, seed=35)
    o, lse = fusedops.gqa_attention_forward(q, k, v, backend="torch", **opts)
    dec = decode_inputs(2, 1, 8, 2, 32, 64, [3, 4])
    calls = {      # every option of each: a wrong type raises ValidationError naming it
        "gqa_attention_forward": (lambda **kw: fusedops.gqa_attention_forward(q, k, v, **{**opts, **kw}),
                                  [("causal", "yes"), ("softmax_scale", "0.1"), ("window_size", 1.5),
                                   ("max_seqlen_q", 2.0), ("max_seqlen_k", None)] + WRONG_OPTIONS),
        "gqa_attention_backward": (lambda **kw: fusedops.gqa_attention_backward(q, k, v, o, lse, do, **{**opts, **kw}),
                                   [("causal", 1), ("softmax_scale", True), ("window_size", (1, 2, 3)),
                                    ("max_seqlen_q", "4")] + WRONG_OPTIONS),
        "gqa_attention_decode": (lambda **kw: fusedops.gqa_attention_decode(**dec, **kw),
                                 [("softmax_scale", float("inf")), ("num_splits", 2.0)] + WRONG_OPTIONS),
        "ops.gqa_attention": (lambda **kw: attention_op(q, k, v, **{**opts, **kw}),
                              [("causal", "yes"), ("softmax_scale", "0.1"), ("window_size", 1.5),
                               ("max_seqlen_q", 2.0), ("check_inputs", "yes"), ("backend", 3)]),
    }
    for call, wrong in calls.values():
        for name, value in wrong:
            with pytest.raises(ValidationError, match=rf"^{name}: expected"):
                call(**{name: value})
