"""GQA attention (docs/gqa_attention.md): the reference against SDPA and the float64 oracle, gradcheck,
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
from fusedops.gqa_attention import AttentionProblem, DecodeAttentionProblem
from fusedops.gqa_attention.info import INFO, KERNEL_TOLERANCE
from fusedops.gqa_attention.samples import make, make_decode, make_packed, quantize, to_pages
from fusedops.core.status import Status, read_status
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.opinfo import Case, Tolerance
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
    q, k, v, _ = qkv(1, 4, 6, 4, 2, 4, torch.float64, device=CPU)
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
@pytest.mark.parametrize("kind", INFO.sample_kinds)
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


# sm_80's tables read every tile through pointers and masks, sm_90's and sm_100's through tensor
# descriptors of each sequence (TMA); sm_90's and sm_100's d = 256 dk/dv kernels hold dk and dv
# transposed (the head dim as M)
ARCHS = ("sm_80", "sm_90", "sm_100")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['shape']}-{c.get('causal', False)}-{c.get('window_size', '')}")
def test_kernels_match_reference(backend, case, arch):
    from fusedops.core.target import compiling_for
    q, k, v, do = qkv(*case["shape"], seed=4)
    opts = {k_: v_ for k_, v_ in case.items() if k_ != "shape"}
    with compiling_for(arch):
        got = run(backend, q, k, v, do, **opts)
    compare(got, run("torch", q, k, v, do, **opts), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", KERNELS)
def test_head_dim_256_on_every_table(backend, arch):
    """d = 256 through each architecture's tiles: on sm_90 and sm_100 the dk/dv kernel
    accumulates dkᵀ and dvᵀ (the head dim as every accumulating product's M), packed and dense."""
    from fusedops.backends.triton.gqa_attention import program as kernels
    from fusedops.core.target import compiling_for
    q, k, v, do = qkv(1, 70, 70, 2, 1, 256, seed=17)
    (pq, pk, pv, pdo), opts = packed([37, 1, 45], [40, 3, 45], 2, 1, 256, seed=18)
    with compiling_for(arch):
        lse = torch.zeros(1, 2, 70)
        problem = GQAAttentionBackward(q, k, v, q, lse, do, causal=True, backend=backend).problem
        assert kernels.backward_tiles(problem).features_m == (arch != "sm_80")
        dense = run(backend, q, k, v, do, causal=True)
        varlen = run(backend, pq, pk, pv, pdo, causal=True, **opts)
    compare(dense, run("torch", q, k, v, do, causal=True), KERNEL_TOLERANCE[torch.float32])
    compare(varlen, run("torch", pq, pk, pv, pdo, causal=True, **opts),
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


# key blocks of 32 against query blocks of 16: per key block, the diagonal's (or a window edge's)
# blocks masked, the blocks that see all 32 keys unmasked, the last partial query block masked
# (offsets of -2 and a right edge of 14 put the first unmasked block one row past a multiple of
# 16, where an off-by-one in the rounding would unmask a block that needs the mask)
EDGE_CASES = [
    dict(sq=150, sk=150, causal=True),
    dict(sq=150, sk=148, causal=True),
    dict(sq=150, sk=120, causal=True),                      # bottom-right: query i sees j <= i - 30
    dict(sq=110, sk=150, causal=True, window_size=(70, -1)),
    dict(sq=130, sk=130, causal=False, window_size=(60, 14)),
]


@pytest.mark.parametrize("backend", KERNELS)
def test_descriptor_scratch_needs_a_128_byte_aligned_workspace(backend, monkeypatch):
    """The TMA kernels keep their tensor descriptors in the workspace (``global_scratch``), which
    Triton aligns to 128 bytes: on a GPU (or the PTX emulator) a workspace 16 bytes off is
    refused, naming the alignment; without the emulator the CPU interpreter keeps descriptors in
    host memory: 16 bytes, as any buffer."""
    q, k, v, _ = qkv(1, 40, 40, 2, 1, 32, seed=3)
    plan = GQAAttentionForward(q, k, v, causal=True, backend=backend).compile()
    assert plan.workspace_size > 0
    assert plan._program.workspace_alignment(torch.device("cuda")) == 128
    monkeypatch.setenv("FUSEDOPS_EMULATE", "1")
    assert plan._program.workspace_alignment(torch.device("cpu")) == 128
    monkeypatch.delenv("FUSEDOPS_EMULATE")
    assert plan._program.workspace_alignment(torch.device("cpu")) == 16
    if q.device.type != "cuda":
        return
    raw = torch.empty(plan.workspace_size + 256, dtype=torch.uint8, device=q.device)
    aligned = raw[-raw.data_ptr() % 128:]
    outs = plan.allocate_outputs()
    plan.execute(q, k, v, **outs, workspace=aligned[:plan.workspace_size])
    with pytest.raises(ValidationError, match=r"workspace: expected a data pointer aligned to 128"):
        plan.execute(q, k, v, **outs, workspace=aligned[16:16 + plan.workspace_size])


@pytest.mark.parametrize("features_m", [False, True], ids=["keys-as-M", "features-as-M"])
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_dkdv_kernel_masks_exactly_the_edge_blocks(backend, case, features_m):
    """The dk/dv kernel skips the mask arithmetic on the query blocks that see every key of its
    key block (``unmasked_queries``) and walks the blocks from the last one down: with small
    tiles each mask shape has such blocks between masked ones, and every gradient matches the
    reference, with dk and dv held either way round."""
    from fusedops.backends.triton.gqa_attention import program as kernels
    opts = {k_: v_ for k_, v_ in case.items() if k_ not in ("sq", "sk")}
    q, k, v, do = qkv(2, case["sq"], case["sk"], 4, 2, 32, seed=13)
    expected = run("torch", q, k, v, do, **opts)
    plan = GQAAttentionBackward(q, k, v, expected["o"], expected["lse"], do, backend=backend, **opts)
    tiles = kernels.backward_tiles(plan.problem)
    config = kernels.BackwardTiles(kernels.Tiles(16, 32, 4), tiles.dq, features_m)
    plan._program, plan._launch = kernels.backward_program(plan.problem, config=config), None
    got = plan.compile().execute(q, k, v, expected["o"], expected["lse"], do,
                                 **plan.allocate_outputs(), workspace=plan.allocate_workspace())
    for name in ("dq", "dk", "dv"):
        assert_close(got[name], expected[name], KERNEL_TOLERANCE[torch.float32], name)


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
    from fusedops.backends.triton.gqa_attention import program as kernels
    a = AttentionProblem(torch.bfloat16, 2, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, False, 1024, 1024, CPU)
    b = AttentionProblem(torch.bfloat16, 7, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, False, 3584, 3584, CPU)
    assert kernels.forward_spec(a) == kernels.forward_spec(b)
    assert kernels.backward_specs(a) == kernels.backward_specs(b)
    spec = kernels.forward_spec(a)
    assert spec.constexpr("cu_seqlens_q_ptr") is None and spec.constexpr("cu_seqlens_k_ptr") is None
    d = DecodeAttentionProblem(torch.bfloat16, torch.bfloat16, 2, 1, 8, 2, 64, False, 64, 1, 64,
                               0.125, False, 1, CPU)
    for spec in kernels.decode_specs(d).values():
        absent = [n for n in ("block_table_ptr", "k_scale_ptr", "v_scale_ptr", "status_ptr")
                  if n in dict(spec.signature)]
        assert all(spec.constexpr(n) is None for n in absent), spec.name
    # packed: the sanitising stage and the kernels do not specialise on nseq or the tokens
    p2 = AttentionProblem(torch.bfloat16, 2, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, True, 700, 700, CPU, True)
    p7 = AttentionProblem(torch.bfloat16, 7, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, True, 3000, 3000, CPU, True)
    assert kernels.sanitise_spec(p2) == kernels.sanitise_spec(p7)
    assert kernels.forward_spec(p2) == kernels.forward_spec(p7)
    assert kernels.backward_specs(p2) == kernels.backward_specs(p7)
    assert kernels.sanitise_spec(p2).constexpr("HAS_STATUS") is True


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


def test_default_num_splits_follow_the_sm_count_batch_heads_and_capacity():
    """The fewest key ranges (each at least 512 positions, at most 32) whose b·h_kv·splits
    programs fill their waves to within 90% of the best count's; the plan takes the SM count of
    its target family when built on the CPU."""
    from fusedops.gqa_attention.contract import default_num_splits, wave_efficiency
    from fusedops.core.target import compiling_for, multiprocessors
    assert [default_num_splits(8192, p, 132)
            for p in (1, 8, 32, 64, 128, 512)] == [15, 15, 4, 2, 1, 1]
    assert [default_num_splits(8192, p, 148) for p in (8, 64, 512, 1024)] == [15, 9, 2, 1]
    assert default_num_splits(300, 8, 132) == 1 and default_num_splits(512, 1, 132) == 1
    assert default_num_splits(65536, 1, 132) == 29          # 32 at most: 29 is within 90%
    assert wave_efficiency(512, 132) == 512 / 132 / 4 and wave_efficiency(264, 132) == 1.0
    def desc(*shape, dtype=torch.bfloat16):
        return fusedops.TensorDesc(shape, dtype, device="cpu")
    for (b, hkv), arch, splits in (((1, 8), "sm_90", 15), ((8, 8), "sm_90", 2),
                                   ((64, 8), "sm_90", 1), ((8, 8), "sm_100", 9)):
        with compiling_for(arch):
            assert multiprocessors(torch.device("cpu")) == {"sm_90": 132, "sm_100": 148}[arch]
            plan = GQAAttentionDecode(q=desc(b, 1, 4 * hkv, 128), k_new=desc(b, 1, hkv, 128),
                                      v_new=desc(b, 1, hkv, 128), k_cache=desc(b, 8192, hkv, 128),
                                      v_cache=desc(b, 8192, hkv, 128),
                                      cache_seqlens=desc(b, dtype=torch.int32), backend="torch")
        assert plan.problem.num_splits == splits, (b, hkv, arch)


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


# -- 7. index data: sanitised offsets, invalid decode rows, the status word, host checks -----------
def status_word():
    return torch.zeros(1, dtype=torch.int32, device=DEVICE)


def sanitised(cu, total, longest):
    """(c', covered lengths) by the rule of docs/plans.md, in plain python."""
    out, prev = [], 0
    for i, c in enumerate(cu):
        prev = min(max(c, 0 if i == 0 else prev), total)
        out.append(prev)
    return out, [min(b - a, longest) for a, b in zip(out, out[1:])]


PACKED_INVALID = [
    # (cu_q, cu_k, max_q, max_k): q and k hold 20 tokens each
    ([0, 8, 30], [0, 8, 30], 22, 22),            # the second sequence ends past the tokens
    ([3, 8, 5], [0, 6, 20], 12, 14),             # q: not from 0, then decreasing
    ([0, 15, 20], [0, 9, 20], 10, 11),           # q, k: a sequence longer than max_seqlen
    ([-4, 2, 9], [0, 2**31 - 1, 5], 20, 20),     # negative start; k: int32 extreme, decreasing
    ([0, 12, 12], [0, 12, 12], 12, 12),          # valid, 8 padding tokens after the last sequence
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu_q,cu_k,max_q,max_k", PACKED_INVALID, ids=lambda v: str(v))
def test_packed_offsets_are_sanitised(backend, cu_q, cu_k, max_q, max_k):
    """Every covered token as if the sanitised offsets (each sequence truncated to max_seqlen)
    had been given; tokens no sequence covers: o = 0, lse = -inf, dq = 0, dk = dv = 0 exactly;
    Status.CU_SEQLENS exactly when the offsets needed it (nothing else is written to the word)."""
    g = torch.Generator().manual_seed(30)
    q, do = (torch.randn(20, 4, 16, generator=g).to(DEVICE) for _ in range(2))
    k, v = (torch.randn(20, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    opts = dict(causal=True, max_seqlen_q=max_q, max_seqlen_k=max_k,
                cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=DEVICE),
                cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=DEVICE))
    status = status_word()
    f = fusedops.gqa_attention_forward(q, k, v, status=status, backend=backend, **opts)
    g_ = fusedops.gqa_attention_backward(q, k, v, f["o"], f["lse"], do, status=status,
                                         backend=backend, **opts)
    sq, lq = sanitised(cu_q, 20, max_q)
    sk, lk = sanitised(cu_k, 20, max_k)
    valid = sq == cu_q and sk == cu_k and lq == [b - a for a, b in zip(cu_q, cu_q[1:])] and \
        lk == [b - a for a, b in zip(cu_k, cu_k[1:])]
    assert read_status(status) == (Status.OK if valid else Status.CU_SEQLENS)
    covered_q, covered_k = torch.zeros(20, dtype=torch.bool), torch.zeros(20, dtype=torch.bool)
    tol = KERNEL_TOLERANCE[torch.float32]
    for i in range(len(lq)):
        a, c = sq[i], sk[i]
        covered_q[a:a + lq[i]], covered_k[c:c + lk[i]] = True, True
        if lq[i] == 0:
            continue
        if lk[i] == 0:
            assert torch.all(f["o"][a:a + lq[i]] == 0) and torch.all(f["lse"][:, a:a + lq[i]] == float("-inf"))
            continue
        alone = run("torch", q[a:a + lq[i]][None], k[c:c + lk[i]][None], v[c:c + lk[i]][None],
                    do[a:a + lq[i]][None], causal=True)
        assert_close(f["o"][a:a + lq[i]], alone["o"][0], tol, f"o of sequence {i}")
        assert_close(g_["dq"][a:a + lq[i]], alone["dq"][0], tol, f"dq of sequence {i}")
        assert_close(g_["dk"][c:c + lk[i]], alone["dk"][0], tol, f"dk of sequence {i}")
        assert_close(g_["dv"][c:c + lk[i]], alone["dv"][0], tol, f"dv of sequence {i}")
    uq, uk = (~covered_q).to(DEVICE), (~covered_k).to(DEVICE)
    assert torch.all(f["o"][uq] == 0) and torch.all(f["lse"][:, uq] == float("-inf"))
    assert torch.all(g_["dq"][uq] == 0) and torch.all(g_["dk"][uk] == 0) and torch.all(g_["dv"][uk] == 0)
    for name, value in dict(**f, **g_).items():
        assert not torch.isnan(value).any(), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_uncovered_rows_are_written_into_poisoned_outputs(backend):
    """Through the plans with NaN-poisoned outputs: the rows no sequence covers are written too
    (not left as whatever the buffers held)."""
    (q, k, v, do), opts = packed([3, 5], [4, 6], 4, 2, 16, seed=31)
    cu = dict(cu_seqlens_q=torch.tensor([2, 9, 5], dtype=torch.int32, device=DEVICE),
              cu_seqlens_k=torch.tensor([0, 4, 99], dtype=torch.int32, device=DEVICE))
    options = dict(causal=False, max_seqlen_q=5, max_seqlen_k=6)
    status = status_word()
    fwd = GQAAttentionForward(q, k, v, **cu, **options, status=status, backend=backend).compile()
    o, lse = torch.full_like(q, float("nan")), torch.full((4, 8), float("nan"), device=DEVICE)
    fwd.execute(q, k, v, o, lse, **cu, workspace=fwd.allocate_workspace(), status=status)
    bwd = GQAAttentionBackward(q, k, v, o, lse, do, **cu, **options, status=status, backend=backend).compile()
    grads = {n: torch.full_like(t, float("nan")) for n, t in (("dq", q), ("dk", k), ("dv", v))}
    bwd.execute(q, k, v, o, lse, do, **grads, **cu, workspace=bwd.allocate_workspace(), status=status)
    assert read_status(status) == Status.CU_SEQLENS
    # q: sequence 0 covers [2, 7) (5 = max_seqlen_q of its 7 tokens), sequence 1 nothing
    for rows in (slice(0, 2), slice(7, 8)):
        assert torch.all(o[rows] == 0) and torch.all(lse[:, rows] == float("-inf"))
        assert torch.all(grads["dq"][rows] == 0)
    # k: sequence 0 covers [0, 4), sequence 1 [4, 10) (clamped to the 10 keys)
    for name, value in dict(o=o, lse=lse, **grads).items():
        assert not torch.isnan(value).any(), name


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


def _decode_case(paged, fp8=None, lengths=(5, -3, 95, 40), T=2):
    case = make_decode(4, T, 8, 2, 32, 96, list(lengths), page_size=16 if paged else None,
                       fp8=fp8, seed=33, device=DEVICE)
    return case, dict(case.tensors)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged,fp8", [(False, None), (True, None), (True, "head")],
                         ids=["contiguous", "paged", "paged-fp8"])
def test_decode_invalid_rows_append_nothing_and_see_nothing(backend, paged, fp8):
    """Rows with a negative cache length, one without room for the T new tokens and (paged) one
    needing a page past the pool write nothing anywhere and get o = 0, lse = -inf; the valid
    rows are exact (the oracle), pages no row needs may hold anything."""
    case, t = _decode_case(paged, fp8)
    expected_status = Status.CACHE_SEQLENS
    if paged:
        table = t["block_table"].clone()
        table[3, 1] = 10_000                    # row 3 (40 + 2 keys) needs pages 0..2
        table[0, 2:] = -5                       # row 0 (5 + 2 keys) needs page 0 only: still valid
        t["block_table"] = table
        expected_status |= Status.BLOCK_TABLE
    invalid = [1, 2, 3] if paged else [1, 2]
    old = {n: t[n].clone() for n in ("k_cache", "v_cache")}
    status = status_word()
    plan = GQAAttentionDecode(**t, status=status, backend=backend).compile()
    o, lse = torch.full_like(t["q"], float("nan")), torch.full((4, 8, 2), float("nan"), device=DEVICE)
    plan.execute(**t, o=o, lse=lse, workspace=plan.allocate_workspace(), status=status)
    assert read_status(status) == expected_status
    assert torch.all(o[invalid] == 0) and torch.all(lse[invalid] == float("-inf"))
    results = dict(o=o, lse=lse, k_cache=t["k_cache"], v_cache=t["v_cache"])
    check_against_oracle(Case(case.label, t, case.options), results)
    written = torch.zeros(t["k_cache"].shape[:2], dtype=torch.bool, device=DEVICE)
    for row in (0, 3) if not paged else (0,):
        for pos in range(int(t["cache_seqlens"][row]), int(t["cache_seqlens"][row]) + 2):
            page, off = (int(t["block_table"][row, pos // 16]), pos % 16) if paged else (row, pos)
            written[page, off] = True
    for name in ("k_cache", "v_cache"):
        a, b = t[name][~written], old[name][~written]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} changed outside the valid rows' slots"


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_status_bits(backend):
    cases = [((5, 0, 94, 40), None, Status.OK),
             ((5, 0, 95, 40), None, Status.CACHE_SEQLENS),
             ((5, -1, 9, 40), None, Status.CACHE_SEQLENS),
             ((5, 0, 94, 40), (2, 5, 12), Status.BLOCK_TABLE),        # row 2 needs all 6 pages
             ((5, 0, 94, 40), (2, 5, -1), Status.BLOCK_TABLE),
             ((5, 0, 94, 40), (1, 3, 999), Status.OK),                # row 1 needs page 0 only
             ((5, 0, 2**31 - 1, 40), (1, 0, 999), Status.CACHE_SEQLENS | Status.BLOCK_TABLE)]
    for lengths, bad_page, expected in cases:
        case, t = _decode_case(True, lengths=lengths)
        if bad_page is not None:
            table = t["block_table"].clone()
            pages = t["k_cache"].shape[0]
            table[bad_page[0], bad_page[1]] = bad_page[2] if bad_page[2] != 12 else pages
            t["block_table"] = table
        status = status_word()
        fusedops.gqa_attention_decode(**t, status=status, backend=backend)
        assert read_status(status) == expected, (lengths, bad_page)


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


# -- 8. performance model: floors, kernel cost models, tile tables, autotune ---------------------
def _problem(b=1, s=128, hq=4, hkv=2, d=64, causal=True, packed=False, dtype=torch.bfloat16):
    return AttentionProblem(dtype, b, s, s, hq, hkv, d, causal, (-1, -1), 0.125, packed, b * s,
                            b * s, CPU)


def test_floors_read_inputs_once_and_count_the_math():
    from fusedops.gqa_attention.contract import (backward_floor, decode_floor, forward_floor,
                                                 visible_pairs)
    assert visible_pairs(128, 128, True, (-1, -1)) == 128 * 129 // 2
    assert visible_pairs(1, 50, True, (-1, -1)) == 50              # bottom-right: sees every key
    assert visible_pairs(10, 10, False, (2, 0)) == 3 * 10 - 1 - 2
    p = _problem(b=2, s=128, hq=4, hkv=2, d=64)
    f, g = forward_floor(p), backward_floor(p)
    q, kv = 2 * 128 * 4 * 64 * 2, 2 * 128 * 2 * 64 * 2
    assert f.bytes_read == q + 2 * kv and f.bytes_written == q + 2 * 128 * 4 * 4
    assert f.flops == f.mma_flops == 4 * 64 * 4 * 2 * (128 * 129 // 2)
    assert g.flops == 2.5 * f.flops and g.bytes_written == q + 2 * kv
    assert g.bytes_read == 3 * q + 2 * kv + 2 * 128 * 4 * 4
    d = DecodeAttentionProblem(torch.bfloat16, torch.bfloat16, 2, 1, 8, 2, 64, False, 256, 1, 256,
                               0.125, False, 1, CPU)
    cache = 2 * 2 * 255 * 2 * 64 * 2                   # k and v at the fullest context, 255
    assert decode_floor(d).bytes_read == cache + (2 * 8 * 64 + 2 * 2 * 2 * 64) * 2 + 4 * 2
    assert decode_floor(d).mma_flops == 4 * 64 * 8 * 2 * 256


def test_forward_cost_counts_every_programs_loads_and_the_duplicated_work():
    """Two query blocks of 64 rows, causal: the first visits one key block, the second two. A
    program moves its q rows (16 KiB), 32 KiB of k and v per key block (1.5 on average) and
    its o and lse (16,640 B): 82,176 bytes, so G = 0.5 · 40 MB / 82,176 = 243 programs on
    sm_80, more than the 8 programs: each KV head's k and v count once. At 64 rows on 8 warps,
    sm_90's two warpgroups both compute S (1.5x the products), sm_80 and sm_100 do not."""
    from fusedops.backends.triton.gqa_attention.cost import forward_cost
    from fusedops.backends.triton.gqa_attention.tiles import Tiles
    p = _problem(b=1, s=128, hq=4, hkv=2, d=128)
    tiles = Tiles(64, 64, 8)
    cost = forward_cost(p, tiles, 128, "sm_80")
    e, rows = 2, 128 * 4
    assert cost.bytes_read == rows * 128 * e + 2 * 2 * 128 * 128 * e
    assert cost.bytes_written == rows * (128 * e + 4)
    assert cost.mma_flops == 4 * (1 + 2) * 2 * 2 * 64 * 64 * 128 and cost.mma_rows == 64
    assert forward_cost(p, tiles, 128, "sm_90").mma_flops == 1.5 * cost.mma_flops
    assert forward_cost(p, tiles, 128, "sm_100").mma_flops == cost.mma_flops
    # 128 rows: one warpgroup per 64-row slab, no duplication; one block visits both key blocks
    assert forward_cost(p, Tiles(128, 64, 8), 128, "sm_90").mma_flops == 4 * 2 * 2 * 2 * 128 * 64 * 128
    # 8 warps along 64 rows of mma.sync at d = 64 (the [64, 64] P·V puts them on the rows): 2x
    assert forward_cost(_problem(d=64), tiles, 64, "sm_80").mma_flops == \
        2 * forward_cost(_problem(d=64), Tiles(64, 64, 4), 64, "sm_80").mma_flops


def test_attention_costs_count_kv_and_q_rereads_by_reuse_distance():
    """Reuse distance (G = 0.5 · L2 over the mean bytes a program moves) at s = 4096, d = 128,
    64-row blocks, one KV head, sm_80 (40 MB).

    Forward, causal, 2 query heads: 128 programs, query block i visiting key blocks 0..i (4160
    visits of 32 KiB of k and v), each with 16 KiB of q and 16,640 B of o and lse: a mean of
    1,097,984 bytes, G = 18.2. Within a head the next query block re-reads a key block 1
    program later; head 1's query block i first visits key block i, i + 1 programs after head
    0's last query block did: a hit for i <= 17, so key blocks 18..63 count twice.

    dk/dv, not causal, 16 query heads: 64 key blocks, each loading every query row's q, do, lse
    and delta for the 16 heads (16 · 4096 · 520 bytes) and its own k, v and dk, dv (32 KiB
    each): G = 0.59 on sm_80, so every program's rows count; on sm_100 (126 MB) G = 1.8 and the
    next key block, 1 program later, hits: the rows count once."""
    from fusedops.backends.triton.gqa_attention.cost import dkdv_cost, forward_cost
    from fusedops.backends.triton.gqa_attention.tiles import Tiles
    s, d, e, block = 4096, 128, 2, 64
    kv_block = 2 * block * d * e
    fwd = forward_cost(_problem(s=s, hq=2, hkv=1, d=d), Tiles(block, block, 8), d, "sm_80")
    mean = block * d * e + block * (d * e + 4) + 2 * (64 * 65 // 2) * kv_block / 128
    assert 17 + 1 <= 0.5 * 40e6 / mean < 18 + 1
    assert fwd.bytes_read == 2 * s * d * e + (64 + 46) * kv_block
    rows = 16 * s * (2 * d * e + 8)
    p = _problem(s=s, hq=16, hkv=1, d=d, causal=False)
    mean = rows + 2 * kv_block
    assert 0.5 * 40e6 / mean < 1 <= 0.5 * 126e6 / mean
    own = 64 * kv_block                                       # k and v of every key block
    assert dkdv_cost(p, Tiles(block, block, 8), d, "sm_80").bytes_read == 64 * rows + own
    assert dkdv_cost(p, Tiles(block, block, 8), d, "sm_100").bytes_read == rows + own


def test_duplication_factors_are_those_of_the_compiled_kernels():
    """The factors ``fusedops kernels --dump`` shows (MMA FLOPs of each kernel's inner loop in its
    PTX against the tile's), per table entry: see gqa_attention.cost.duplication. The dk/dv kernel's
    products all have the key block as M (Sᵀ, dPᵀ: bn x bm; dv, dk: bn x BD)."""
    from fusedops.backends.triton.gqa_attention.cost import duplication

    def fwd(arch, bm, bn, bd, warps):
        return duplication(arch, warps, [(bm, bn, True), (bm, bd, False)], 1)

    def dkdv(arch, bm, bn, bd, warps):
        return duplication(arch, warps, [(bn, bm, True), (bn, bm, True), (bn, bd, False),
                                         (bn, bd, False)], 3)

    def dq(arch, bm, bn, bd, warps):
        return duplication(arch, warps, [(bm, bn, True), (bm, bn, True), (bm, bd, False)], 2)
    assert fwd("sm_90", 64, 64, 128, 8) == [2, 1] and fwd("sm_90", 64, 32, 256, 8) == [2, 1]
    assert fwd("sm_80", 64, 32, 256, 8) == [2, 1] and fwd("sm_80", 64, 64, 128, 8) == [1, 1]
    assert fwd("sm_100", 64, 64, 128, 8) == [1, 1] and fwd("sm_90", 64, 64, 64, 4) == [1, 1]
    # 128 keys on two warpgroups: each its own 64 keys; 64 keys on 8 warps: both compute Sᵀ
    assert dkdv("sm_90", 32, 128, 128, 8) == [1] * 4 and dkdv("sm_90", 32, 64, 64, 4) == [1] * 4
    assert dkdv("sm_90", 64, 64, 128, 8) == [2, 2, 1, 1] and dkdv("sm_100", 64, 64, 128, 8) == [1] * 4
    assert dq("sm_90", 64, 64, 128, 4) == [1, 1, 1] and dq("sm_90", 128, 32, 256, 8) == [1, 1, 1]
    for arch in ("sm_80", "sm_90", "sm_100"):
        assert dkdv(arch, 32, 16, 256, 4) == [1] * 4 and dkdv(arch, 32, 32, 256, 8) == [2, 2, 1, 1]
        assert dq(arch, 16, 32, 256, 8) == [2, 2, 1] and dq(arch, 32, 32, 256, 4) == [1, 1, 1]
        assert dq(arch, 32, 64, 128, 8) == [1, 1, 1]
    assert dkdv("sm_80", 64, 32, 128, 8) == [1] * 4 and dkdv("sm_80", 32, 32, 64, 4) == [1] * 4
    assert dkdv("sm_80", 32, 64, 128, 8) == [2, 2, 1, 1]       # why sm_80 has its own entry


def test_tile_tables_follow_the_target_arch_and_offer_candidates():
    from fusedops.backends.triton.gqa_attention import program as kernels
    from fusedops.backends.triton.gqa_attention import tiles as T
    from fusedops.core.target import compiling_for
    for d in (64, 128, 256):
        p = _problem(s=4096, d=d, causal=False)
        dec = DecodeAttentionProblem(torch.bfloat16, torch.bfloat16, 2, 1, 8, 2, d, True, 64, 4, 256,
                                     0.125, False, 2, CPU, pages=8)
        for arch in ("sm_80", "sm_90", "sm_100"):
            (fwd, why_f), (bwd, why_b), (dt, why_d) = (T.FORWARD[arch][max(64, d)],
                                                        T.BACKWARD[arch][max(64, d)], T.DECODE[arch])
            assert why_f and why_b and why_d
            with compiling_for(arch):
                assert T.forward_tiles(p) == fwd and T.backward_tiles(p) == bwd
                assert kernels.forward_candidates(p)[0] == fwd
                assert kernels.backward_candidates(p)[0] == bwd
                assert kernels.decode_candidates(dec)[0] == dt
                spec = kernels.forward_spec(p)
                assert (spec.constexpr("BM"), spec.num_warps, spec.maxnreg) == (fwd.bm, fwd.warps,
                                                                                 fwd.maxnreg)
                assert spec.cost is not None and spec.cost.mma_rows == fwd.bm
                for config in kernels.forward_candidates(p)[1:]:
                    assert kernels.forward_program(p, config=config).kernels[0].constexpr("BM") == config.bm
                for config in kernels.backward_candidates(p):
                    specs = kernels.backward_specs(p, config)
                    assert specs["dq"].constexpr("BM") == config.dq.bm
                    assert all(s.cost is not None for s in specs.values())
                assert all(s.cost is not None for s in kernels.decode_specs(dec).values())
    small = _problem(s=40, d=64)                  # tiles cut to the longest sequence
    assert T.forward_tiles(small).bm == 64 and T.forward_tiles(_problem(s=10)).bm == 16


def test_tuning_tensors_are_valid_index_data_at_the_modelled_lengths():
    """Autotune times candidates on the index data the cost models assume: packed offsets of the
    longest sequences the plan allows, every decode row at the fullest context, a block table
    within the pool; the host checks accept them."""
    from fusedops.gqa_attention.contract import sequence_lengths
    from fusedops.gqa_attention.samples import production
    from fusedops.core.desc import TensorDesc
    plans = {label: [c.build("torch") for c in calls] for label, calls in production()}
    fwd = plans["attn packed hkv8 d128 causal status"][0]
    t = fwd._tuning_tensors()
    assert t["cu_seqlens_q"].tolist() == [0, 4096, 8192, 12288, 16384, 16384, 16384, 16384, 16384]
    assert sequence_lengths(fwd.problem)[:5] == [(4096, 4096)] * 4 + [(0, 0)]
    fwd.check_index_values(**t)
    dec = plans["decode T4 paged fp8"][0]
    t = dec._tuning_tensors()
    assert t["cache_seqlens"].tolist() == [8192 - 4] * 64 and t["k_scale"].shape == (8,)
    dec.check_index_values(cache_seqlens=t["cache_seqlens"], block_table=t["block_table"])
    q = TensorDesc((2, 8, 4, 16), torch.float32, device=CPU)
    dense = GQAAttentionForward(q, TensorDesc((2, 8, 2, 16), torch.float32, device=CPU),
                                TensorDesc((2, 8, 2, 16), torch.float32, device=CPU))
    assert dense._tuning_tensors() == {}


@pytest.mark.skipif(not KERNELS, reason="needs the triton backend")
def test_every_backward_candidate_computes_the_same_gradients():
    from fusedops.backends.triton.gqa_attention import program as kernels
    q, k, v, do = qkv(1, 70, 70, 4, 2, 32, seed=41)
    expected = run("triton", q, k, v, do, causal=True)
    plan = GQAAttentionBackward(q, k, v, expected["o"], expected["lse"], do, causal=True,
                                backend="triton")
    for config in kernels.backward_candidates(plan.problem)[1:]:
        plan._program, plan._launch = kernels.backward_program(plan.problem, config=config), None
        got = plan.compile().execute(q, k, v, expected["o"], expected["lse"], do,
                                     **plan.allocate_outputs(), workspace=plan.allocate_workspace())
        for name in ("dq", "dk", "dv"):
            assert_close(got[name], expected[name], KERNEL_TOLERANCE[torch.float32], name)
