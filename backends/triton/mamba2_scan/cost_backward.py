"""Mamba2 chunked scan (Triton): the analytic cost of the backward's per-chunk kernels (dx,
dB/dC with dx, ddt and the parameter reduction; kernels_backward.py), by the counting rules and with
the shapes of cost.py (its module docstring states them and the notation)."""

from __future__ import annotations

import torch

from fusedops.core.cost import Cost

from ..l2_reuse import Programs, every_program, key, per_arch
from .cost import _Dims, _Launch, cb_tile_bytes
from .tiles import Tiles, counts


def _head_rows(w: Programs, d: _Dims, V, name: str, prog, s, blk, h, ip=None) -> None:
    """x or dy rows of row block ``blk`` of head ``h`` loaded by ``prog``: each head-dim tile a
    tile of its own (the key every backward kernel uses for them), or only tile ``ip``."""
    for i in range(d.NPB) if ip is None else [None]:
        tile = ip if i is None else torch.full_like(s, i)
        bp = (d.P - tile * d.BP).clamp(max=d.BP)
        w.load(name, prog, key((s, d.S), (blk, d.NQB), (h, d.H), (tile, d.NPB)),
               V[s, blk] * bp * d.e)


def _bc_key(d: _Dims, s, k, g, tile) -> torch.Tensor:
    """The key of B or C rows of row block k of (segment s, group g) over state tile ``tile``
    (DBC_BN wide; DBC_NNB: the whole state)."""
    return key((s, d.S), (k, d.NQB), (g, d.G), (tile, d.DBC_NNB + 1))


def _state_slices(w: Programs, d: _Dims, name: str, prog, s, h, ip, jn, nbytes) -> None:
    """A [p, n] state of (segment, head) loaded by ``prog`` as its [BP, DBC_BN] slices (head-dim
    tiles ``ip``, state tiles ``jn``: None for all), ``nbytes`` per element."""
    ips = range(d.NPB) if ip is None else [None]
    jns = range(d.DBC_NNB) if jn is None else [None]
    for i in ips:
        for j in jns:
            a = ip if i is None else torch.full_like(s, i)
            b = jn if j is None else torch.full_like(s, j)
            bp = (d.P - a * d.BP).clamp(max=d.BP)
            bn = (d.N - b * d.DBC_BN).clamp(max=d.DBC_BN)
            w.load(name, prog, key((s, d.S), (h, d.H), (a, d.NPB), (b, d.DBC_NNB)),
                   bp * bn * nbytes)


def _dx_rows(w: Programs, d: _Dims, launch: _Launch, problem, prog, s, h, j, ip) -> None:
    """What dx's rows j of head h over head-dim tile ip load and store, one entry per (program,
    head): B rows j and the [BP, n] dH1 tile (unless the segment holds no tokens) for the end
    state's term; for every row block i >= j holding tokens the C·B tile (i, j), acum and dy
    rows i; x rows j, dts and acum j (and the D term's dy rows j); dx rows j, a BQ·4 ddt partial
    and (D) a BP·4 dD partial written."""
    V, g = launch.V, h // d.R
    bp = (d.P - ip * d.BP).clamp(max=d.BP)
    vj = V[s, j]
    w.load("acum", prog, key((s, d.S), (h, d.H), (j, d.NQB)), d.BQ * 4)
    w.load("acum last", prog, key((s, d.S), (h, d.H)), 4)
    for jn in range(d.DBC_NNB):
        bn = min(d.DBC_BN, d.N - jn * d.DBC_BN)
        w.load("B", prog, _bc_key(d, s, j, g, jn), vj * bn * d.e)
    _state_slices(w, d, "dH1", prog, s, h, ip, None, (launch.L[s] > 0) * d.e)
    entry = torch.arange(len(prog)).repeat_interleave(d.NQB)
    i = torch.arange(d.NQB).repeat(len(prog))
    keep = (i >= j[entry]) & (V[s[entry], i] > 0)
    e, i = entry[keep], i[keep]
    w.load("C·B", prog[e], key((s[e], d.S), (g[e], d.G), (i, d.NQB), (j[e], d.NQB)),
           cb_tile_bytes(d, i, j[e]))
    w.load("acum", prog[e], key((s[e], d.S), (h[e], d.H), (i, d.NQB)), d.BQ * 4)
    _head_rows(w, d, V, "dy", prog[e], s[e], i, h[e], ip[e])
    _head_rows(w, d, V, "x", prog, s, j, h, ip)
    w.load("dts", prog, key((s, d.S), (h, d.H), (j, d.NQB)), d.BQ * 4)
    if problem.has_D:
        _head_rows(w, d, V, "dy", prog, s, j, h, ip)
    w.store(prog, vj * bp * d.e + d.BQ * 4 + bp * 4 * problem.has_D)


