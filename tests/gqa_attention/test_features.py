"""GQA attention's plan features beyond the Nemotron shapes (docs/gqa_attention.md): softcap (training
forward and backward, decode), paged varlen prefill, the decode step's attend-only, non-causal
multi-query, window, cache_batch_idx, cache_leftpad and rotary (interleaved and not) paths, and
strided operands (views of wider buffers in and out, bitwise equal to contiguous runs). Every
numerical check is against a float64 formula written here (gradients by torch.autograd); the
refused combinations name the argument."""

from __future__ import annotations

import math

import pytest
import torch

import fusedops
from fusedops import GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward
from fusedops.gqa_attention.info import KERNEL_TOLERANCE
from fusedops.core.status import Status, read_status
from fusedops.errors import ValidationError
from fusedops.testing import assert_close
from fusedops.gqa_attention.oracle import visible as oracle_visible

from helpers import BACKENDS as RUNNABLE, DEVICE

BACKENDS = [b for b in RUNNABLE if b in GQAAttentionForward.backends]
FP32 = KERNEL_TOLERANCE[torch.float32]
NO_WINDOW = (-1, -1)


def rnd(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def visible(sq, sk, causal, window, first=0):
    """[sq, sk] bool: query i sees key j, bottom-right aligned (offset sk - sq), keys from
    ``first`` (a left padding) on."""
    keys = torch.arange(sk)[None, :] >= first
    return oracle_visible(sq, sk, causal, window, "cpu") & keys


def attend(q, k, v, ok, scale, softcap):
    """float64 o [sq, hq, d], lse [hq, sq] of one sequence q [sq, hq, d], k, v [sk, hkv, d] with
    the mask ``ok`` [sq, sk]: S = scale·q kᵀ, or softcap·tanh(scale·q kᵀ / softcap); rows seeing
    no key give o = 0, lse = -inf."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~ok.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("hqk,khd->qhd", p, vv), lse


def dense_reference(q, k, v, do, *, causal=False, window=NO_WINDOW, softcap=0.0):
    """o, lse and (autograd) dq, dk, dv of a dense batch in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ok = visible(q.shape[1], k.shape[1], causal, window)
    scale = 1 / math.sqrt(q.shape[-1])
    outs = [attend(leaves[0][i], leaves[1][i], leaves[2][i], ok, scale, softcap)
            for i in range(q.shape[0])]
    o = torch.stack([x[0] for x in outs])
    grads = torch.autograd.grad(o, leaves, do.double())
    return dict(o=o.detach(), lse=torch.stack([x[1] for x in outs]).detach(), dq=grads[0],
                dk=grads[1], dv=grads[2])


def check(result, expected, tol=FP32):
    """Every expected tensor within ``tol``; lse: the same -inf rows, the finite ones close."""
    for name, value in expected.items():
        got = result[name]
        if name == "lse":
            finite = torch.isfinite(value)
            assert torch.equal(finite.cpu(), torch.isfinite(got).cpu()), "lse: -inf rows differ"
            if finite.any():
                assert_close(got[finite.to(got.device)], value[finite].to(got.device), FP32, name)
        else:
            assert_close(got, value.to(got.device), tol, name)


def train(backend, q, k, v, do, **opts):
    f = fusedops.gqa_attention_forward(q, k, v, backend=backend, **opts)
    g = fusedops.gqa_attention_backward(q, k, v, f["o"], f["lse"], do, backend=backend, **opts)
    return dict(o=f["o"], lse=f["lse"], dq=g["dq"], dk=g["dk"], dv=g["dv"])


# -- softcap ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,window,softcap", [(False, NO_WINDOW, 0.4), (True, NO_WINDOW, 2.0),
                                                   (True, (6, -1), 0.8)])
