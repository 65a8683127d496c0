"""Sample inputs of GQA attention, and runs through its plans (for the tests, the demo, the AOT
compiles and the benchmark).

Two kinds of case: training cases (q, k, v, do and, packed, cu_seqlens_q/k) that ``run``
through the forward and backward plans, and decode cases (q, k_new, v_new, k_cache, v_cache,
cache_seqlens, block_table, k_scale, v_scale) that ``run`` through the decode plan; and
``index_fuzz``, drawn valid and invalid index data for the memory-safety fuzz test.
"""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc
from ..core.dtypes import dtype_name
from ..core.status import STATUS_DTYPE, Status
from ..core.target import target_arch
from ..opinfo import Case, PlanCall
from .contract import FP8, FP8_MAX
from .decode import GQAAttentionDecode
from .plans import GQAAttentionBackward, GQAAttentionForward

TRAINING_TENSORS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
DECODE_TENSORS = ("q", "k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table",
                  "k_scale", "v_scale")


def _label(text: str, dtype, options) -> str:
    extra = "".join(f" {k}={v}" for k, v in options.items() if k not in ("max_seqlen_q", "max_seqlen_k"))
    return f"{text} {dtype_name(dtype)}{extra}"


def make(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype=torch.float32, *,
         seed: int = 0, device="cpu", **options) -> Case:
    """A dense training case: q [b, sq, hq, d], k, v [b, sk, hkv, d] and do like q, N(0, 1)
    drawn in that order from a generator seeded with ``seed``; ``options``: the plans' options
    (causal, window_size, softmax_scale)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = dict(q=(b, sq, hq, d), k=(b, sk, hkv, d), v=(b, sk, hkv, d), do=(b, sq, hq, d))
    tensors = {n: torch.randn(*s, generator=gen).to(device, dtype) for n, s in shapes.items()}
    return Case(_label(f"b={b} s_q={sq} s_k={sk} hq={hq} hkv={hkv} d={d}", dtype, options),
                dict(tensors, cu_seqlens_q=None, cu_seqlens_k=None), options)


def make_packed(lengths_q, lengths_k, hq: int, hkv: int, d: int, dtype=torch.float32, *,
                seed: int = 0, device="cpu", **options) -> Case:
    """A packed training case: sequences of ``lengths_q`` queries and ``lengths_k`` keys (0
    allowed), q [total_q, hq, d], k, v [total_k, hkv, d], do like q (drawn in that order),
    cu_seqlens_q/k int32 and the maxima as options."""
    gen = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    shapes = dict(q=(tq, hq, d), k=(tk, hkv, d), v=(tk, hkv, d), do=(tq, hq, d))
    tensors = {n: torch.randn(*s, generator=gen).to(device, dtype) for n, s in shapes.items()}

    def cu(lengths):
        return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                            device=device)
    options = dict(options, max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    return Case(_label(f"packed q={list(lengths_q)} k={list(lengths_k)} hq={hq} hkv={hkv} d={d}",
                       dtype, options),
                dict(tensors, cu_seqlens_q=cu(lengths_q), cu_seqlens_k=cu(lengths_k)), options)


def make_decode(b: int, T: int, hq: int, hkv: int, d: int, capacity: int, lengths,
                dtype=torch.float32, *, page_size: int | None = None, fp8: str | None = None,
                seed: int = 8, device="cpu", **options) -> Case:
    """A decode case: q [b, T, hq, d], k_new, v_new [b, T, hkv, d] and contiguous caches
    [b, capacity, hkv, d] (drawn in that order), cache_seqlens = ``lengths``. ``page_size``: the
    caches cut into pages of that size, scattered by a random block table over b·capacity/page +
    3 pages. ``fp8``: "tensor" or "head": e4m3 caches with k_scale 0.02, v_scale 0.015 per tensor
    or per KV head. ``options``: softmax_scale, num_splits."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)
    t = dict(q=rnd(b, T, hq, d), k_new=rnd(b, T, hkv, d), v_new=rnd(b, T, hkv, d),
             k_cache=rnd(b, capacity, hkv, d), v_cache=rnd(b, capacity, hkv, d),
             cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
             block_table=None, k_scale=None, v_scale=None)
    if fp8 is not None:
        shape = (hkv,) if fp8 == "head" else (1,)
        t["k_scale"] = torch.full(shape, 0.02, device=device)
        t["v_scale"] = torch.full(shape, 0.015, device=device)
        for cache, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
            t[cache] = quantize(t[cache], t[scale])
    if page_size is not None:
        perm = torch.randperm(b * (capacity // page_size) + 3, generator=torch.Generator().manual_seed(1))
        table = perm[: b * capacity // page_size].view(b, -1).int().to(device)
        for cache in ("k_cache", "v_cache"):
            t[cache] = to_pages(t[cache], page_size, table)
        t["block_table"] = table
    label = (f"decode b={b} T={T} hq={hq} hkv={hkv} d={d} capacity={capacity}"
             f"{f' page={page_size}' if page_size else ''}{f' fp8 per {fp8}' if fp8 else ''}")
    return Case(_label(label, dtype, options), t, options)


def quantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An e4m3 cache from ``values`` [..., h_kv, d]: fp32 values / scale ([1] or [h_kv]),
    saturated to ±448."""
    return (values.float() / scale.float().view(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def to_pages(cache: torch.Tensor, page: int, table: torch.Tensor) -> torch.Tensor:
    """The contiguous cache [b, capacity, h_kv, d] as pages [table.numel() + 3, page, h_kv, d]
    (unused pages zero) placed by ``table`` [b, max_pages]."""
    b, capacity = cache.shape[:2]
    pages = torch.zeros(table.numel() + 3, page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    for i in range(b):
        for j in range(table.shape[1]):
            lo = j * page
            if lo < capacity:
                hi = min(capacity, lo + page)
                pages[table[i, j]][: hi - lo] = cache[i, lo:hi]
    return pages


def tiles(dtype=torch.bfloat16, device="cpu") -> list[Case]:
    """The production tile configurations (``production()``'s head dims, packing and decode
    caches) on problems small enough for the PTX emulator. The tile tables cut every tile to
    the longest sequence rounded up to a power of two (``gqa_attention.tiles._fit``), and no entry
    has a tile over 128, so a longest sequence of 65 or more keeps each entry's own tiles
    (33 or more at d = 64, whose tiles are 64); the sequences are few and short past that:

    - d = 128, causal with s_q = 80 < s_k = 150: one ragged 128-row query block (sm_90's
      forward) against three 64-key blocks (the last of 22 keys), so the forward's three
      pipeline stages all fill; the backward's 128-key (sm_90) and 32/64-key blocks, ragged;
    - d = 128 packed (the wide variants' register budgets: sm_90's forward, sm_80's dq),
      causal, sequences of 70, 0 and 23 queries against 90, 0 and 41 keys;
    - d = 64, causal, s_q = 45 < s_k = 100: two 64-key blocks, the second ragged;
    - d = 256, causal, s_q = 50 < s_k = 70: the 128-row tiles (forward, dq; dk/dv with the
      features as M on sm_90) and three 32-key blocks, the last of 6 keys;
    - decode of one token (h_q / h_kv = 4: the split kernel's 16 rows) on a contiguous bf16
      cache of 192 positions (a multiple of 64: 64 positions a step) in two splits, one row's
      cache empty;
    - decode of four tokens on a paged cache (64-position pages) with FP8 per-head scales in
      two splits, one row's new tokens closing its first page, the other's inside its third.
      sm_80 plans refuse e4m3 caches (sm_89 and newer), so under that target the cache is
      bf16, paged alike.

    One or two KV heads of a GQA group of 2 or 4, batch 1 or 2."""
    kw = dict(device=device)
    fp8 = None if target_arch(torch.device(device)) == "sm_80" else "head"
    return [make(1, 80, 150, 2, 1, 128, dtype, seed=20, causal=True, **kw),
            make_packed([70, 0, 23], [90, 0, 41], 4, 2, 128, dtype, seed=21, causal=True, **kw),
            make(1, 45, 100, 2, 1, 64, dtype, seed=22, causal=True, **kw),
            make(1, 50, 70, 2, 1, 256, dtype, seed=23, causal=True, **kw),
            make_decode(2, 1, 8, 2, 128, 192, [0, 150], dtype, num_splits=2, seed=24, **kw),
            make_decode(2, 4, 8, 2, 128, 192, [60, 131], dtype, page_size=64, fp8=fp8,
                        num_splits=2, seed=25, **kw)]


def cases(kind: str, *, dtype=torch.float32, device="cpu", backend: str = "torch") -> list[Case]:
    """small: oracle shapes (dense, causal, windowed, packed); edge: a single token, tile
    boundaries (16, 64 and their neighbours), d = 256, one-token packed sequences (every row sees
    a key); decode: decode steps (T = 1 and 3, a full cache, paged, FP8 per tensor and per KV
    head); tiles: the production tile configurations on small problems (``tiles``); demo: the
    demonstration's causal bf16 shape for ``backend`` (small ones on the CPU)."""
    kw = dict(device=device)
    if kind == "small":
        return [make(2, 9, 9, 4, 2, 16, dtype, **kw),
                make(2, 7, 12, 4, 2, 16, dtype, seed=1, causal=True, **kw),
                make(1, 12, 12, 4, 1, 8, dtype, seed=2, window_size=(3, 2), **kw),
                make_packed([3, 5], [4, 6], 4, 2, 16, dtype, seed=3, causal=True, **kw)]
    if kind == "edge":
        return [make(1, 1, 1, 2, 1, 8, dtype, **kw),
                make(1, 17, 65, 2, 2, 24, dtype, seed=1, causal=True, **kw),
                make(2, 64, 64, 4, 2, 64, dtype, seed=2, causal=True, **kw),
                make(1, 33, 33, 2, 1, 256, dtype, seed=3, window_size=(16, 0), **kw),
                make_packed([1, 17, 1], [1, 24, 2], 4, 2, 16, dtype, seed=4, causal=True, **kw)]
    if kind == "decode":
        return [make_decode(3, 1, 8, 2, 32, 100, [0, 37, 99], dtype, num_splits=3, **kw),
                make_decode(3, 3, 8, 2, 32, 100, [0, 37, 97], dtype, **kw),
                make_decode(3, 2, 8, 2, 32, 96, [5, 40, 90], dtype, page_size=16, seed=9, **kw),
                make_decode(2, 2, 8, 2, 64, 80, [10, 60], dtype, fp8="tensor", seed=10, **kw),
                make_decode(2, 2, 8, 2, 64, 80, [10, 60], dtype, fp8="head", seed=10, **kw)]
    if kind == "tiles":
        return tiles(dtype, device)
    if kind == "demo":
        on_cpu = torch.device(device).type == "cpu"
        b, s, hq, hkv, d = ({"torch": (2, 512, 8, 2, 64), "triton": (1, 64, 4, 2, 64)}[backend]
                            if on_cpu else (4, 4096, 32, 8, 128))
        return [make(b, s, s, hq, hkv, d, dtype, seed=2, causal=True, **kw)]
    raise ValueError(f"kind: expected small, edge, decode, tiles or demo, got {kind!r}")


def production() -> list[tuple[str, list[PlanCall]]]:
    """Training at b=4, s=4096, h_q=32 bf16: d=128 with h_kv 8 (causal) and 2, d=64 and d=256
    (h_kv 8, causal), and 16K tokens packed in 8 sequences of up to 4096 (d=128, h_kv 8,
    causal) with a status word; decode at b=64, h_q=32, h_kv=8, d=128 with 8192 positions: T=1 on a
    contiguous bf16 cache, T=4 on a paged (64-position pages) FP8 cache with per-head scales,
    both with a status word (as a server runs them); as TensorDescs on the CPU."""
    cpu = "cpu"
    bf16 = torch.bfloat16
    out = []
    for hkv, d, causal in ((8, 128, True), (2, 128, False), (8, 64, True), (8, 256, True)):
        b, s, hq = 4, 4096, 32
        q = TensorDesc((b, s, hq, d), bf16, device=cpu)
        kv = TensorDesc((b, s, hkv, d), bf16, device=cpu)
        lse = TensorDesc((b, hq, s), torch.float32, device=cpu)
        options = dict(causal=causal)
        out.append((f"attn hkv{hkv} d{d}{' causal' if causal else ''}", [
            PlanCall(GQAAttentionForward, dict(q=q, k=kv, v=kv), options),
            PlanCall(GQAAttentionBackward, dict(q=q, k=kv, v=kv, o=q, lse=lse, do=q), options)]))
    total, nseq, hq, hkv, d = 16384, 8, 32, 8, 128       # packed: 16K tokens, sequences <= 4K
    q = TensorDesc((total, hq, d), bf16, device=cpu)
    kv = TensorDesc((total, hkv, d), bf16, device=cpu)
    packing = dict(cu_seqlens_q=TensorDesc((nseq + 1,), torch.int32, device=cpu),
                   cu_seqlens_k=TensorDesc((nseq + 1,), torch.int32, device=cpu),
                   status=TensorDesc((1,), STATUS_DTYPE, device=cpu))
    options = dict(causal=True, max_seqlen_q=4096, max_seqlen_k=4096)
    lse = TensorDesc((hq, total), torch.float32, device=cpu)
    out.append(("attn packed hkv8 d128 causal status", [
        PlanCall(GQAAttentionForward, dict(q=q, k=kv, v=kv, **packing), options),
        PlanCall(GQAAttentionBackward, dict(q=q, k=kv, v=kv, o=q, lse=lse, do=q, **packing), options)]))
    b, hq, hkv, d, capacity = 64, 32, 8, 128, 8192
    for tokens, paged in ((1, False), (4, True)):
        q = TensorDesc((b, tokens, hq, d), bf16, device=cpu)
        new = TensorDesc((b, tokens, hkv, d), bf16, device=cpu)
        tensors = dict(q=q, k_new=new, v_new=new,
                       cache_seqlens=TensorDesc((b,), torch.int32, device=cpu),
                       status=TensorDesc((1,), STATUS_DTYPE, device=cpu))
        if paged:
            page = 64
            cache = TensorDesc((b * capacity // page, page, hkv, d), FP8, device=cpu)
            scale = TensorDesc((hkv,), torch.float32, device=cpu)
            tensors.update(block_table=TensorDesc((b, capacity // page), torch.int32, device=cpu),
                           k_scale=scale, v_scale=scale)
        else:
            cache = TensorDesc((b, capacity, hkv, d), bf16, device=cpu)
        out.append((f"decode T{tokens} {'paged fp8' if paged else 'bf16'}", [
            PlanCall(GQAAttentionDecode, dict(tensors, k_cache=cache, v_cache=cache),
                     dict(num_splits=16))]))
    return out


def is_decode(case: Case) -> bool:
    """Whether ``case`` is a decode case (it has caches)."""
    return "k_cache" in case.tensors


def _training_options(case: Case) -> dict:
    return {k: v for k, v in case.options.items()
            if k in ("causal", "softmax_scale", "window_size", "max_seqlen_q", "max_seqlen_k")}


def continuation(case: Case) -> dict:
    """The decode step that continues a training case (s_q, s_k >= 1): its last query token
    attends to a contiguous cache holding its keys (the packed tokens as one row), the last key
    and value appended as the new token. Fresh tensors (the caches are copies)."""
    t = case.tensors
    q, k, v = t["q"], t["k"], t["v"]
    if q.dim() == 3:
        q, k, v = q[None], k[None], v[None]
    b, sk = k.shape[:2]
    return dict(q=q[:, -1:].contiguous(), k_new=k[:, -1:].contiguous(), v_new=v[:, -1:].contiguous(),
                k_cache=k.clone(), v_cache=v.clone(),
                cache_seqlens=torch.full((b,), sk - 1, dtype=torch.int32, device=q.device))


def _status(device) -> torch.Tensor:
    return torch.zeros(1, dtype=STATUS_DTYPE, device=device)


def forward_outputs(call: PlanCall, backend: str) -> dict[str, torch.Tensor]:
    """o and lse of a forward PlanCall run on ``backend`` (for its backward's call)."""
    plan = call.build(backend).compile()
    t = call.tensors
    return dict(plan.execute(t["q"], t["k"], t["v"], **plan.allocate_outputs(),
                             cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"],
                             workspace=plan.allocate_workspace(), status=t.get("status")))


def plan_calls(case: Case, backend: str) -> list[PlanCall]:
    """A training case: the forward, the backward (its o and lse from running the forward on
    ``backend``) and the decode plan (``continuation``), in INFO.plans order. A decode case: the
    decode plan's call only. Each with a status word."""
    t = case.tensors
    device = t["q"].device
    if is_decode(case):
        return [PlanCall(GQAAttentionDecode, dict({n: t[n] for n in DECODE_TENSORS},
                                                  status=_status(device)), case.options)]
    options = _training_options(case)
    forward = PlanCall(GQAAttentionForward, dict({n: t[n] for n in TRAINING_TENSORS},
                                                 status=_status(device)), options)
    backward = PlanCall(GQAAttentionBackward,
                        dict({n: t[n] for n in TRAINING_TENSORS}, **forward_outputs(forward, backend),
                             do=t["do"], status=_status(device)), options)
    decode = PlanCall(GQAAttentionDecode, dict(continuation(case), status=_status(device)),
                      {k: v for k, v in options.items() if k == "softmax_scale"})
    return [forward, backward, decode]


def run(case: Case, backend: str) -> dict[str, torch.Tensor]:
    """Through the plans with caller-allocated buffers. A training case: forward then backward;
    returns o, lse, dq, dk, dv. A decode case: one decode step on copies of the caches; returns
    o, lse and the updated k_cache, v_cache."""
    t = case.tensors
    if is_decode(case):
        args = {n: t[n] for n in DECODE_TENSORS}
        args.update(k_cache=t["k_cache"].clone(), v_cache=t["v_cache"].clone())
        plan = GQAAttentionDecode(**args, **case.options, backend=backend).compile()
        out = plan.allocate_outputs()
        plan.execute(**args, **out, workspace=plan.allocate_workspace())
        return dict(out, k_cache=args["k_cache"], v_cache=args["v_cache"])
    options = _training_options(case)
    cu = dict(cu_seqlens_q=t["cu_seqlens_q"], cu_seqlens_k=t["cu_seqlens_k"])
    fwd = GQAAttentionForward(t["q"], t["k"], t["v"], **cu, **options, backend=backend).compile()
    out = fwd.allocate_outputs()
    fwd.execute(t["q"], t["k"], t["v"], out["o"], out["lse"], **cu, workspace=fwd.allocate_workspace())
    bwd = GQAAttentionBackward(t["q"], t["k"], t["v"], out["o"], out["lse"], t["do"], **cu,
                               **options, backend=backend).compile()
    grads = bwd.allocate_outputs()
    bwd.execute(t["q"], t["k"], t["v"], out["o"], out["lse"], t["do"], **grads, **cu,
                workspace=bwd.allocate_workspace())
    return dict(out, **grads)


# -- index fuzzing ---------------------------------------------------------------------------------
INT32_MAX, INT32_MIN = 2**31 - 1, -2**31


def _packed_fuzz(gen: torch.Generator, backend: str, device, draw: int) -> list:
    """A forward and a backward FuzzCase of one draw of packed offsets: valid (padding tokens
    after the last sequence included), or one kind of invalid offsets in cu_seqlens_q or _k."""
    from ..testing.fuzz import FuzzCase
    nseq = int(torch.randint(1, 4, (), generator=gen))
    hq, hkv, d = 2, 1, 16

    def lengths():
        return torch.randint(0, 9, (nseq,), generator=gen)
    lq, lk = lengths(), lengths()
    pad_q, pad_k = (int(torch.randint(0, 3, (), generator=gen)) for _ in range(2))
    pad_q, pad_k = max(pad_q, int(lq.sum() == 0)), max(pad_k, int(lk.sum() == 0))   # no empty q, k
    total_q, total_k = int(lq.sum()) + pad_q, int(lk.sum()) + pad_k
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), lq.cumsum(0)])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), lk.cumsum(0)])
    max_q, max_k = max(1, int(lq.max())), max(1, int(lk.max()))
    kinds = ("valid", "past the tokens", "not from 0", "negative start", "decreasing",
             "longer than max_seqlen", "int32 extremes")
    kind = kinds[draw % len(kinds)]
    bad_k = bool(torch.randint(0, 2, (), generator=gen))
    cu, total = (cu_k, total_k) if bad_k else (cu_q, total_q)
    i = int(torch.randint(1, nseq + 1, (), generator=gen))
    if kind == "past the tokens":
        cu[i:] += total + 1 - int(cu[-1]) + int(torch.randint(0, 5, (), generator=gen))
    elif kind == "not from 0":
        cu[0] = int(torch.randint(1, max(2, total + 3), (), generator=gen))
    elif kind == "negative start":
        cu[0] = -int(torch.randint(1, 6, (), generator=gen))
    elif kind == "decreasing":
        cu[i] = int(cu[i - 1]) - 1 - int(torch.randint(0, 4, (), generator=gen))
    elif kind == "longer than max_seqlen":
        if bad_k:
            max_k = max(0, int(lk.max()) - 1 - int(torch.randint(0, 2, (), generator=gen)))
        else:
            max_q = max(0, int(lq.max()) - 1 - int(torch.randint(0, 2, (), generator=gen)))
        if int((lk if bad_k else lq).max()) == 0:
            cu[-1] = total + 1                  # nothing to truncate: end past the tokens instead
    elif kind == "int32 extremes":
        cu[i] = INT32_MAX if i % 2 else INT32_MIN
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (), generator=gen)))
    q, do = (torch.randn(total_q, hq, d, generator=g).to(device) for _ in range(2))
    k, v = (torch.randn(total_k, hkv, d, generator=g).to(device) for _ in range(2))
    options = dict(causal=bool(draw % 2), max_seqlen_q=max_q, max_seqlen_k=max_k)
    if draw % 3 == 2:
        options["window_size"] = (3, 1)
    index = dict(cu_seqlens_q=cu_q.to(device, torch.int32), cu_seqlens_k=cu_k.to(device, torch.int32))
    expected = Status.OK if kind == "valid" else Status.CU_SEQLENS
    label = f"packed {kind} ({'cu_seqlens_k' if bad_k else 'cu_seqlens_q'}) {cu.tolist()} {options}"
    forward = PlanCall(GQAAttentionForward, dict(q=q, k=k, v=v, **index), options)
    saved = forward_outputs(forward, backend)
    backward = PlanCall(GQAAttentionBackward, dict(q=q, k=k, v=v, **saved, do=do, **index), options)
    return [FuzzCase(f"forward {label}", forward, expected),
            FuzzCase(f"backward {label}", backward, expected)]