def _dx_flops(problem, d: _Dims) -> tuple[int, int]:
    """(tensor, CUDA-core) FLOPs of dx: [BQ, BN] @ [BN, BP] over n per program and head-dim
    tile, [BQ, BQ] @ [BQ, BP] per pair."""
    programs = d.S * d.H * d.NPB * d.NQB
    pairs = d.H * d.NPB * d.each(lambda s: s.tri)
    mma = programs * 2 * d.BQ * d.Np * d.BP + pairs * 2 * d.BQ * d.BQ * d.BP
    cuda = pairs * d.BQ * d.BQ * 5 + programs * d.BQ * d.BP * (3 + 2 * problem.has_D)
    return mma, cuda


def _D_bytes(problem, d: _Dims) -> int:
    return (d.H * d.P if problem.D_per_channel else d.H) * 4 if problem.has_D else 0


@per_arch
def dx_cost(problem, t: Tiles) -> Cost:
    """dx (its own launch, without ``DX_IN_DBC``). Order: a 1-D grid over (NPB, NQB, S·h), the
    head-dim tile fastest, then the row block j, the (segment, head) slowest; no early exit (a
    program past the segment's end still loads its state tile, unless the segment holds no
    tokens, and writes its partials). Reuse: B rows j (over n) and the C·B tiles (i >= j, j)
    are shared by the R heads of the group (NPB·NQB = 4 programs apart); the segment's [BP, n]
    dH1 tile by its row blocks (once, where (S·h, NPB, NQB) order re-read it NQB times, S·h
    programs apart); dy rows i by every row block j <= i of the (segment, head), acum likewise
    (at most NQB - 1 apart); x rows j, dts read once, the D term's re-load of the diagonal dy
    block counted once. A program moves 134 KiB on average at the production shape: G = 183, so
    every shared tile is read once (``_dx_rows``)."""
    d = _Dims(problem, t)
    launch = _Launch(problem, t, (d.NPB, d.NQB, d.S * d.H))
    w = launch.programs
    ip, j, sh = w.coords
    _dx_rows(w, d, launch, problem, every_program(w), sh // d.H, sh % d.H, j, ip)
    read, written = w.count()
    mma, cuda = _dx_flops(problem, d)
    return Cost(mma + cuda, read + _D_bytes(problem, d) + d.table, written, mma, d.BQ)


def dbc_programs(problem, t: Tiles) -> int:
    """Programs of the dB/dC launch per (segment, group): a dB and a dC program per row block
    and state tile, and with ``DX_IN_DBC`` a dx program per row block and head-dim tile."""
    c = counts(problem, t)
    return 2 * c["NQB"] * c["DBC_NNB"] + (c["NQB"] * c["NPB"] if t.DX_IN_DBC else 0)


@per_arch
def dbc_cost(problem, t: Tiles) -> Cost:
    """dB and dC with the d(C·B) tiles they form, C·B and the straddling pieces, and with
    ``DX_IN_DBC`` dx. Order: a 1-D grid over (``dbc_programs``, S·g): per (segment, group) its
    dB and dC programs (dB/dC fastest, then the row block r, then the state tile), then its dx
    programs (the head-dim tile fastest, then the row block); dB/dC programs past the segment's
    end return (no slot), dx programs do not (``dx_cost``). Each dB/dC program
    loads its own rows r of B (dB) or C (dC) over its state tile, then for every block k on the
    other side of the diagonal holding tokens the other operand's rows k (C for dB, B for dC)
    and, for the R heads of the group, dy and x rows r and k over p (x rows r and dy rows k for
    dB, the reverse for dC) with acum (and dts) rows, then per head its rows r again (counted
    once) with the [p, BN] dH1 (dB) or H0 (dC) tile, and dC's first row block the dH1 tile too
    (shared with dB) for the <dH1, H0> partial (4 bytes a head written). dC's first state tile
    also forms C·B from C rows r and B rows k over n (the same tiles at DBC_NNB = 1) for the
    straddling pieces ((2·BQ + 1)·4 a pair and head written) and, without DX_IN_DBC, writes it
    for dx (``cb_tile_bytes`` a pair; with it the prologue's C·B kernel writes it). A dx program
    loops the group's R heads (``_dx_rows`` per head). The programs of a (segment, group) share
    its heads' dy and x rows, dH1 and H0 tiles and B and C rows; a dB/dC program moves 830 KiB
    (a mean over dB and dC, row blocks 0..3) at the production shape: G = 30 (76 on sm_100), so
    every tile is read once (a d(C·B) kernel feeding separate dB and dC launches would read dy
    and x three times between them and pass d(C·B) through the workspace); with DX_IN_DBC dx's
    dy, x, dH1 and B come from the L2 too (dx's own launch reads them again). One BQ·4 partial
    per head and the rows of dB (dC) written. MMA: per pair,
    R heads' [BQ, BP] @ [BP, BQ] over p in each of dB and dC (every d(C·B) tile formed twice)
    and [BQ, BQ] @ [BQ, BN]; [BQ, BP] @ [BP, BN] per head and row block; C·B's [BQ, BN] @
    [BN, BQ] over n once per pair; dx's (``dx_cost``)."""
    d = _Dims(problem, t)
    nqb, nnb, bnd = d.NQB, d.DBC_NNB, d.DBC_BN
    nbc = 2 * nqb * nnb
    launch = _Launch(problem, t, (dbc_programs(problem, t), d.S * d.G),
                     active=lambda la, local, sg: (local >= nbc)
                     | (local // 2 % nqb * d.BQ < la.L[sg // d.G]))
    w, V = launch.programs, launch.V
    local, sg = w.coords
    s, g = sg // d.G, sg % d.G
    every = every_program(w)
    if t.DX_IN_DBC:
        dx = every[local >= nbc]
        hp, hr = dx.repeat_interleave(d.R), torch.arange(d.R).repeat(len(dx))
        at = local[hp] - nbc
        _dx_rows(w, d, launch, problem, hp, s[hp], g[hp] * d.R + hr, at // d.NPB, at % d.NPB)
        keep = local < nbc
        every, local, s, g = every[keep], local[keep], s[keep], g[keep]
    role, r, jn = local % 2, local // 2 % nqb, local // (2 * nqb)
    at = torch.full((w.programs,), -1, dtype=torch.int64)
    at[every] = torch.arange(len(every))               # program -> its dB/dC row
    grad_b = role == 0
    bn = launch.rows(d.N, bnd, jn)
    full = torch.full_like(jn, nnb)                      # C·B's rows over the whole state

    def rows(operand, prog, k, tile):
        a = at[prog]
        width = torch.where(tile == nnb, d.N, bn[a])
        w.load(operand, prog, _bc_key(d, s[a], k, g[a], tile), V[s[a], k] * width * d.e)

    def loop(keep):
        a = torch.arange(len(every)).repeat_interleave(nqb)
        k = torch.arange(nqb).repeat(len(every))
        mask = keep(a, k)
        return a[mask], k[mask]

    for is_b, own, other in ((True, "B", "C"), (False, "C", "B")):
        mine = every[grad_b == is_b]
        rows(own, mine, r[at[mine]], jn[at[mine]])
        if is_b:
            a, k = loop(lambda a, k: grad_b[a] & (k >= r[a]) & (V[s[a], k] > 0))
        else:
            a, k = loop(lambda a, k: ~grad_b[a] & (k <= r[a]))
        prog = every[a]
        rows(other, prog, k, jn[a])
        if not is_b:
            first = jn[a] == 0
            cb, cba, cbk = prog[first], a[first], k[first]
            if nnb > 1:
                rows("C", cb, r[cba], full[cba])
                rows("B", cb, cbk, full[cba])
            stored = 0 if t.DX_IN_DBC else cb_tile_bytes(d, r[cba], cbk)
            w.store(cb, stored + d.R * (2 * d.BQ + 1) * 4)
        hp, hr = prog.repeat_interleave(d.R), torch.arange(d.R).repeat(len(prog))
        ha, hk = a.repeat_interleave(d.R), k.repeat_interleave(d.R)
        sh, h, rh = s[ha], g[ha] * d.R + hr, r[ha]
        mine_rows, their_rows = ("x", "dy") if is_b else ("dy", "x")
        _head_rows(w, d, V, mine_rows, hp, sh, rh, h)
        _head_rows(w, d, V, their_rows, hp, sh, hk, h)
        w.load("acum", hp, key((sh, d.S), (h, d.H), (rh, nqb)), d.BQ * 4)
        w.load("acum", hp, key((sh, d.S), (h, d.H), (hk, nqb)), d.BQ * 4)
        w.load("dts", hp, key((sh, d.S), (h, d.H), (rh if is_b else hk, nqb)), d.BQ * 4)
    a = torch.arange(len(every)).repeat_interleave(d.R)
    rr = torch.arange(d.R).repeat(len(every))
    prog, sh, h, rp, jp = every[a], s[a], g[a] * d.R + rr, r[a], jn[a]
    b_side = grad_b[a]
    w.load("acum last", prog[b_side], key((sh, d.S), (h, d.H))[b_side], 4)
    for is_b, operand, state, size in ((True, "x", "dH1", d.e), (False, "dy", "H0", d.es)):
        sel = b_side == is_b
        _head_rows(w, d, V, operand, prog[sel], sh[sel], rp[sel], h[sel])
        _state_slices(w, d, state, prog[sel], sh[sel], h[sel], None, jp[sel], size)
    first = ~b_side & (rp == 0)                 # dC's first row block: <dH1, H0> per head
    _state_slices(w, d, "dH1", prog[first], sh[first], h[first], None, jp[first], d.e)
    w.store(prog[first], 4)
    w.store(prog, d.BQ * 4)
    w.store(every, V[s, r] * bn * d.e)
    read, written = w.count()
    rows_ = d.each(lambda s: s.rb)
    tri = d.each(lambda s: s.tri)
    npd = nnb * bnd
    mma = (nnb * tri * 2 * (d.H * 2 * d.BQ * d.BQ * d.Pp + d.G * 2 * d.BQ * d.BQ * bnd)
           + d.H * rows_ * 2 * 2 * d.BQ * d.Pp * npd + d.G * tri * 2 * d.BQ * d.BQ * d.Np)
    cuda = (nnb * tri * 2 * d.H * d.BQ * d.BQ * 5 + tri * d.H * d.BQ * (d.BQ * 4 + 4)
            + 2 * d.H * rows_ * d.BQ * (d.Pp + 2 * npd + 4))
    extra = _D_bytes(problem, d) if t.DX_IN_DBC else 0
    if t.DX_IN_DBC:
        dx_mma, dx_cuda = _dx_flops(problem, d)
        mma, cuda = mma + dx_mma, cuda + dx_cuda
    return Cost(mma + cuda, read + extra + d.table, written, mma, d.BQ)


def dt_bwd_cost(problem, t: Tiles) -> Cost:
    """ddt, per (segment, head) program (grid (S·h)): the straddling pieces of its block pairs
    whose row block holds tokens (BQ floats of every pair, BQ + 1 more of every pair off the
    diagonal: the lanes the masked loads take), the U and W partials of its tokens (DBC_NNB
    rows each) and the <dH1, H0> partials (DBC_NNB floats) of segments holding tokens, the dx
    partials (NPB rows of Q·4) and dts unmasked, for every grid segment: each read by its one
    program (values passed between kernels); dt read and ddt written once; A, dt_bias counted
    once; dA and ddt_bias partials (4 bytes per program each)."""
    d = _Dims(problem, t)
    pieces = d.H * d.each(lambda s: s.tri * d.BQ + (s.tri - s.rb) * (d.BQ + 1)) * 4
    uwv = d.H * d.DBC_NNB * 4 * d.each(lambda s: 2 * s.L + 1)
    read = (pieces + uwv + d.S * d.H * (d.NPB + 1) * d.Q * 4
            + d.T * d.H * d.edt + 4 * d.H * (1 + problem.has_dt_bias) + d.table)
    written = d.T * d.H * d.edt + d.S * d.H * 4 * (1 + problem.has_dt_bias)
    flops = d.S * d.H * d.Q * (d.NPB + 2 * d.DBC_NNB + 12 + 6 * problem.dt_softplus
                               + 3 * d.pairs)
    return Cost(flops, read, written)


def param_reduce_cost(problem, t: Tiles) -> Cost:
    """dA, ddt_bias and dD: every segment's partials read once (S·h·4 each, dD S·h·NQB·p·4) by
    the program of their heads, the results written (and read first when accumulating)."""
    d = _Dims(problem, t)
    parts = (d.S * d.H * (1 + problem.has_dt_bias)
             + (d.S * d.H * d.NQB * d.P if problem.has_D else 0))
    out = d.H * (1 + problem.has_dt_bias) + ((d.H * d.P if problem.D_per_channel else d.H)
                                             if problem.has_D else 0)
    return Cost(parts, 4 * (parts + out * problem.accumulate), 4 * out)
