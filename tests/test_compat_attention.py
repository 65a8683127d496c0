"""fusedops.compat's flash-attn functions, tested the way flash-attn's own test file tests them:
per function the argument set it supports (SUPPORT, checked against the signatures), cases
(causal, window, MHA/GQA/MQA, varlen, d = 32..128, softcap, paged prefill, the kvcache features,
the packed functions) through every backend against float64 reference formulas written here,
autograd through every function that returns a differentiable output, and the refusals."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from fusedops import GQAAttentionForward, compat
from fusedops.gqa_attention import ops as attention_ops
from fusedops.gqa_attention.info import KERNEL_TOLERANCE
from fusedops.compat import flash_attn as fa
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.plan import selection
from fusedops.plan.cache import EAGER_PLANS
from fusedops.testing import assert_close
from fusedops.gqa_attention.oracle import visible as oracle_visible

from helpers import BACKENDS as RUNNABLE, DEVICE

BACKENDS = [b for b in RUNNABLE if b in GQAAttentionForward.backends]

FP32 = KERNEL_TOLERANCE[torch.float32]
_TRAINING = ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
             "deterministic", "return_attn_probs")
_REFUSED = {"dropout_p": "dropout_p > 0: no RNG in the kernels (deterministic training)",
            "alibi_slopes": "ALiBi: no Nemotron model uses it"}
SUPPORT = {
    "flash_attn_func": dict(args=("q", "k", "v", *_TRAINING), refused=_REFUSED),
    "flash_attn_varlen_func": dict(
        args=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
              *_TRAINING, "block_table"),
        refused=dict(_REFUSED, block_table="with inputs requiring grad: paged prefill is "
                                           "forward only")),
    "flash_attn_qkvpacked_func": dict(args=("qkv", *_TRAINING), refused=_REFUSED),
    "flash_attn_kvpacked_func": dict(args=("q", "kv", *_TRAINING), refused=_REFUSED),
    "flash_attn_varlen_qkvpacked_func": dict(args=("qkv", "cu_seqlens", "max_seqlen", *_TRAINING),
                                             refused=_REFUSED),
    "flash_attn_varlen_kvpacked_func": dict(
        args=("q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
              *_TRAINING), refused=_REFUSED),
    "flash_attn_with_kvcache": dict(
        args=("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
              "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
              "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
              "return_softmax_lse"),
        refused=dict(alibi_slopes=_REFUSED["alibi_slopes"],
                     cache_seqlens="past the capacity (cache_seqlens + new tokens > capacity): "
                                   "ValidationError in eager mode")),
}
"""Per compat function: every argument it takes (flash-attn's signature) and those refused, when
set, with the reason. Everything else is served."""


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """The compat functions take no backend argument: run them with ``auto`` resolving to each
    backend in turn (the eager plan cache emptied around, so no plan of another backend is
    reused)."""
    monkeypatch.setattr(selection, "auto_candidates", lambda device, order: (request.param,))
    EAGER_PLANS.clear()
    yield request.param
    EAGER_PLANS.clear()


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def mask(sq, sk, causal, window, first=0):
    """flash-attn's masks, bottom-right aligned: query i sees key j (from ``first`` on)."""
    keys = torch.arange(sk)[None, :] >= first
    return oracle_visible(sq, sk, causal, window, "cpu") & keys


def attention_ref(q, k, v, ok, softcap=0.0, scale=None):
    """flash-attn's attention_ref for one sequence in float64 (differentiable): q [s_q, h_q, d],
    k, v [s_k, h_kv, d] (repeated per query head); o [s_q, h_q, d], lse [h_q, s_q]."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~ok.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, 1)), lse


def batch_ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, cu_q=None, cu_k=None):
    """o, lse of a dense batch [b, s, h, d] (lse [b, h, s]) or packed sequences (lse [h, total])."""
    if cu_q is None:
        outs = [attention_ref(q[i], k[i], v[i], mask(q.shape[1], k.shape[1], causal, window),
                              softcap) for i in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])
    o, lse = [], []
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        oi, li = attention_ref(q[a:b], k[c:e], v[c:e], mask(b - a, e - c, causal, window), softcap)
        o.append(oi)
        lse.append(li)
    return torch.cat(o), torch.cat(lse, 1)


def leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def close(actual, expected, name, tol=FP32):
    assert_close(actual.detach(), expected.detach().to(actual.device), tol, name)


# -- the table ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SUPPORT)
def test_support_table_states_every_argument(name):
    fn = getattr(compat, name)
    assert tuple(inspect.signature(fn).parameters) == SUPPORT[name]["args"]
    assert set(SUPPORT[name]["refused"]) <= set(SUPPORT[name]["args"])
    assert fn.__doc__ and name in compat.__all__


# -- flash_attn_func ------------------------------------------------------------------------------
CASES = [  # (s_q, s_k, h_q, h_kv, d, causal, window, softcap)
    (9, 9, 4, 4, 32, False, (-1, -1), 0.0),      # MHA
    (7, 12, 4, 2, 64, True, (-1, -1), 0.0),      # GQA, causal, s_q < s_k
    (12, 7, 4, 1, 32, True, (-1, -1), 0.0),      # MQA, causal, s_q > s_k: empty rows
    (11, 11, 4, 2, 32, False, (3, 2), 0.0),      # local window
    (10, 10, 2, 1, 128, True, (4, -1), 0.0),     # d = 128, sliding window
    (8, 13, 4, 2, 64, True, (-1, -1), 5.0),      # softcap (Gemma-2 style)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_flash_attn_func_against_the_reference_with_autograd(backend, case):
    sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = leaves(rnd(2, sq, hq, d, seed=1), rnd(2, sk, hkv, d, seed=2), rnd(2, sk, hkv, d, seed=3))
    do = rnd(2, sq, hq, d, seed=4)
    out = compat.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    ref = leaves(q.detach().double(), k.detach().double(), v.detach().double())
    ref_out, _ = batch_ref(*ref, causal, window, softcap)
    close(out, ref_out, "out")
    assert out.requires_grad
    grads = torch.autograd.grad(out, [q, k, v], do)
    ref_grads = torch.autograd.grad(ref_out, ref, do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        close(g, r, name)


def test_return_attn_probs_keeps_out_differentiable(backend):
    q, k, v = leaves(rnd(2, 9, 4, 32, seed=5), rnd(2, 9, 2, 32, seed=6), rnd(2, 9, 2, 32, seed=7))
    out, lse, probs = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert probs is None and out.requires_grad and not lse.requires_grad
    ref_out, ref_lse = batch_ref(q.detach(), k.detach(), v.detach(), causal=True)
    close(out, ref_out, "out")
    close(lse, ref_lse, "lse")
    out.sum().backward()
    plain = leaves(q.detach(), k.detach(), v.detach())
    compat.flash_attn_func(*plain, causal=True).sum().backward()
    for a, b in zip((q, k, v), plain):
        assert torch.equal(a.grad, b.grad)


# -- varlen and paged -----------------------------------------------------------------------------
def varlen(lengths_q, lengths_k, hq, hkv, d, seed):
    cu = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return (rnd(sum(lengths_q), hq, d, seed=seed), rnd(sum(lengths_k), hkv, d, seed=seed + 1),
            rnd(sum(lengths_k), hkv, d, seed=seed + 2), cu(lengths_q), cu(lengths_k))


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (4, 4), 2.0)])
def test_flash_attn_varlen_func_with_autograd(backend, causal, window, softcap):
    q, k, v, cq, ck = varlen([5, 1, 14], [8, 1, 14], 4, 2, 32, seed=10)
    q, k, v = leaves(q, k, v)
    out, lse, _ = compat.flash_attn_varlen_func(q, k, v, cq, ck, 14, 14, causal=causal,
                                                window_size=window, softcap=softcap,
                                                return_attn_probs=True)
    ref = leaves(q.detach().double(), k.detach().double(), v.detach().double())
    ref_out, ref_lse = batch_ref(*ref, causal, window, softcap, cq.cpu(), ck.cpu())
    close(out, ref_out, "out")
    close(lse, ref_lse, "lse")
    do = rnd(*q.shape, seed=13)
    for name, g, r in zip(("dq", "dk", "dv"), torch.autograd.grad(out, [q, k, v], do),
                          torch.autograd.grad(ref_out, ref, do.double())):
        close(g, r, name)


def test_flash_attn_varlen_func_paged_prefill(backend):
    """block_table: flash-attn's paged KV for varlen prefill (vLLM/SGLang), forward only."""
    q, k, v, cq, ck = varlen([3, 6], [20, 37], 4, 2, 32, seed=20)
    pages = torch.zeros(7, 16, 2, 32, device=DEVICE)
    vpages = torch.zeros_like(pages)
    table = torch.tensor([[4, 1, -1], [0, 6, 2]], dtype=torch.int32, device=DEVICE)
    for i, (start, n) in enumerate(((0, 20), (20, 37))):
        for j in range(-(-n // 16)):
            rows = slice(start + 16 * j, start + min(n, 16 * j + 16))
            pages[table[i, j], : rows.stop - rows.start] = k[rows]
            vpages[table[i, j], : rows.stop - rows.start] = v[rows]
    with torch.no_grad():
        out, lse, _ = compat.flash_attn_varlen_func(q, pages, vpages, cq, ck, 6, 37, causal=True,
                                                    block_table=table, return_attn_probs=True)
    ref_out, ref_lse = batch_ref(q, k, v, True, cu_q=cq.cpu(), cu_k=ck.cpu())
    close(out, ref_out, "out")
    close(lse, ref_lse, "lse")
    with pytest.raises(UnsupportedError, match=r"flash_attn_varlen_func: block_table: paged "
                                               r"prefill is forward only"):
        compat.flash_attn_varlen_func(q.requires_grad_(), pages, vpages, cq, ck, 6, 37,
                                      block_table=table)


# -- the packed functions -------------------------------------------------------------------------
def _record_inputs(monkeypatch):
    """The q, k, v the attention op's implementation receives (to see they are views)."""
    seen = []
    real = attention_ops.gqa_attention_forward

    def spy(q, k, v, **options):
        seen.append((q, k, v))
        return real(q, k, v, **options)
    monkeypatch.setattr(attention_ops, "gqa_attention_forward", spy)
    return seen


def test_packed_functions_are_zero_copy_views_over_the_unpacked(backend, monkeypatch):
    seen = _record_inputs(monkeypatch)
    qkv = rnd(2, 10, 3, 4, 32, seed=30).requires_grad_()
    out = compat.flash_attn_qkvpacked_func(qkv, causal=True, softcap=3.0)
    q, k, v = seen[-1]
    base, row = qkv.data_ptr(), 4 * 32 * qkv.element_size()
    assert (q.data_ptr(), k.data_ptr(), v.data_ptr()) == (base, base + row, base + 2 * row)
    plain = leaves(*qkv.detach().unbind(2))
    expected = compat.flash_attn_func(*plain, causal=True, softcap=3.0)
    assert torch.equal(out, expected)
    do = rnd(*out.shape, seed=31)
    (grad,) = torch.autograd.grad(out, [qkv], do)
    assert torch.equal(grad, torch.stack(torch.autograd.grad(expected, plain, do), 2))

    q = rnd(2, 7, 4, 32, seed=32).requires_grad_()
    kv = rnd(2, 12, 2, 2, 32, seed=33).requires_grad_()
    out = compat.flash_attn_kvpacked_func(q, kv, causal=True)
    assert seen[-1][1].data_ptr() == kv.data_ptr() and seen[-1][2].data_ptr() == kv.data_ptr() + 2 * 32 * 4
    assert torch.equal(out, compat.flash_attn_func(q, *kv.unbind(2), causal=True))
    out.sum().backward()
    assert kv.grad.shape == kv.shape and q.grad is not None

    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    qkv = rnd(11, 3, 4, 32, seed=34).requires_grad_()
    out, lse, _ = compat.flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True, return_attn_probs=True)
    assert seen[-1][0].data_ptr() == qkv.data_ptr()
    ref_out, ref_lse = batch_ref(*qkv.detach().unbind(1), True, cu_q=cu.cpu(), cu_k=cu.cpu())
    close(out, ref_out, "out")
    close(lse, ref_lse, "lse")
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape

    q = rnd(11, 4, 32, seed=35).requires_grad_()
    kv = rnd(15, 2, 2, 32, seed=36).requires_grad_()
    ck = torch.tensor([0, 9, 15], dtype=torch.int32, device=DEVICE)
    out = compat.flash_attn_varlen_kvpacked_func(q, kv, cu, ck, 7, 9, window_size=(3, 1))
    assert seen[-1][1].data_ptr() == kv.data_ptr()
    close(out, batch_ref(q.detach(), *kv.detach().unbind(1), False, (3, 1), cu_q=cu.cpu(),
                         cu_k=ck.cpu())[0], "out")
    out.sum().backward()
    assert kv.grad.shape == kv.shape


def test_strided_views_of_a_fused_projection_go_in_without_a_copy(backend, monkeypatch):
    """q, k, v sliced from one fused QKV projection (Nemotron's layout) reach the op as they are."""
    seen = _record_inputs(monkeypatch)
    proj = rnd(2, 9, (4 + 2 + 2) * 32 + 8, seed=40)
    q = proj[..., :128].unflatten(-1, (4, 32))
    k = proj[..., 128:192].unflatten(-1, (2, 32))
    v = proj[..., 192:256].unflatten(-1, (2, 32))
    out = compat.flash_attn_func(q, k, v, causal=True)
    assert [t.data_ptr() for t in seen[-1]] == [t.data_ptr() for t in (q, k, v)]
    assert torch.equal(out, compat.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(),
                                                   causal=True))


# -- flash_attn_with_kvcache ----------------------------------------------------------------------
def rotate(x, cos, sin, positions, interleaved):
    """flash-attn's apply_rotary_emb on x [t, h, d] at ``positions`` (float64)."""
    x = x.double().clone()
    r = 2 * cos.shape[1]
    c = cos.double()[positions][:, None]
    s = sin.double()[positions][:, None]
    if interleaved:
        x1, x2 = x[..., 0:r:2].clone(), x[..., 1:r:2].clone()
        x[..., 0:r:2], x[..., 1:r:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :r // 2].clone(), x[..., r // 2:r].clone()
        x[..., :r // 2], x[..., r // 2:r] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def kvcache_ref(q, k_cache, v_cache, k, v, lengths, *, batch_idx=None, leftpad=None, causal=False,
                window=(-1, -1), softcap=0.0, cos=None, sin=None, interleaved=True):
    """flash-attn's test_flash_attn_kvcache reference: (out, lse, k_cache, v_cache) in float64."""
    b, T = q.shape[:2]
    N = 0 if k is None else k.shape[1]
    kc, vc = k_cache.double().clone(), v_cache.double().clone()
    out, lse = [], []
    for i in range(b):
        row, L = (i if batch_idx is None else batch_idx[i]), lengths[i]
        qi, ki = q[i].double(), None if k is None else k[i].double()
        if cos is not None:
            at = L + (torch.arange(T) if causal or window != (-1, -1) else torch.zeros(T, dtype=torch.long))
            qi, ki = rotate(q[i], cos, sin, at, interleaved), rotate(k[i], cos, sin, L + torch.arange(N), interleaved)
        if N:
            kc[row, L:L + N], vc[row, L:L + N] = ki, v[i].double()
        o, s = attention_ref(qi, kc[row, :L + N], vc[row, :L + N],
                             mask(T, L + N, causal, window, 0 if leftpad is None else leftpad[i]), softcap)
        out.append(o)
        lse.append(s)
    return torch.stack(out), torch.stack(lse), kc, vc


KVCACHE = {
    "append-one-token": dict(T=1, N=1, causal=True),
    "append-causal-chunk": dict(T=3, N=3, causal=True, num_splits=2),
    "attend-only": dict(T=2, N=0, causal=True),
    "non-causal-multi-query": dict(T=3, N=3),
    "window": dict(T=2, N=2, causal=True, window=(6, 0)),
    "softcap": dict(T=1, N=1, causal=True, softcap=1.0),
    "cache-batch-idx": dict(T=1, N=1, causal=True, batch_idx=[3, 0, 1], rows=4),
    "cache-leftpad": dict(T=2, N=2, causal=True, leftpad=[2, 0, 10]),
    "rotary-interleaved": dict(T=2, N=2, causal=True, rotary=16, interleaved=True),
    "rotary-halves": dict(T=2, N=2, causal=False, rotary=32, interleaved=False),
    "paged-rotary-window": dict(T=2, N=2, causal=True, rotary=16, window=(9, -1), paged=True),
    "kv-cache-views": dict(T=1, N=1, causal=True, fused_cache=True),
}


@pytest.mark.parametrize("name", KVCACHE)
def test_flash_attn_with_kvcache(backend, name):
    f = dict(KVCACHE[name])
    T, N, rows, cap, lengths = f.pop("T"), f.pop("N"), f.pop("rows", 3), 32, [5, 17, 29]
    lengths = [min(L, cap - N) for L in lengths]
    q = rnd(3, T, 4, 32, seed=50)
    k, v = (rnd(3, N, 2, 32, seed=51), rnd(3, N, 2, 32, seed=52)) if N else (None, None)
    if f.pop("fused_cache", False):
        kv_cache = rnd(rows, cap, 2, 2, 32, seed=53)
        k_cache, v_cache = kv_cache[:, :, 0], kv_cache[:, :, 1]
    else:
        k_cache, v_cache = rnd(rows, cap, 2, 32, seed=53), rnd(rows, cap, 2, 32, seed=54)
    causal, window, softcap = f.pop("causal", False), f.pop("window", (-1, -1)), f.pop("softcap", 0.0)
    batch_idx, leftpad, rotary = f.pop("batch_idx", None), f.pop("leftpad", None), f.pop("rotary", 0)
    interleaved, paged = f.pop("interleaved", True), f.pop("paged", False)
    cos = sin = None
    if rotary:
        angle = torch.rand(cap, rotary // 2, generator=torch.Generator().manual_seed(5)) * 2 * math.pi
        cos, sin = torch.cos(angle).to(DEVICE), torch.sin(angle).to(DEVICE)
    expected = kvcache_ref(q, k_cache, v_cache, k, v, lengths, batch_idx=batch_idx, leftpad=leftpad,
                           causal=causal, window=window, softcap=softcap, cos=cos, sin=sin,
                           interleaved=interleaved)
    args = dict(cache_batch_idx=None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32, device=DEVICE),
                cache_leftpad=None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device=DEVICE))
    caches = (k_cache, v_cache)
    if paged:        # each row's 32 positions on pages 2·(b - 1 - i) and 2·(b - 1 - i) + 1
        table = torch.tensor([[4, 5], [2, 3], [0, 1]], dtype=torch.int32, device=DEVICE)
        caches = tuple(c.flip(0).reshape(6, 16, 2, 32).contiguous() for c in caches)
        args["block_table"] = table
    out, lse = compat.flash_attn_with_kvcache(
        q, *caches, k, v, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE), causal=causal,
        window_size=window, softcap=softcap, rotary_interleaved=interleaved,
        return_softmax_lse=True, **args, **f)
    close(out, expected[0], "out")
    close(lse, expected[1], "lse")
    new_k, new_v = caches
    if paged:
        new_k, new_v = (c.reshape(3, 32, 2, 32).flip(0) for c in caches)
    assert_close(new_k, expected[2].to(DEVICE), torch.float32, "k_cache")
    assert torch.equal(new_v, expected[3].to(DEVICE, torch.float32))


