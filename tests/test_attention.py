"""GQA attention (specs/attention.md): reference against SDPA and float64, gradcheck, kernels
against the reference (masks, varlen with empty and one-token sequences, head dims), decode
against the full causal forward, paged == contiguous, FP8 caches, the plan contract, GPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fusedops
from fusedops import GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward
from fusedops.errors import ValidationError

from helpers import (DEVICE, Tolerance, assert_close, gpu_backends, requires_cuda,
                     runnable_backends)

BACKENDS = [b for b in runnable_backends() if b != "cute"]
KERNELS = [b for b in BACKENDS if b != "torch"]
CPU = torch.device("cpu")
F64 = Tolerance(1e-12, 1e-11, "float64 against float64")
KERNEL_TOLERANCE = {
    torch.float32: Tolerance(2e-6, 2e-5, "fp32 products, online softmax in another order"),
    torch.float16: Tolerance(2e-3, 1e-2, "fp16 operands of the products (P rounded to fp16)"),
    torch.bfloat16: Tolerance(1.5e-2, 6e-2, "bf16 operands of the products (P rounded to bf16)"),
}


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, *, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))
    return [torch.randn(*s, generator=gen).to(device, dtype) for s in shapes]


def packed(lengths_q, lengths_k, hq, hkv, d, dtype=torch.float32, *, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    tensors = [torch.randn(*s, generator=gen).to(device, dtype)
               for s in ((tq, hq, d), (tk, hkv, d), (tk, hkv, d), (tq, hq, d))]
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=device)  # noqa: E731
    opts = dict(cu_seqlens_q=cu(lengths_q), cu_seqlens_k=cu(lengths_k), max_seqlen_q=max(lengths_q),
                max_seqlen_k=max(lengths_k))
    return tensors, opts


def run(backend, q, k, v, do, **opts):
    f = fusedops.gqa_attention_forward(q, k, v, backend=backend, **opts)
    g = fusedops.gqa_attention_backward(q, k, v, f["o"], f["lse"], do, backend=backend, **opts)
    return dict(o=f["o"], lse=f["lse"], dq=g["dq"], dk=g["dk"], dv=g["dv"])


def compare(result, expected, tolerance):
    for name, value in expected.items():
        if name == "lse":
            finite = torch.isfinite(value)
            assert torch.equal(finite, torch.isfinite(result[name])), "lse: -inf rows differ"
            if finite.any():
                assert_close(result[name][finite], value[finite], KERNEL_TOLERANCE[torch.float32]
                             if tolerance is not F64 else F64, "lse")
        else:
            assert_close(result[name], value, tolerance, name)


def sdpa_mask(sq, sk, causal, window):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= j <= i + sk - sq
    if window[0] >= 0:
        ok &= j >= i + sk - sq - window[0]
    if window[1] >= 0:
        ok &= j <= i + sk - sq + window[1]
    return ok


# -- 1. the reference ----------------------------------------------------------------------------
@pytest.mark.parametrize("sq,sk,causal,window", [(9, 9, False, (-1, -1)), (9, 9, True, (-1, -1)),
                                                 (7, 12, True, (-1, -1)), (12, 12, False, (3, 2))])
def test_reference_matches_sdpa(sq, sk, causal, window):
    q, k, v, do = qkv(2, sq, sk, 8, 2, 16, torch.float64, device=CPU)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves),
                                       attn_mask=sdpa_mask(sq, sk, causal, window), enable_gqa=True).transpose(1, 2)
    grads = torch.autograd.grad(o, leaves, do)
    r = run("torch", q, k, v, do, causal=causal, window_size=window)
    compare({k_: r[k_] for k_ in ("o", "dq", "dk", "dv")}, dict(o=o, dq=grads[0], dk=grads[1], dv=grads[2]), F64)


class _AttentionThroughPlans(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        f = fusedops.gqa_attention_forward(q, k, v, causal=True, backend="torch")
        ctx.save_for_backward(q, k, v, f["o"], f["lse"])
        return f["o"]

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        g = fusedops.gqa_attention_backward(q, k, v, o, lse, do.contiguous(), causal=True, backend="torch")
        return g["dq"], g["dk"], g["dv"]


def test_gradcheck_float64():
    q, k, v, _ = qkv(1, 4, 6, 4, 2, 3, torch.float64, device=CPU)
    assert torch.autograd.gradcheck(_AttentionThroughPlans.apply, [t.requires_grad_() for t in (q, k, v)],
                                    eps=1e-6, atol=1e-8, rtol=1e-6)


def test_fully_masked_rows_give_zero_and_minus_inf():
    """Causal with s_q > s_k: the first s_q - s_k queries see no key."""
    for backend in BACKENDS:
        q, k, v, do = qkv(1, 10, 4, 4, 2, 16, seed=3)
        r = run(backend, q, k, v, do, causal=True)
        assert torch.all(r["o"][:, :6] == 0) and torch.all(r["lse"][:, :, :6] == float("-inf"))
        assert torch.all(torch.isfinite(r["lse"][:, :, 6:]))
        for name in ("dq", "dk", "dv"):
            assert torch.isfinite(r[name]).all(), (backend, name)
        assert torch.all(r["dq"][:, :6] == 0)


# -- 2. kernels against the reference ------------------------------------------------------------
CASES = [
    dict(shape=(2, 37, 45, 4, 2, 24), causal=False),
    dict(shape=(2, 37, 45, 4, 2, 24), causal=True),
    dict(shape=(1, 50, 30, 4, 1, 32), causal=True),
    dict(shape=(1, 40, 40, 2, 2, 16), window_size=(5, 3)),
    dict(shape=(1, 70, 70, 2, 1, 64), causal=True, window_size=(20, -1)),
    dict(shape=(1, 20, 20, 4, 2, 128), causal=True),
]


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['shape']}-{c.get('causal', False)}-{c.get('window_size', '')}")
def test_kernels_match_reference(backend, case):
    q, k, v, do = qkv(*case["shape"], seed=4)
    opts = {k_: v_ for k_, v_ in case.items() if k_ != "shape"}
    compare(run(backend, q, k, v, do, **opts), run("torch", q, k, v, do, **opts),
            KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernels_low_precision(backend, dtype):
    q, k, v, do = qkv(2, 33, 33, 4, 2, 64, dtype, seed=5)
    compare(run(backend, q, k, v, do, causal=True), run("torch", q, k, v, do, causal=True), KERNEL_TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_with_empty_and_single_tokens(backend):
    (q, k, v, do), opts = packed([3, 0, 17, 1, 1], [5, 1, 24, 0, 1], 4, 2, 16, seed=6)
    result = run(backend, q, k, v, do, causal=True, **opts)
    cq, ck = opts["cu_seqlens_q"].tolist(), opts["cu_seqlens_k"].tolist()
    for s in range(5):
        a, b_ = cq[s], cq[s + 1]
        if a == b_:
            continue
        if ck[s] == ck[s + 1]:                       # a sequence without keys
            assert torch.all(result["o"][a:b_] == 0) and torch.all(result["lse"][:, a:b_] == float("-inf"))
            continue
        alone = run("torch", q[a:b_][None], k[ck[s]:ck[s + 1]][None], v[ck[s]:ck[s + 1]][None],
                    do[a:b_][None], causal=True)
        tol = F64 if False else KERNEL_TOLERANCE[torch.float32]
        assert_close(result["o"][a:b_], alone["o"][0], tol, f"o of sequence {s}")
        assert_close(result["dq"][a:b_], alone["dq"][0], tol, f"dq of sequence {s}")
        assert_close(result["dk"][ck[s]:ck[s + 1]], alone["dk"][0], tol, f"dk of sequence {s}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bitwise_reproducible(backend):
    q, k, v, do = qkv(2, 40, 40, 8, 2, 32, seed=7)
    first, second = run(backend, q, k, v, do, causal=True), run(backend, q, k, v, do, causal=True)
    for name in first:
        assert torch.equal(first[name], second[name]), name


# -- 3. decode ----------------------------------------------------------------------------------
def decode_inputs(b, T, hq, hkv, d, capacity, lengths, dtype=torch.float32, seed=8):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(DEVICE, dtype)  # noqa: E731
    return dict(q=rnd(b, T, hq, d), k_new=rnd(b, T, hkv, d), v_new=rnd(b, T, hkv, d),
                k_cache=rnd(b, capacity, hkv, d), v_cache=rnd(b, capacity, hkv, d),
                cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


def to_pages(cache, page, table):
    b, capacity = cache.shape[:2]
    pages = torch.zeros(table.numel() + 3, page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    for i in range(b):
        for j in range(table.shape[1]):
            lo = j * page
            if lo < capacity:
                hi = min(capacity, lo + page)
                pages[table[i, j]][: hi - lo] = cache[i, lo:hi]
    return pages


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 3])
def test_decode_equals_the_last_rows_of_a_causal_forward(backend, T):
    b, hq, hkv, d, capacity = 3, 8, 2, 32, 100
    lengths = [0, 37, 100 - T]
    t = decode_inputs(b, T, hq, hkv, d, capacity, lengths)
    old = {k_: t[k_].clone() for k_ in ("k_cache", "v_cache")}
    r = fusedops.gqa_attention_decode(**t, num_splits=3, backend=backend)
    for i, L in enumerate(lengths):
        keys = torch.cat([old["k_cache"][i, :L], t["k_new"][i]])[None]
        values = torch.cat([old["v_cache"][i, :L], t["v_new"][i]])[None]
        queries = torch.cat([torch.zeros(L, hq, d, device=DEVICE), t["q"][i]])[None]
        full = fusedops.gqa_attention_forward(queries, keys, values, causal=True, backend="torch")
        assert_close(r["o"][i], full["o"][0, L:], KERNEL_TOLERANCE[torch.float32], f"o of row {i}")
        assert_close(r["lse"][i], full["lse"][0, :, L:], KERNEL_TOLERANCE[torch.float32], f"lse of row {i}")
        assert torch.equal(t["k_cache"][i, L:L + T], t["k_new"][i])
        assert torch.equal(t["k_cache"][i, :L], old["k_cache"][i, :L])
        assert torch.equal(t["k_cache"][i, L + T:], old["k_cache"][i, L + T:])
    assert t["cache_seqlens"].tolist() == lengths


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_paged_equals_contiguous(backend):
    b, T, hq, hkv, d, capacity, page = 3, 2, 8, 2, 32, 96, 16
    t = decode_inputs(b, T, hq, hkv, d, capacity, [5, 40, 90], seed=9)
    table = torch.randperm(b * (capacity // page) + 3, generator=torch.Generator().manual_seed(1))[
        : b * capacity // page].view(b, -1).int().to(DEVICE)
    paged = dict(t, k_cache=to_pages(t["k_cache"], page, table), v_cache=to_pages(t["v_cache"], page, table))
    contiguous = fusedops.gqa_attention_decode(**t, backend=backend)
    result = fusedops.gqa_attention_decode(**paged, block_table=table, backend=backend)
    assert_close(result["o"], contiguous["o"], KERNEL_TOLERANCE[torch.float32], "o")
    assert torch.equal(to_pages(t["k_cache"], page, table)[table.flatten().long()], paged["k_cache"][table.flatten().long()])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-kv-head"])
def test_decode_fp8_cache(backend, per_head):
    """e4m3 keeps 3 mantissa bits: values round by up to 1/16 relative, averaged over d and the
    keys; the output stays within 6e-2 (relative L2) of the fp32 cache's."""
    b, T, hq, hkv, d, capacity = 2, 2, 8, 2, 64, 80
    t = decode_inputs(b, T, hq, hkv, d, capacity, [10, 60], seed=10)
    exact = fusedops.gqa_attention_decode(**{k_: (v_.clone() if "cache" in k_ else v_) for k_, v_ in t.items()},
                                          backend="torch")
    scale_shape = (hkv,) if per_head else (1,)
    k_scale = torch.full(scale_shape, 0.02, device=DEVICE)
    v_scale = torch.full(scale_shape, 0.015, device=DEVICE)
    quant = lambda c, s: (c / s.view(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)  # noqa: E731
    fp8 = dict(t, k_cache=quant(t["k_cache"], k_scale), v_cache=quant(t["v_cache"], v_scale))
    r = fusedops.gqa_attention_decode(**fp8, k_scale=k_scale, v_scale=v_scale, backend=backend)
    assert_close(r["o"], exact["o"], Tolerance(6e-2, 2.5e-1, "e4m3 cache (3 mantissa bits)"), "o")
    if backend != "torch":
        ref = fusedops.gqa_attention_decode(**dict(t, k_cache=quant(t["k_cache"], k_scale),
                                                   v_cache=quant(t["v_cache"], v_scale)),
                                            k_scale=k_scale, v_scale=v_scale, backend="torch")
        assert_close(r["o"], ref["o"], KERNEL_TOLERANCE[torch.float32], "o against the torch backend")


def test_decode_validation_and_no_torch_op():
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
    plan = GQAAttentionDecode(**t).compile()
    o, lse = torch.empty_like(t["q"]), torch.empty(2, 8, 1, device=DEVICE)
    calls = []

    class NoTorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"execute() dispatched {func}")
    plan._launch = lambda tensors, stream: calls.append(1)
    ws = plan.allocate_workspace()
    with NoTorchOps():
        plan.execute(*t.values(), o, lse, workspace=ws)
    assert calls == [1]


