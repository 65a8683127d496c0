"""GQA attention: the math. The reference against float64 oracles and gradcheck, every backend against the
reference, edge cases and invalid index data (what each backend computes from them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward
from fusedops.gqa_attention.info import INFO, KERNEL_TOLERANCE
from fusedops.gqa_attention.samples import make, make_packed, quantize, to_pages
from fusedops.core.status import Status, read_status
from fusedops.opinfo import Case, Tolerance
from fusedops.testing import assert_close

from helpers import DEVICE, dtype_id

from .support import BACKENDS, CPU, F64, _decode_case, compare, decode_inputs, packed, qkv, run


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