DECODE_KINDS = ("valid", "negative length", "no room", "length extremes")
PAGED_KINDS = DECODE_KINDS + ("page past the pool", "negative page")


def _decode_fuzz(gen: torch.Generator, device, draw: int) -> object:
    """A decode FuzzCase: valid rows, or rows with a cache length out of range (negative, no room
    for the T new tokens, int32 extremes) or (paged) a needed page out of the pool; pages a row
    does not need may hold anything. fp32 caches (the harness compares outputs with isfinite,
    which float8 lacks; FP8 caches' invalid rows are tested in tests/gqa_attention/test_math.py)."""
    from ..testing.fuzz import FuzzCase
    b, hq, hkv, d, page = 3, 4, 2, 16, 16
    combos = [(k, False) for k in DECODE_KINDS] + [(k, True) for k in PAGED_KINDS]
    kind, paged = combos[draw % len(combos)]
    T = 1 + (draw // len(combos) + draw) % 2
    max_pages = 3
    capacity = page * max_pages
    lengths = torch.randint(0, capacity - T + 1, (b,), generator=gen)
    case = make_decode(b, T, hq, hkv, d, capacity, lengths.tolist(), page_size=page if paged else None,
                       seed=int(torch.randint(0, 2**30, (), generator=gen)))
    t = dict(case.tensors)
    row = int(torch.randint(0, b, (), generator=gen))
    lengths = lengths.clone()
    expected = Status.OK
    if kind == "negative length":
        lengths[row] = -int(torch.randint(1, 40, (), generator=gen))
        expected = Status.CACHE_SEQLENS
    elif kind == "no room":
        lengths[row] = capacity - T + 1 + int(torch.randint(0, 20, (), generator=gen))
        expected = Status.CACHE_SEQLENS
    elif kind == "length extremes":
        lengths[row] = INT32_MAX if draw // len(combos) % 2 == 0 else INT32_MIN
        expected = Status.CACHE_SEQLENS
    t["cache_seqlens"] = lengths.to(device, torch.int32)
    if paged:
        table = t["block_table"].clone()
        pages = t["k_cache"].shape[0]
        needed = -(-(int(lengths[row]) + T) // page)
        j = int(torch.randint(0, needed, (), generator=gen)) if needed > 0 else 0
        if kind == "page past the pool":
            table[row, j] = pages + int(torch.randint(0, 10_000, (), generator=gen))
            expected = Status.BLOCK_TABLE
        elif kind == "negative page":
            table[row, j] = -1 - int(torch.randint(0, 10, (), generator=gen))
            expected = Status.BLOCK_TABLE
        for i in range(b):                      # pages no row needs: anything (valid data)
            first_unneeded = -(-(int(lengths[i]) + T) // page)
            if 0 <= first_unneeded < max_pages and (kind != "negative length" or i != row):
                table[i, first_unneeded:] = -7 if i % 2 else 1 << 30
        t["block_table"] = table
        if kind == "length extremes" and int(lengths[row]) > 0:
            expected |= Status.BLOCK_TABLE if bool(((table[row] < 0) | (table[row] >= pages)).any()) \
                else Status.OK
    label = f"decode {kind} T={T}{' paged' if paged else ''} lengths={lengths.tolist()}"
    return FuzzCase(label, PlanCall(GQAAttentionDecode, {n: t[n] for n in DECODE_TENSORS}, case.options),
                    expected)


def index_fuzz(seed: int, backend: str, device="cpu") -> list:
    """Drawn index data for every plan that reads it (fp32, small shapes): packed offsets for
    the forward and the backward (valid; past the tokens; not starting at 0; negative;
    decreasing; a sequence longer than max_seqlen; int32 extremes) and decode rows (valid;
    cache lengths negative, without room, at the int32 extremes; pages past the pool or
    negative; garbage in pages no row needs), from a generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for draw in range(21):
        cases += _packed_fuzz(gen, backend, device, draw)
    for draw in range(20):
        cases.append(_decode_fuzz(gen, device, draw))
    return cases
