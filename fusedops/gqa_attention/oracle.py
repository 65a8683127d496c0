"""Independent float64 math of the attention contract (no SDPA, no code shared with the torch
backend): explicit softmax and backward formulas per sequence and KV head group, the
bottom-right causal/window masks, and the decode step's cache update (a row with an invalid
cache length or page writes nothing and gets o = 0, lse = -inf), on the case's device."""

from __future__ import annotations

import math

import torch

from .contract import FP8, FP8_MAX


def visible(sq: int, sk: int, causal: bool, window, device) -> torch.Tensor:
    """[sq, sk] bool: query i sees key j (offset = sk - sq, bottom-right aligned)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    offset = sk - sq
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i + offset
    left, right = window
    if left >= 0:
        ok &= j >= i + offset - left
    if right >= 0:
        ok &= j <= i + offset + right
    return ok


def sequence(q, k, v, do, mask, scale: float):
    """One sequence in float64: q [sq, hq, d], k, v [sk, hkv, d], do like q (None: no
    backward), mask [sq, sk] (or [hq, sq, sk]). Returns o like q, lse [hq, sq] (-inf where a row
    sees no key) and, with do, dq, dk, dv (dk, dv summed over each KV head's query heads)."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    g = hq // hkv
    q, k, v = q.double(), k.double(), v.double()
    o = torch.zeros_like(q)
    lse = torch.full((hq, sq), float("-inf"), dtype=torch.float64, device=q.device)
    grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)] if do is not None else None
    if sk == 0 or sq == 0:
        return o, lse, grads
    mask = mask.expand(hq, sq, sk)
    for j in range(hkv):
        heads = slice(j * g, (j + 1) * g)
        qh = q[:, heads].transpose(0, 1)                        # [g, sq, d]
        s = scale * qh @ k[:, j].T                              # [g, sq, sk]
        s = s.masked_fill(~mask[heads], float("-inf"))
        m = s.amax(-1, keepdim=True)
        seen = torch.isfinite(m)
        m = torch.where(seen, m, torch.zeros_like(m))
        e = torch.exp(s - m)
        z = e.sum(-1, keepdim=True)
        p = e / torch.where(seen, z, torch.ones_like(z))
        oh = p @ v[:, j]                                        # [g, sq, d]
        o[:, heads] = oh.transpose(0, 1)
        lse[heads] = torch.where(seen, m + torch.log(torch.where(seen, z, torch.ones_like(z))),
                                 torch.full_like(z, float("-inf")))[..., 0]
        if do is None:
            continue
        doh = do[:, heads].double().transpose(0, 1)             # [g, sq, d]
        dp = doh @ v[:, j].T
        delta = (doh * oh).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        grads[0][:, heads] = (scale * ds @ k[:, j]).transpose(0, 1)
        grads[1][:, j] = scale * (ds.transpose(1, 2) @ qh).sum(0)
        grads[2][:, j] = (p.transpose(1, 2) @ doh).sum(0)
    return o, lse, grads


def training(case) -> dict[str, torch.Tensor]:
    """o, lse, dq, dk, dv of a training case, in float64."""
    t, opts = case.tensors, case.options
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    scale = opts.get("softmax_scale") or 1.0 / math.sqrt(q.shape[-1])
    causal, window = opts.get("causal", False), tuple(opts.get("window_size", (-1, -1)))
    if t.get("cu_seqlens_q") is not None:
        cq, ck = t["cu_seqlens_q"].tolist(), t["cu_seqlens_k"].tolist()
        spans = [((cq[i], cq[i + 1]), (ck[i], ck[i + 1])) for i in range(len(cq) - 1)]
        o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
        dq, dk, dv = o.clone(), torch.zeros(k.shape, dtype=torch.float64, device=q.device), \
            torch.zeros(v.shape, dtype=torch.float64, device=q.device)
        for (a, b), (c, e) in spans:
            mask = visible(b - a, e - c, causal, window, q.device)
            os_, ls, (gq, gk, gv) = sequence(q[a:b], k[c:e], v[c:e], do[a:b], mask, scale)
            o[a:b], lse[:, a:b], dq[a:b], dk[c:e], dv[c:e] = os_, ls, gq, gk, gv
        return dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv)
    mask = visible(q.shape[1], k.shape[1], causal, window, q.device)
    rows = [sequence(q[i], k[i], v[i], do[i], mask, scale) for i in range(q.shape[0])]
    return dict(o=torch.stack([r[0] for r in rows]), lse=torch.stack([r[1] for r in rows]),
                dq=torch.stack([r[2][0] for r in rows]), dk=torch.stack([r[2][1] for r in rows]),
                dv=torch.stack([r[2][2] for r in rows]))


def stored(values, scale, cache_dtype):
    """What the cache holds for ``values`` [..., h_kv, d]: fp32 value / scale saturated to
    ±FP8_MAX and rounded to e4m3 for an FP8 cache; the values themselves otherwise."""
    if cache_dtype != FP8:
        return values.to(cache_dtype)
    return (values.float() / scale.float().view(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def decode(case) -> dict[str, torch.Tensor]:
    """o, lse and the updated k_cache, v_cache of a decode case, in float64."""
    t = case.tensors
    q, table = t["q"], t["block_table"]
    b, T, hq, d = q.shape
    scale = case.options.get("softmax_scale") or 1.0 / math.sqrt(d)
    caches = {"k": t["k_cache"].clone(), "v": t["v_cache"].clone()}
    page = caches["k"].shape[1]
    capacity = table.shape[1] * page if table is not None else page
    fp8 = caches["k"].dtype == FP8

    def where(row: int, pos: int) -> tuple[int, int]:
        return (int(table[row, pos // page]), pos % page) if table is not None else (row, pos)

    o = torch.zeros(b, T, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, T), float("-inf"), dtype=torch.float64, device=q.device)
    lengths = t["cache_seqlens"].tolist()
    pages = caches["k"].shape[0]
    for row, length in enumerate(lengths):
        if not 0 <= length <= capacity - T or (table is not None and any(
                not 0 <= int(table[row, j]) < pages for j in range(-(-(length + T) // page)))):
            continue                                # an invalid row: nothing written, o = 0, lse = -inf
        for n in ("k", "v"):
            for tok in range(T):
                slot = where(row, length + tok)
                caches[n][slot] = stored(t[f"{n}_new"][row, tok], t[f"{n}_scale"], caches[n].dtype)
        total = length + T
        keys = {n: torch.stack([caches[n][where(row, j)] for j in range(total)]).double()
                if total else torch.zeros(0, *caches[n].shape[2:], dtype=torch.float64, device=q.device)
                for n in ("k", "v")}
        if fp8:
            keys = {n: keys[n] * t[f"{n}_scale"].double().view(-1, 1) for n in keys}
        j = torch.arange(total, device=q.device)[None, :]
        mask = j <= length + torch.arange(T, device=q.device)[:, None]
        o_row, lse_row, _ = sequence(q[row], keys["k"], keys["v"], None, mask, scale)
        o[row], lse[row] = o_row, lse_row
    return dict(o=o, lse=lse, k_cache=caches["k"].double(), v_cache=caches["v"].double())


def oracle(case) -> dict[str, torch.Tensor]:
    """Every result ``samples.run`` returns for ``case``, from float64 math."""
    return decode(case) if "k_cache" in case.tensors else training(case)
