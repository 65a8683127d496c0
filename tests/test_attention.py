"""GQA attention (docs/attention.md): the reference against SDPA and the float64 oracle, gradcheck,
every backend against the oracle, kernels against the reference (masks, varlen with empty and
one-token sequences, head dims), decode against the full causal forward, paged == contiguous, FP8
caches, option and shape validation, GPU. The plan contract (execute checks, no torch op in
execute, descs, repr, generic graph capture) is tested for every plan in test_plan_contract.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward
from fusedops.attention import AttentionProblem, DecodeAttentionProblem
from fusedops.attention.info import INFO, KERNEL_TOLERANCE
from fusedops.attention.samples import make, make_decode, make_packed, quantize, to_pages
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.opinfo import Tolerance
from fusedops.testing import assert_close

from helpers import BACKENDS as RUNNABLE, DEVICE, dtype_id, requires_cuda

BACKENDS = [b for b in RUNNABLE if b in GQAAttentionForward.backends]
KERNELS = [b for b in BACKENDS if b != "torch"]
CPU = torch.device("cpu")
F64 = KERNEL_TOLERANCE[torch.float64]


def qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, *, seed=0, device=DEVICE):
    """q, k, v, do of the family's dense sample."""
    t = make(b, sq, sk, hq, hkv, d, dtype, seed=seed, device=device).tensors
    return [t[n] for n in ("q", "k", "v", "do")]