def test_flash_attn_with_kvcache_defaults(backend):
    """An int cache_seqlens; cache_seqlens None without k, v: attend to the whole cache."""
    q, k_cache, v_cache = rnd(2, 1, 4, 32, seed=60), rnd(2, 16, 2, 32, seed=61), rnd(2, 16, 2, 32, seed=62)
    k, v = rnd(2, 1, 2, 32, seed=63), rnd(2, 1, 2, 32, seed=64)
    before = k_cache.clone(), v_cache.clone()
    out = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=7, causal=True)
    close(out, kvcache_ref(q, *before, k, v, [7, 7], causal=True)[0], "out")
    whole = compat.flash_attn_with_kvcache(q, k_cache, v_cache)
    close(whole, kvcache_ref(q, k_cache, v_cache, None, None, [16, 16])[0], "out")


def test_flash_attn_with_kvcache_refuses_appending_past_the_capacity(backend, monkeypatch):
    """Eager: a ValidationError naming the row, nothing written. While a CUDA graph is captured
    (no host read): that row writes nothing and gets out = 0."""
    q, k, v = rnd(2, 1, 4, 32, seed=70), rnd(2, 1, 2, 32, seed=71), rnd(2, 1, 2, 32, seed=72)
    k_cache, v_cache = rnd(2, 16, 2, 32, seed=73), rnd(2, 16, 2, 32, seed=74)
    before = k_cache.clone()
    lengths = torch.tensor([3, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValidationError, match=r"cache_seqlens: expected cache_seqlens\[1\] in \[0, 15\] "
                                              r"\(room for 1 new tokens in a capacity of 16\), got 16"):
        compat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    assert torch.equal(k_cache, before)
    monkeypatch.setattr(fa, "_capturing", lambda: True)
    out = compat.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    assert torch.all(out[1] == 0) and torch.equal(k_cache[1], before[1])
    assert torch.equal(k_cache[0, 3], k[0, 0])


# -- refusals -------------------------------------------------------------------------------------
def _calls():
    q, k = rnd(1, 4, 2, 32), rnd(1, 4, 2, 32)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    return {
        "flash_attn_func": lambda **o: compat.flash_attn_func(q, k, k, **o),
        "flash_attn_varlen_func": lambda **o: compat.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 4, 4, **o),
        "flash_attn_qkvpacked_func": lambda **o: compat.flash_attn_qkvpacked_func(torch.stack([q, k, k], 2), **o),
        "flash_attn_kvpacked_func": lambda **o: compat.flash_attn_kvpacked_func(q, torch.stack([k, k], 2), **o),
        "flash_attn_varlen_qkvpacked_func": lambda **o: compat.flash_attn_varlen_qkvpacked_func(
            torch.stack([q[0], k[0], k[0]], 1), cu, 4, **o),
        "flash_attn_varlen_kvpacked_func": lambda **o: compat.flash_attn_varlen_kvpacked_func(
            q[0], torch.stack([k[0], k[0]], 1), cu, cu, 4, 4, **o),
        "flash_attn_with_kvcache": lambda **o: compat.flash_attn_with_kvcache(q, k, k, cache_seqlens=2, **o),
    }


