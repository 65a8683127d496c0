"""GQA attention: the kernels' cost models (modelled bytes and FLOPs against their floors and the
reuse-distance rule).
"""

from __future__ import annotations

import torch

from fusedops.gqa_attention import DecodeAttentionProblem

from .support import CPU, _problem


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