def packed(lengths_q, lengths_k, hq, hkv, d, dtype=torch.float32, *, seed=0, device=DEVICE):
    """(q, k, v, do), packing options of the family's packed sample."""
    case = make_packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed=seed, device=device)
    t = case.tensors
    return [t[n] for n in ("q", "k", "v", "do")], dict(
        cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"], **case.options)


def run(backend, q, k, v, do, **opts):
    """Forward and backward through the eager wrappers."""
    f = fusedops.gqa_attention_forward(q, k, v, backend=backend, **opts)
    g = fusedops.gqa_attention_backward(q, k, v, f["o"], f["lse"], do, backend=backend, **opts)
    return dict(o=f["o"], lse=f["lse"], dq=g["dq"], dk=g["dk"], dv=g["dv"])


def compare(result, expected, tolerance, lse_tolerance=None):
    """Every expected result within ``tolerance``; lse: the same -inf rows, the finite ones within
    ``lse_tolerance`` (fp32's kernel tolerance unless float64)."""
    for name, value in expected.items():
        if name == "lse":
            finite = torch.isfinite(value)
            assert torch.equal(finite.cpu(), torch.isfinite(result[name]).cpu()), "lse: -inf rows differ"
            if finite.any():
                tol = lse_tolerance or (F64 if tolerance is F64 else KERNEL_TOLERANCE[torch.float32])
                assert_close(result[name][finite], value[finite].to(result[name].device), tol, "lse")
        else:
            assert_close(result[name], value.to(result[name].device), tolerance, name)


def check_against_oracle(case, results):
    expected = INFO.oracle(case)
    compare(results, {n: expected[n] for n in results}, INFO.tolerance("o", case.dtype),
            INFO.tolerance("lse", case.dtype))
    for name in ("k_cache", "v_cache"):
        if name in results:
            assert_close(results[name], expected[name].to(results[name].device),
                         INFO.tolerance(name, case.dtype), name)


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


# -- 1. the reference and the oracle ---------------------------------------------------------------
@pytest.mark.parametrize("sq,sk,causal,window", [(9, 9, False, (-1, -1)), (9, 9, True, (-1, -1)),
                                                 (7, 12, True, (-1, -1)), (12, 12, False, (3, 2))])
def test_reference_and_oracle_match_sdpa(sq, sk, causal, window):
    case = make(2, sq, sk, 8, 2, 16, torch.float64, device=CPU, causal=causal, window_size=window)
    q, k, v, do = (case.tensors[n] for n in ("q", "k", "v", "do"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves),
                                       attn_mask=sdpa_mask(sq, sk, causal, window), enable_gqa=True).transpose(1, 2)
    grads = torch.autograd.grad(o, leaves, do)
    sdpa = dict(o=o, dq=grads[0], dk=grads[1], dv=grads[2])
    r = run("torch", q, k, v, do, causal=causal, window_size=window)
    compare({k_: r[k_] for k_ in sdpa}, sdpa, F64)
    expected = INFO.oracle(case)
    compare({k_: expected[k_] for k_ in sdpa}, sdpa, F64)
    compare(dict(lse=r["lse"]), dict(lse=expected["lse"]), F64)


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
    case = make(1, 10, 4, 4, 2, 16, seed=3, device=DEVICE, causal=True)
    expected = INFO.oracle(case)
    for backend in BACKENDS:
        r = INFO.run(case, backend)
        assert torch.all(r["o"][:, :6] == 0) and torch.all(r["lse"][:, :, :6] == float("-inf"))
        assert torch.all(torch.isfinite(r["lse"][:, :, 6:]))
        for name in ("dq", "dk", "dv"):
            assert torch.isfinite(r[name]).all(), (backend, name)
        assert torch.all(r["dq"][:, :6] == 0)
        compare(r, expected, KERNEL_TOLERANCE[torch.float32])


# -- 2. every backend against the oracle -------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["small", "edge", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_backend_matches_oracle(backend, kind, dtype):
    for case in INFO.cases(kind, dtype=dtype, device=DEVICE, backend=backend):
        check_against_oracle(case, INFO.run(case, backend))


def test_reference_float64_matches_oracle():
    for kind in ("small", "decode"):
        for case in INFO.cases(kind, dtype=torch.float64, device=CPU):
            check_against_oracle(case, INFO.run(case, "torch"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_demo_case_within_the_demo_limit(backend):
    if DEVICE.type != "cpu":
        pytest.skip("the demonstration's GPU shape is the demo's to run")
    case = INFO.cases("demo", dtype=torch.bfloat16, device=DEVICE, backend=backend)[0]
    results, expected = INFO.run(case, backend), INFO.oracle(case)
    for name in ("o", "dq", "dk", "dv"):
        a, e = results[name].double().cpu(), expected[name].cpu()
        assert ((a - e).norm() / e.norm()).item() <= INFO.demo_limit, name


# -- 3. kernels against the reference ------------------------------------------------------------
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
        tol = KERNEL_TOLERANCE[torch.float32]
        assert_close(result["o"][a:b_], alone["o"][0], tol, f"o of sequence {s}")
        assert_close(result["dq"][a:b_], alone["dq"][0], tol, f"dq of sequence {s}")
        assert_close(result["dk"][ck[s]:ck[s + 1]], alone["dk"][0], tol, f"dk of sequence {s}")
    expected = INFO.oracle(make_packed([3, 0, 17, 1, 1], [5, 1, 24, 0, 1], 4, 2, 16, seed=6,
                                       device=DEVICE, causal=True))
    compare(result, expected, KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bitwise_reproducible(backend):
    q, k, v, do = qkv(2, 40, 40, 8, 2, 32, seed=7)
    first, second = run(backend, q, k, v, do, causal=True), run(backend, q, k, v, do, causal=True)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_kernel_specialisation_ignores_batch_and_compiles_out_absent_operands():
    """Compile-cache keys hold plan-time values: another batch reuses the kernels. Without
    packing, paging or an FP8 cache the optional pointers are constexpr None."""
    pytest.importorskip("triton")
    from fusedops.backends.triton import attention as kernels
    a = AttentionProblem(torch.bfloat16, 2, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, False, 1024, 1024, CPU)
    b = AttentionProblem(torch.bfloat16, 7, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, False, 3584, 3584, CPU)
    assert kernels.forward_spec(a) == kernels.forward_spec(b)
    assert kernels.backward_specs(a) == kernels.backward_specs(b)
    spec = kernels.forward_spec(a)
    assert spec.constexpr("cu_seqlens_q_ptr") is None and spec.constexpr("cu_seqlens_k_ptr") is None
    d = DecodeAttentionProblem(torch.bfloat16, torch.bfloat16, 2, 1, 8, 2, 64, False, 64, 1, 64,
                               0.125, False, 1, CPU)
    for spec in kernels.decode_specs(d).values():
        absent = [n for n in ("block_table_ptr", "k_scale_ptr", "v_scale_ptr") if n in dict(spec.signature)]
        assert all(spec.constexpr(n) is None for n in absent), spec.name


# -- 4. decode ----------------------------------------------------------------------------------
def decode_inputs(b, T, hq, hkv, d, capacity, lengths, dtype=torch.float32, seed=8):
    """q, k_new, v_new, k_cache, v_cache, cache_seqlens (execute()'s order) of a decode sample."""
    t = make_decode(b, T, hq, hkv, d, capacity, lengths, dtype, seed=seed, device=DEVICE).tensors
    return {n: t[n] for n in ("q", "k_new", "v_new", "k_cache", "v_cache", "cache_seqlens")}


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
    fp8 = dict(t, k_cache=quantize(t["k_cache"], k_scale), v_cache=quantize(t["v_cache"], v_scale))
    r = fusedops.gqa_attention_decode(**fp8, k_scale=k_scale, v_scale=v_scale, backend=backend)
    assert_close(r["o"], exact["o"], Tolerance(6e-2, 2.5e-1, "e4m3 cache (3 mantissa bits)"), "o")
    if backend != "torch":
        ref = fusedops.gqa_attention_decode(**dict(t, k_cache=quantize(t["k_cache"], k_scale),
                                                   v_cache=quantize(t["v_cache"], v_scale)),
                                            k_scale=k_scale, v_scale=v_scale, backend="torch")
        assert_close(r["o"], ref["o"], KERNEL_TOLERANCE[torch.float32], "o against the torch backend")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_continuing_a_training_case(backend):
    """The decode plan of INFO.plan_calls: the last query of a causal forward, as a decode step."""
    case = INFO.cases("small", device=DEVICE, backend=backend)[1]
    forward, _, decode = INFO.plan_calls(case, backend)
    t = decode.tensors
    r = fusedops.gqa_attention_decode(**t, backend=backend)
    full = fusedops.gqa_attention_forward(case.tensors["q"], case.tensors["k"], case.tensors["v"],
                                          causal=True, backend="torch")
    assert_close(r["o"], full["o"][:, -1:], KERNEL_TOLERANCE[torch.float32], "o")
    assert_close(r["lse"], full["lse"][:, :, -1:], KERNEL_TOLERANCE[torch.float32], "lse")


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
    with pytest.raises(ValidationError, match=r"max_seqlen_q: expected an int in \[0, 7\]"):
        GQAAttentionForward(q, k, v, **dict(opts, max_seqlen_q=None))
    with pytest.raises(ValidationError, match=r"max_seqlen_k: expected an int in \[0, 7\]"):
        GQAAttentionForward(q, k, v, **dict(opts, max_seqlen_k=8))
    with pytest.raises(ValidationError, match=r"cu_seqlens_q, cu_seqlens_k: expected both"):
        GQAAttentionForward(q, k, v, cu_seqlens_q=opts["cu_seqlens_q"], max_seqlen_q=4, max_seqlen_k=4)


def test_triton_refuses_float64():
    if "triton" not in BACKENDS:
        pytest.skip("triton does not run here")
    q, k, v, _ = qkv(1, 4, 4, 2, 1, 16, torch.float64)
    with pytest.raises(UnsupportedError, match=r"triton: the Triton attention kernels take bf16/fp16/fp32"):
        GQAAttentionForward(q, k, v, backend="triton")


# -- 6. GPU --------------------------------------------------------------------------------------
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