def test_softcap_forward_and_backward(backend, causal, window, softcap):
    """S = c·tanh(scale·q kᵀ / c) forward and backward (dS times 1 - tanh²), against the
    float64 formula and autograd; a small c changes the result far beyond the tolerance."""
    q, k, v, do = rnd(2, 13, 4, 32, seed=1), rnd(2, 19, 2, 32, seed=2), rnd(2, 19, 2, 32, seed=3), \
        rnd(2, 13, 4, 32, seed=4)
    q = q * 3                                       # scores of a few units: tanh saturates
    opts = dict(causal=causal, window_size=window)
    result = train(backend, q, k, v, do, softcap=softcap, **opts)
    expected = dense_reference(q, k, v, do, softcap=softcap, causal=causal, window=window)
    check(result, expected)
    uncapped = dense_reference(q, k, v, do, causal=causal, window=window)
    assert (expected["o"] - uncapped["o"]).norm() > 1e-2 * uncapped["o"].norm()


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_packed_sequences(backend):
    lengths = [7, 0, 12]
    cu = torch.tensor([0, 7, 7, 19], dtype=torch.int32, device=DEVICE)
    q, k, v, do = rnd(19, 4, 32, seed=5) * 3, rnd(19, 2, 32, seed=6), rnd(19, 2, 32, seed=7), \
        rnd(19, 4, 32, seed=8)
    r = train(backend, q, k, v, do, causal=True, softcap=1.5, cu_seqlens_q=cu, cu_seqlens_k=cu,
              max_seqlen_q=12, max_seqlen_k=12)
    start = 0
    for n in lengths:
        if n:
            part = slice(start, start + n)
            e = dense_reference(q[part][None], k[part][None], v[part][None], do[part][None],
                                causal=True, softcap=1.5)
            check(dict(o=r["o"][part], lse=r["lse"][:, part], dq=r["dq"][part], dk=r["dk"][part],
                       dv=r["dv"][part]),
                  dict(o=e["o"][0], lse=e["lse"][0], dq=e["dq"][0], dk=e["dk"][0], dv=e["dv"][0]))
        start += n


def test_softcap_kernels_compile_the_tanh_in_and_take_the_wide_register_budget():
    """SOFTCAP is a constexpr (off: no tanh in the kernels); the softcapped variants take the
    tiles' wide budget (at 32-row tiles the d = 128 dq kernel spilled 16 bytes at 128 registers;
    the 64-row entry takes ptxas's own choice, and the kernel report checks that nothing
    spills)."""
    pytest.importorskip("triton")
    from fusedops.gqa_attention import AttentionProblem
    from fusedops.backends.triton.gqa_attention import program as kernels
    base = dict(dtype=torch.bfloat16, batch=2, seqlen_q=512, seqlen_k=512, heads_q=8, heads_kv=2,
                head_dim=128, causal=True, window=NO_WINDOW, scale=0.125, packed=False,
                total_q=1024, total_k=1024, device=torch.device("cpu"))
    plain, capped = AttentionProblem(**base), AttentionProblem(**base, softcap=30.0)
    assert kernels.forward_spec(plain).constexpr("SOFTCAP") is False
    assert kernels.forward_spec(capped).constexpr("SOFTCAP") is True
    assert kernels.forward_spec(AttentionProblem(**base, softcap=5.0)) == kernels.forward_spec(capped)
    dq_plain, dq_capped = kernels.backward_specs(plain)["dq"], kernels.backward_specs(capped)["dq"]
    tiles = kernels.backward_tiles(plain).dq
    assert (dq_plain.maxnreg, dq_capped.maxnreg) == (tiles.budget(False), tiles.budget(True))
    wide = kernels.Tiles(32, 64, 8, 2, 128, 192)
    dq_wide = kernels.backward_specs(capped, kernels.BackwardTiles(tiles, wide))["dq"]
    assert (dq_wide.maxnreg, kernels.backward_specs(plain, kernels.BackwardTiles(tiles, wide))["dq"]
            .maxnreg) == (192, 128)