@pytest.mark.parametrize("name", SUPPORT)
def test_refused_arguments_are_named(name):
    call = _calls()[name]
    refused = dict(alibi_slopes=torch.ones(2, device=DEVICE))
    if "dropout_p" in SUPPORT[name]["args"]:
        refused["dropout_p"] = 0.1
    for arg, value in refused.items():
        with pytest.raises(UnsupportedError, match=rf"{name}: {arg}: fusedops does not implement it"):
            call(**{arg: value})


def test_malformed_packed_tensors_and_cache_arguments_are_named():
    with pytest.raises(ValidationError, match=r"flash_attn_qkvpacked_func: qkv: expected \[b, s, 3, h, d\], got \[1, 4, 2, 2, 32\]"):
        compat.flash_attn_qkvpacked_func(rnd(1, 4, 2, 2, 32))
    with pytest.raises(ValidationError, match=r"flash_attn_varlen_kvpacked_func: kv: expected \[total_k, 2, h_kv, d\]"):
        compat.flash_attn_varlen_kvpacked_func(rnd(4, 2, 32), rnd(4, 2, 32), None, None, 4, 4)
    q, cache = rnd(1, 1, 2, 32), rnd(1, 8, 2, 32)
    with pytest.raises(ValidationError, match=r"flash_attn_with_kvcache: k, v: expected both .* got k alone"):
        compat.flash_attn_with_kvcache(q, cache, cache.clone(), k=rnd(1, 1, 2, 32), cache_seqlens=1)
    with pytest.raises(ValidationError, match=r"flash_attn_with_kvcache: cache_seqlens: expected the cached lengths"):
        compat.flash_attn_with_kvcache(q, cache, cache.clone(), rnd(1, 1, 2, 32), rnd(1, 1, 2, 32))
    with pytest.raises(ValidationError, match=r"softcap: expected"):
        compat.flash_attn_func(q, q, q, softcap=-1.0)


def test_backend_fixture_selects_the_backend(backend):
    plan = GQAAttentionForward(rnd(1, 4, 2, 32), rnd(1, 4, 2, 32), rnd(1, 4, 2, 32))
    assert plan.selected_backend == backend