@pytest.mark.parametrize("change,match", [
    (dict(k=torch.zeros(2, 9, 3, 16)), r"k: expected h_kv >= 1 dividing h_q = 4, got h_kv = 3"),
    (dict(v=torch.zeros(2, 9, 2, 8)), r"v: expected shape like k = \[2, 9, 2, 16\]"),
    (dict(q=torch.zeros(2, 9, 4, 16, dtype=torch.float16)), r"k: expected dtype float16, got float32"),
    (dict(window_size=(-2, 0)), r"window_size: expected values >= -1"),
    (dict(softmax_scale=float("nan")), r"softmax_scale: expected a finite float > 0"),
])
def test_training_validation(change, match):
    q, k, v, _ = qkv(2, 9, 9, 4, 2, 16)
    args = dict(q=q, k=k, v=v)
    args.update({k_: (v_.to(DEVICE) if isinstance(v_, torch.Tensor) else v_) for k_, v_ in change.items()})
    with pytest.raises(ValidationError, match=match):
        GQAAttentionForward(**args)


def test_packed_requires_static_maxima():
    (q, k, v, _), opts = packed([3, 4], [3, 4], 4, 2, 16)
    with pytest.raises(ValidationError, match=r"max_seqlen_q: expected an int in \[0, 7\]"):
        GQAAttentionForward(q, k, v, **dict(opts, max_seqlen_q=None))


# -- 4. GPU --------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_production_shapes_against_sdpa(hkv, causal):
    q, k, v, do = qkv(2, 2048, 2048, 32, hkv, 128, torch.bfloat16, seed=20)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal,
                                       enable_gqa=True).transpose(1, 2)
    grads = torch.autograd.grad(o, leaves, do)
    r = run("triton", q, k, v, do, causal=causal)
    tol = KERNEL_TOLERANCE[torch.bfloat16]
    compare({k_: r[k_] for k_ in ("o", "dq", "dk", "dv")}, dict(o=o, dq=grads[0], dk=grads[1], dv=grads[2]), tol)


@requires_cuda
@pytest.mark.gpu
def test_gpu_graph_capture_of_training_and_decode_steps():
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