# -- paged prefill ---------------------------------------------------------------------------------
def paged(k, v, cu_k, page, seed=0, extra=3):
    """Packed k, v [total_k, h, d] as pages [pages, page, h, d] scattered by a random block
    table [nseq, max_pages] (unused entries -1, unused pages NaN: they must never be read)."""
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    max_pages = max(1, max(-(-n // page) for n in lengths))
    need = sum(-(-n // page) for n in lengths)
    order = torch.randperm(need + extra, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(lengths), max_pages), -1, dtype=torch.int32)
    kp = torch.full((need + extra, page, *k.shape[1:]), float("nan"), dtype=k.dtype, device=k.device)
    vp = kp.clone()
    start = used = 0
    for i, n in enumerate(lengths):
        for j in range(-(-n // page)):
            p = order[used]
            used += 1
            table[i, j] = p
            rows = slice(start + j * page, start + min(n, (j + 1) * page))
            kp[p, : rows.stop - rows.start], vp[p, : rows.stop - rows.start] = k[rows], v[rows]
        start += n
    return kp, vp, table.to(k.device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,window,softcap", [(True, NO_WINDOW, 0.0), (False, (5, 3), 1.0)])
def test_paged_prefill_equals_the_unpaged_sequences(backend, causal, window, softcap):
    lq, lk = [5, 0, 9, 3], [20, 3, 40, 0]
    cq = torch.tensor([0, 5, 5, 14, 17], dtype=torch.int32, device=DEVICE)
    ck = torch.tensor([0, 20, 23, 63, 63], dtype=torch.int32, device=DEVICE)
    q, k, v = rnd(17, 4, 32, seed=10), rnd(63, 2, 32, seed=11), rnd(63, 2, 32, seed=12)
    kp, vp, table = paged(k, v, ck, 16, seed=1)
    opts = dict(causal=causal, window_size=window, softcap=softcap, cu_seqlens_q=cq,
                cu_seqlens_k=ck, max_seqlen_q=9, max_seqlen_k=40)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    r = fusedops.gqa_attention_forward(q, kp, vp, block_table=table, status=status,
                                       backend=backend, **opts)
    flat = fusedops.gqa_attention_forward(q, k, v, backend=backend, **opts)
    check(dict(r), dict(flat))
    assert read_status(status) == 0
    start_q = start_k = 0
    for nq, nk in zip(lq, lk):               # each sequence against the float64 formula
        if nq:
            o, lse = attend(q[start_q:start_q + nq], k[start_k:start_k + nk], v[start_k:start_k + nk],
                            visible(nq, nk, causal, window), 1 / math.sqrt(32), softcap)
            check(dict(o=r["o"][start_q:start_q + nq], lse=r["lse"][:, start_q:start_q + nq]),
                  dict(o=o, lse=lse))
        start_q, start_k = start_q + nq, start_k + nk


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_prefill_with_a_page_outside_the_pool_sees_no_key(backend):
    cq = torch.tensor([0, 4, 8], dtype=torch.int32, device=DEVICE)
    ck = torch.tensor([0, 20, 36], dtype=torch.int32, device=DEVICE)
    q, k, v = rnd(8, 4, 32, seed=13), rnd(36, 2, 32, seed=14), rnd(36, 2, 32, seed=15)
    kp, vp, table = paged(k, v, ck, 16, seed=2)
    good = fusedops.gqa_attention_forward(q, kp, vp, block_table=table, cu_seqlens_q=cq,
                                          cu_seqlens_k=ck, max_seqlen_q=4, max_seqlen_k=32,
                                          causal=True, backend=backend)
    table[0, 1] = kp.shape[0]                               # sequence 0's second page: outside
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    r = fusedops.gqa_attention_forward(q, kp, vp, block_table=table, cu_seqlens_q=cq,
                                       cu_seqlens_k=ck, max_seqlen_q=4, max_seqlen_k=32,
                                       causal=True, status=status, backend=backend)
    assert read_status(status) == Status.BLOCK_TABLE
    assert torch.all(r["o"][:4] == 0) and torch.all(r["lse"][:, :4] == float("-inf"))
    assert torch.equal(r["o"][4:], good["o"][4:]) and torch.equal(r["lse"][:, 4:], good["lse"][:, 4:])
    with pytest.raises(ValidationError, match=r"block_table: expected entries in \[0, 6\), got "
                                              r"block_table\[0, 1\] = 6"):
        fusedops.gqa_attention_forward(q, kp, vp, block_table=table, cu_seqlens_q=cq,
                                       cu_seqlens_k=ck, max_seqlen_q=4, max_seqlen_k=32,
                                       check_inputs=True, backend=backend)


# -- decode ----------------------------------------------------------------------------------------
def rotary_tables(length, half, seed=0):
    angle = torch.rand(length, half, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return torch.cos(angle).to(DEVICE), torch.sin(angle).to(DEVICE)


def rotate(x, cos, sin, positions, interleaved):
    """float64 x [t, h, d] rotated at positions [t] on its first 2·cos.shape[1] features:
    (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), pairs (x0, x1), ... (interleaved) or
    halves."""
    x = x.double().clone()
    half = cos.shape[1]
    c, s = cos.double()[positions][:, None, :], sin.double()[positions][:, None, :]
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2].clone(), x[..., 1:2 * half:2].clone()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].clone(), x[..., half:2 * half].clone()
        x[..., :half], x[..., half:2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def decode_reference(q, k_new, v_new, k_cache, v_cache, lengths, *, batch_idx=None, leftpad=None,
                     causal=True, window=NO_WINDOW, softcap=0.0, cos=None, sin=None,
                     interleaved=False):
    """float64 (o, lse, k_cache, v_cache after the append) of a decode step, row by row: the
    new k (rotated at L + t) and v go to positions L.., query t (rotated at L + t, or L for
    every query when neither causal nor windowed) sees positions [leftpad, L + N) masked
    bottom-right aligned."""
    b, T, hq, d = q.shape
    N = 0 if k_new is None else k_new.shape[1]
    kc, vc = k_cache.clone(), v_cache.clone()
    o = torch.zeros(b, T, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, T), float("-inf"), dtype=torch.float64)
    for i in range(b):
        row = i if batch_idx is None else int(batch_idx[i])
        if row < 0:
            continue
        L, first = int(lengths[i]), 0 if leftpad is None else int(leftpad[i])
        qi = q[i].double()
        kn = None if k_new is None else k_new[i].double()
        if cos is not None:
            at = torch.arange(T) if causal or window != NO_WINDOW else torch.zeros(T, dtype=torch.long)
            qi = rotate(q[i], cos, sin, L + at, interleaved)
            kn = rotate(k_new[i], cos, sin, L + torch.arange(N), interleaved)
        if N:
            kc[row, L:L + N], vc[row, L:L + N] = kn.to(kc.dtype), v_new[i].to(vc.dtype)
        keys, values = kc[row, :L + N].double(), vc[row, :L + N].double()
        if N:
            keys[L:] = kn
        o[i], lse[i] = attend(qi, keys, values, visible(T, L + N, causal, window, first),
                              1 / math.sqrt(d), softcap)
    return o, lse, kc, vc


def decode_case(b=3, T=2, N=2, rows=None, capacity=48, hq=4, hkv=2, d=32, seed=20):
    t = dict(q=rnd(b, T, hq, d, seed=seed), k_new=rnd(b, N, hkv, d, seed=seed + 1) if N else None,
             v_new=rnd(b, N, hkv, d, seed=seed + 2) if N else None,
             k_cache=rnd(rows or b, capacity, hkv, d, seed=seed + 3),
             v_cache=rnd(rows or b, capacity, hkv, d, seed=seed + 4))
    return t


DECODE_FEATURES = {
    "attend-only": dict(N=0, lengths=[0, 17, 48]),
    "attend-only-noncausal": dict(N=0, lengths=[5, 17, 48], causal=False),
    "noncausal-multiquery": dict(T=3, N=3, lengths=[0, 20, 45], causal=False),
    "fewer-new-than-queries": dict(T=3, N=1, lengths=[4, 20, 47]),
    "window": dict(T=3, N=3, lengths=[2, 30, 45], window=(5, 0)),
    "window-noncausal": dict(T=2, N=2, lengths=[2, 30, 46], causal=False, window=(4, 3)),
    "softcap": dict(T=2, N=2, lengths=[3, 25, 46], softcap=0.7),
    "cache-batch-idx": dict(lengths=[10, 3, 30], rows=5, batch_idx=[4, 0, 2]),
    "cache-batch-idx-padding": dict(lengths=[10, 3, 30], rows=5, batch_idx=[4, -1, 1]),
    "cache-batch-idx-attend-only": dict(N=0, lengths=[10, 3, 30], rows=2, batch_idx=[1, 1, 0]),
    "cache-leftpad": dict(lengths=[10, 3, 30], leftpad=[4, 3, 0]),
    "rotary-halves": dict(T=2, N=2, lengths=[0, 13, 40], rotary=16, interleaved=False),
    "rotary-interleaved": dict(T=2, N=2, lengths=[0, 13, 40], rotary=32, interleaved=True),
    "rotary-noncausal": dict(T=2, N=2, lengths=[1, 13, 40], rotary=16, causal=False),
    "everything": dict(T=2, N=2, lengths=[9, 20, 40], rows=4, batch_idx=[3, 1, 0],
                       leftpad=[2, 0, 7], window=(8, -1), softcap=3.0, rotary=16,
                       interleaved=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", DECODE_FEATURES)
def test_decode_features_against_the_formula(backend, feature):
    f = dict(DECODE_FEATURES[feature])
    lengths, rotary = f.pop("lengths"), f.pop("rotary", 0)
    causal, window, softcap = f.pop("causal", True), f.pop("window", NO_WINDOW), f.pop("softcap", 0.0)
    batch_idx, leftpad, interleaved = f.pop("batch_idx", None), f.pop("leftpad", None), \
        f.pop("interleaved", False)
    t = decode_case(**f)
    capacity = t["k_cache"].shape[1]
    index = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    if batch_idx is not None:
        index["cache_batch_idx"] = torch.tensor(batch_idx, dtype=torch.int32, device=DEVICE)
    if leftpad is not None:
        index["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32, device=DEVICE)
    cos = sin = None
    if rotary:
        cos, sin = rotary_tables(capacity + 4, rotary // 2, seed=3)
        index.update(rotary_cos=cos, rotary_sin=sin)
    o, lse, kc, vc = decode_reference(**t, lengths=lengths, batch_idx=batch_idx, leftpad=leftpad,
                                      causal=causal, window=window, softcap=softcap, cos=cos,
                                      sin=sin, interleaved=interleaved)
    old = t["k_cache"].clone(), t["v_cache"].clone()
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    r = fusedops.gqa_attention_decode(**t, **index, causal=causal, window_size=window,
                                      softcap=softcap, rotary_interleaved=interleaved,
                                      num_splits=2, status=status, backend=backend)
    check(dict(r), dict(o=o, lse=lse))
    assert read_status(status) == 0                 # padding rows are not reported
    if t["k_new"] is None:                          # attend only: the caches are untouched
        assert torch.equal(t["k_cache"], old[0]) and torch.equal(t["v_cache"], old[1])
    elif rotary:                                    # the rotated keys: one fp32 rounding
        assert_close(t["k_cache"], kc.to(DEVICE), torch.float32, "k_cache")
        assert torch.equal(t["v_cache"], vc.to(DEVICE))
    else:
        assert torch.equal(t["k_cache"], kc.to(DEVICE)) and torch.equal(t["v_cache"], vc.to(DEVICE))
    if feature == "cache-batch-idx-padding":
        assert torch.all(r["o"][1] == 0) and torch.all(r["lse"][1] == float("-inf"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_features_on_a_paged_cache_equal_the_contiguous_cache(backend):
    """leftpad, window, softcap and rotary on a paged cache: the contiguous cache's results."""
    t = decode_case(b=2, T=2, N=2, capacity=64, seed=30)
    cos, sin = rotary_tables(64, 8, seed=4)
    opts = dict(cache_seqlens=torch.tensor([7, 50], dtype=torch.int32, device=DEVICE),
                cache_leftpad=torch.tensor([3, 0], dtype=torch.int32, device=DEVICE),
                rotary_cos=cos, rotary_sin=sin, window_size=(20, -1), softcap=2.0, num_splits=2)
    table = torch.tensor([[5, 0, 7, 2], [1, 6, 3, 4]], dtype=torch.int32, device=DEVICE)
    kp = torch.empty(8, 16, 2, 32, device=DEVICE)
    vp = torch.empty_like(kp)
    for i in range(2):
        for j in range(4):
            kp[table[i, j]], vp[table[i, j]] = t["k_cache"][i, 16 * j:16 * j + 16], \
                t["v_cache"][i, 16 * j:16 * j + 16]
    r = fusedops.gqa_attention_decode(**dict(t, k_cache=kp, v_cache=vp), block_table=table,
                                      backend=backend, **opts)
    flat = fusedops.gqa_attention_decode(**t, backend=backend, **opts)
    check(dict(r), dict(flat))
    for i in range(2):
        for j in range(4):
            assert torch.equal(kp[table[i, j]], t["k_cache"][i, 16 * j:16 * j + 16])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("append", [True, False], ids=["append", "attend-only"])
def test_decode_never_reads_positions_outside_a_rows_keys(backend, append):
    """Cache positions before cache_leftpad and from cache_seqlens + N on hold NaN (an
    uninitialised cache): the same bits as with zeros there."""
    t = decode_case(b=3, T=2, N=2 if append else 0, capacity=48, seed=35)
    lengths, pads = [4, 20, 40], [1, 0, 9]
    index = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                 cache_leftpad=torch.tensor(pads, dtype=torch.int32, device=DEVICE))
    runs = []
    for fill in (0.0, float("nan")):
        caches = {n: t[n].clone() for n in ("k_cache", "v_cache")}
        for i, (L, lp) in enumerate(zip(lengths, pads)):
            for c in caches.values():
                c[i, L + (2 if append else 0):] = fill
                c[i, :lp] = fill
        runs.append(fusedops.gqa_attention_decode(**dict(t, **caches), **index, causal=False,
                                                  num_splits=2, backend=backend))
    assert torch.isfinite(runs[1]["o"]).all()
    assert torch.equal(runs[0]["o"], runs[1]["o"]) and torch.equal(runs[0]["lse"], runs[1]["lse"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rows_outside_the_rules_write_nothing(backend):
    """A row appending past the capacity, a left padding past its length, and two rows
    appending to one cache row (the second is refused): nothing written, o = 0, the bits set."""
    t = decode_case(b=4, T=1, N=1, rows=4, capacity=32, seed=40)
    old = t["k_cache"].clone()
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor([32, 5, 6, 7], dtype=torch.int32, device=DEVICE)
    r = fusedops.gqa_attention_decode(
        **t, cache_seqlens=lengths, status=status, backend=backend,
        cache_batch_idx=torch.tensor([0, 1, 2, 2], dtype=torch.int32, device=DEVICE),
        cache_leftpad=torch.tensor([0, 6, 0, 0], dtype=torch.int32, device=DEVICE))
    assert read_status(status) == Status.CACHE_SEQLENS | Status.SLOT_INDEX
    for i in (0, 1, 3):
        assert torch.all(r["o"][i] == 0) and torch.all(r["lse"][i] == float("-inf"))
    assert torch.equal(t["k_cache"][[0, 1, 3]], old[[0, 1, 3]])
    assert torch.equal(t["k_cache"][2, 6], t["k_new"][2, 0])


# -- strided operands ------------------------------------------------------------------------------
def fused(*parts, pad=8, fill=0.0):
    """Views [.., h_i, d] of one buffer [.., sum h_i·d + pad] holding ``parts`` side by side
    (the layout of a fused QKV projection), and the buffer; ``fill`` in the padding."""
    lead, d = parts[0].shape[:-2], parts[0].shape[-1]
    width = sum(p.shape[-2] * d for p in parts)
    buffer = torch.full((*lead, width + pad), fill, dtype=parts[0].dtype, device=DEVICE)
    views, at = [], 0
    for p in parts:
        n = p.shape[-2] * d
        view = buffer[..., at:at + n].unflatten(-1, (p.shape[-2], d))
        view.copy_(p)
        views.append(view)
        at += n
    return views, buffer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_strided_training_views_go_in_and_out_without_copies(backend, packed):
    """q, k, v (and do) as slices of one fused buffer; o, dq, dk, dv written into slices of
    NaN-filled wider buffers: the contiguous run's bits, the padding untouched."""
    if packed:
        q, k, v, do = rnd(21, 4, 32, seed=50), rnd(21, 2, 32, seed=51), rnd(21, 2, 32, seed=52), \
            rnd(21, 4, 32, seed=53)
        cu = torch.tensor([0, 9, 21], dtype=torch.int32, device=DEVICE)
        opts = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12)
    else:
        q, k, v, do = rnd(2, 11, 4, 32, seed=50), rnd(2, 11, 2, 32, seed=51), \
            rnd(2, 11, 2, 32, seed=52), rnd(2, 11, 4, 32, seed=53)
        opts = {}
    opts.update(causal=True, softcap=1.5)
    index = {k_: v_ for k_, v_ in opts.items() if k_.startswith("cu_")}
    reference = train(backend, q, k, v, do, **opts)
    (qs, ks, vs), _ = fused(q, k, v)
    (dos,), _ = fused(do, pad=24)
    fwd = GQAAttentionForward(qs, ks, vs, backend=backend, **opts).compile()
    (o,), o_buffer = fused(torch.empty_like(q), pad=16, fill=float("nan"))
    lse = torch.empty_like(reference["lse"])
    fwd.execute(qs, ks, vs, o, lse, workspace=fwd.allocate_workspace(), **index)
    bwd = GQAAttentionBackward(qs, ks, vs, o, lse, dos, backend=backend, **opts).compile()
    (dq, dk, dv), g_buffer = fused(torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                                   pad=8, fill=float("nan"))
    bwd.execute(qs, ks, vs, o, lse, dos, dq, dk, dv, workspace=bwd.allocate_workspace(), **index)
    for name, value in dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv).items():
        assert torch.equal(value, reference[name]), name
    assert torch.isnan(o_buffer[..., 4 * 32:]).all() and torch.isnan(g_buffer[..., 8 * 32:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_decode_views_and_caches(backend):
    """q, k_new, v_new slices of one fused projection, the caches kv_cache[:, :, 0] and [:, :, 1]
    of one [b, capacity, 2, h_kv, d] buffer, o into a NaN-filled wider buffer: the contiguous
    run's bits and caches."""
    t = decode_case(b=2, T=2, N=2, capacity=32, seed=60)
    index = dict(cache_seqlens=torch.tensor([4, 29], dtype=torch.int32, device=DEVICE))
    flat = {k_: v_.clone() for k_, v_ in t.items()}
    reference = fusedops.gqa_attention_decode(**flat, **index, backend=backend)
    (q, kn, vn), _ = fused(t["q"], t["k_new"], t["v_new"])
    kv_cache = torch.stack([t["k_cache"], t["v_cache"]], 2)
    kc, vc = kv_cache[:, :, 0], kv_cache[:, :, 1]
    plan = GQAAttentionDecode(q, kn, vn, kc, vc, index["cache_seqlens"], backend=backend).compile()
    (o,), o_buffer = fused(torch.empty_like(t["q"]), pad=16, fill=float("nan"))
    lse = torch.empty_like(reference["lse"])
    plan.execute(q, kn, vn, kc, vc, index["cache_seqlens"], o, lse,
                 workspace=plan.allocate_workspace())
    assert torch.equal(o, reference["o"]) and torch.equal(lse, reference["lse"])
    assert torch.equal(kc, flat["k_cache"]) and torch.equal(vc, flat["v_cache"])
    assert torch.isnan(o_buffer[..., 4 * 32:]).all()


def test_strided_layouts_that_break_row_alignment_are_refused():
    q = torch.zeros(2, 5, 4, 33, device=DEVICE)[..., :32]       # rows 132 bytes apart
    k = torch.zeros(2, 5, 2, 32, device=DEVICE)
    with pytest.raises(ValidationError, match=r"q: expected strides of multiples of 16 bytes"):
        GQAAttentionForward(q, k, k)
    with pytest.raises(ValidationError, match=r"k: expected the last dimension contiguous"):
        GQAAttentionForward(q[..., :32].contiguous(), k.transpose(-1, -2).contiguous().transpose(-1, -2), k)


# -- refusals --------------------------------------------------------------------------------------
def _decode_args(**change):
    t = decode_case(b=2, T=1, N=1, capacity=32, seed=70)
    t["cache_seqlens"] = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    t.update(change)
    return t


REFUSED = [
    ("softcap -1", lambda: GQAAttentionForward(rnd(1, 4, 2, 32), rnd(1, 4, 2, 32), rnd(1, 4, 2, 32),
                                               softcap=-1.0), r"softcap: expected .*>= 0.*got -1"),
    ("softcap bool", lambda: GQAAttentionDecode(**_decode_args(), softcap=True), r"softcap: expected"),
    ("paged dense", lambda: GQAAttentionForward(
        rnd(1, 4, 2, 32), rnd(2, 16, 2, 32), rnd(2, 16, 2, 32),
        block_table=torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)),
        r"block_table: expected packed sequences .*, got none"),
    ("paged page size", lambda: GQAAttentionForward(
        rnd(4, 2, 32), rnd(2, 10, 2, 32), rnd(2, 10, 2, 32),
        cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), max_seqlen_q=4,
        max_seqlen_k=4, block_table=torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)),
        r"k: expected a page size that is a multiple of 16, got 10"),
    ("paged max_seqlen_k", lambda: GQAAttentionForward(
        rnd(4, 2, 32), rnd(2, 16, 2, 32), rnd(2, 16, 2, 32),
        cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
        cu_seqlens_k=torch.tensor([0, 4], dtype=torch.int32, device=DEVICE), max_seqlen_q=4,
        max_seqlen_k=40, block_table=torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)),
        r"max_seqlen_k: expected at most the 2 pages of 16 keys block_table gives a sequence, got 40"),
    ("one of k_new, v_new", lambda: GQAAttentionDecode(**_decode_args(v_new=None)),
     r"k_new, v_new: expected both .* or neither .*, got one"),
    ("rotary without append", lambda: GQAAttentionDecode(
        **_decode_args(k_new=None, v_new=None), rotary_cos=torch.ones(32, 8, device=DEVICE),
        rotary_sin=torch.ones(32, 8, device=DEVICE)), r"rotary_cos: expected k_new, v_new with rotary"),
    ("rotary_cos alone", lambda: GQAAttentionDecode(**_decode_args(), rotary_cos=torch.ones(32, 8, device=DEVICE)),
     r"rotary_cos, rotary_sin: expected both or neither, got one"),
    ("rotary short", lambda: GQAAttentionDecode(**_decode_args(), rotary_cos=torch.ones(20, 8, device=DEVICE),
                                                rotary_sin=torch.ones(20, 8, device=DEVICE)),
     r"rotary_cos: expected at least the 32 positions of the cache, got \[20, 8\]"),
    ("rotary wide", lambda: GQAAttentionDecode(**_decode_args(), rotary_cos=torch.ones(32, 17, device=DEVICE),
                                               rotary_sin=torch.ones(32, 17, device=DEVICE)),
     r"rotary_cos: expected rotary_dim / 2 in \[1, d / 2 = 16\], got \[32, 17\]"),
    ("batch idx paged", lambda: GQAAttentionDecode(
        **_decode_args(k_cache=rnd(4, 16, 2, 32), v_cache=rnd(4, 16, 2, 32)),
        block_table=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
        cache_batch_idx=torch.zeros(2, dtype=torch.int32, device=DEVICE)),
     r"cache_batch_idx: expected None with a paged cache"),
    ("leftpad dtype", lambda: GQAAttentionDecode(
        **_decode_args(), cache_leftpad=torch.zeros(2, dtype=torch.int64, device=DEVICE)),
     r"cache_leftpad: expected dtype int32, got int64"),
    ("window", lambda: GQAAttentionDecode(**_decode_args(), window_size=(2, -3)),
     r"window_size: expected values >= -1"),
]


@pytest.mark.parametrize("build,match", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_combinations_name_the_argument(build, match):
    with pytest.raises(ValidationError, match=match):
        build()


def test_host_checks_name_the_decode_entry():
    """check_inputs: cache_seqlens past the room, a left padding past its length, two appending
    rows on one cache row."""
    t = _decode_args()
    with pytest.raises(ValidationError, match=r"cache_seqlens: expected cache_seqlens\[1\] in "
                                              r"\[0, 31\] \(room for 1 new tokens in a capacity "
                                              r"of 32\), got 32"):
        fusedops.gqa_attention_decode(**dict(t, cache_seqlens=torch.tensor([1, 32], dtype=torch.int32,
                                                                           device=DEVICE)),
                                      check_inputs=True)
    with pytest.raises(ValidationError, match=r"cache_leftpad: expected cache_leftpad\[0\] in \[0, 1\]"):
        fusedops.gqa_attention_decode(**t, cache_leftpad=torch.tensor([2, 0], dtype=torch.int32, device=DEVICE),
                                      check_inputs=True)
    with pytest.raises(ValidationError, match=r"cache_batch_idx: expected entries distinct rows when "
                                              r"appending \(row 0 has it too\), got cache_batch_idx\[1\] = 1"):
        fusedops.gqa_attention_decode(**t, cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32, device=DEVICE),
                                      check_inputs=True)
