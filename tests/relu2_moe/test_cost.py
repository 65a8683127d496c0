"""Routed ReLU2 MoE: the kernels' cost models (modelled bytes and FLOPs against their floors and the
reuse-distance rule).
"""

from __future__ import annotations

import pytest
import torch


def _moe_problem(t, H, E, I, k, *, shared=0, accumulate=False):
    from fusedops.relu2_moe.contract import MoEProblem
    return MoEProblem(torch.bfloat16, t, H, E, I, k, shared, False, accumulate, torch.float32,
                      torch.device("cpu"))


def test_reuse_distance_counts_a_reread_within_the_l2_once():
    """docs/performance.md, "How traffic is counted": a tile loaded again by a program at most
    G programs after the previous load hits (G = half the L2 over the mean bytes a program
    moves); further apart, or a first load, it counts; a program's own bytes and stores always
    count; a program loading a tile twice counts it once."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.l2_reuse import reuse_traffic
    P, l2 = 10, 2 * 10 * 100.0                  # 100 bytes a program: G = 0.5·2000 / 100 = 10
    prog = torch.arange(P)
    zero = torch.zeros(P, dtype=torch.float64)
    stores = torch.full((P,), 50.0, dtype=torch.float64)
    every_5th = [(prog, prog % 5, torch.full((P,), 50.0))]      # key k by programs k, k + 5
    assert reuse_traffic(P, every_5th, zero, stores, l2) == (5 * 50.0, 500.0)
    assert reuse_traffic(P, every_5th, zero, stores, l2 / 4) == (10 * 50.0, 500.0)  # G = 2.5
    twice = [(torch.cat([prog, prog]), torch.zeros(2 * P, dtype=torch.int64),
              torch.full((2 * P,), 25.0))]
    assert reuse_traffic(P, twice, zero, stores, 1.0) == (25.0 * P, 500.0)     # once per program
    alone = torch.full((P,), 7.0, dtype=torch.float64)
    assert reuse_traffic(P, every_5th, alone, stores, l2)[0] == 5 * 50.0 + 70.0


def test_cost_model_follows_the_grid_order():
    """The dense GEMM (GROUP_M row tiles through every column tile, 16 column tiles of 128): at
    K = 256 a program moves 160 KiB, so G = 25 MB / 160 KiB ≈ 156 programs and x and W count
    once, even across two groups of 8 row tiles (W's column tile is re-read 121 programs later);
    at K = 16384 a program moves 8 MiB (G ≈ 3): x's row tile, re-read every GROUP_M = 8
    programs, counts once per column tile while W's column tile, re-read by the next row tile,
    counts once per group; a grid ordered row tile by row tile (GROUP_M = 1) turns that round."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.relu2_moe import cost as C
    N, BM = 2048, 128
    cases = ((1024, 256, 8, lambda x, w: x + w), (2048, 256, 8, lambda x, w: x + w),
             (1024, 16384, 8, lambda x, w: 16 * x + w), (1024, 16384, 1, lambda x, w: x + 8 * w))
    for t, K, group, expected in cases:
        p = _moe_problem(t, K, 1, N, 1, shared=N)
        cost = C.gemm_cost(p, routed=False, kdim=K, ndim=N, bm=BM, bn=128, bk=64, group_m=group,
                           grid_m_tiles=t // BM, row_tile=BM, arch="sm_90a")
        assert cost.bytes_read == expected(t * K * 2, K * N * 2), (t, K, group)
        assert cost.bytes_written == t * N * 2


def test_cost_model_at_nano_shapes():
    """At Nemotron 3 Nano's shapes (t = 8192, bf16, sm_90a): the up GEMM writes u [t·k, I] and
    nothing else (no relu(u)² buffer: the down GEMM forms it in registers); the down GEMM
    writes the weighted rows [t·k, H] in x's dtype and the shared expert's combining down GEMM
    reads them back (no combine kernel); under balanced routing each expert's 3 row tiles fall
    in one L2 group of 6, so each GEMM reads every expert's weights once, u or x's rows once
    per expert (k times per token); the routed weight gradients read the fp32 gradients once
    and write them once (accumulating), and their A and B operands once per expert. Every
    plan's floor is below its model, with the same tensor-core FLOPs to within the tiles'
    padding."""
    pytest.importorskip("triton")
    from fusedops.core.cost import total
    from fusedops.relu2_moe.samples import production
    plans = {(label, call.plan.__name__, tuple(call.options)): call.build("torch")
             for label, calls in production() for call in calls}
    fwd = plans[("moe nano t8192", "ReLU2MoEForward", ())]
    p = fwd.problem
    e, R, t, H, I, Is = 2, p.assignments, p.tokens, p.hidden, p.intermediate, p.shared_intermediate
    stages = fwd.kernel_program("triton").stages
    assert not any(s.name == "moe_combine_kernel" for s in stages)
    up, down, shared_up, shared_down = (s.kernel.cost for s in stages if s.name == "moe_gemm_kernel")
    weights, index = p.experts * H * I * e, 4 * (2 * p.experts + 1)
    rows, u = R * H * e, R * I * e
    assert up.bytes_written == u and down.bytes_written == rows
    assert up.bytes_read == pytest.approx(weights + R * (H * e + 4) + index, rel=1e-9)
    assert down.bytes_read == pytest.approx(weights + R * (I * e + 8) + index, rel=1e-9)
    assert shared_down.bytes_read > rows + t * Is * e + H * Is * e
    assert shared_down.bytes_written == t * H * e
    bwd = plans[("moe nano t8192", "ReLU2MoEBackward", ("accumulate",))]
    routed = [(dict(s.kernel.constexprs)["SPLIT"], s.kernel.cost)
              for s in bwd.kernel_program("triton").stages
              if s.name == "moe_wgrad_kernel" and dict(s.kernel.constexprs)["ROUTED"]]
    assert [split for split, _ in routed] == [1, 2, 3, 1, 2, 3]   # d_W_down, then d_W_up
    grads = p.experts * H * I * 4
    for split, wgrad in routed:           # A: u or d_u [R, I], B: d_out or x gathered [R, H]
        if split > 1:                     # balanced routing: no expert passes the chunk
            assert wgrad.bytes_written == 0 and wgrad.mma_flops == 0
            continue
        assert wgrad.bytes_written == grads
        assert grads + u + rows < wgrad.bytes_read < grads + u + rows + 0.01e9
    for key, plan in plans.items():
        costs = [k.cost for k in plan.kernel_program("triton").kernels]
        assert all(c is not None for c in costs), key
        modelled, floor = total(costs), plan.floor()
        assert floor.bytes <= modelled.bytes * 1.0001, key
        assert floor.mma_flops <= modelled.mma_flops, key
    modelled = total(s.kernel.cost for s in stages)
    assert modelled.mma_flops <= 1.05 * fwd.floor().mma_flops      # 1856 columns in 1920


def test_wgrad_split_items_cover_every_row_within_the_slots():
    """relu2_moe.cost.wgrad_items, the model of the split-K work table: the three launches together
    take every row of every expert exactly once, no program more than ``chunk`` rows, and the
    chunks past a split expert's first fit the slots, whatever the counts; chunk = t·k / slots
    rounded up to the K step, off where it reaches t."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.relu2_moe.cost import wgrad_items
    from fusedops.backends.triton.relu2_moe.tiles import HOPPER, wgrad_split
    generator = torch.Generator().manual_seed(0)
    for trial in range(50):
        E, slots, chunk = 1 + trial % 9, 1 + trial % 8, 16 * (1 + trial % 4)
        total = chunk * slots                       # the bound chunk >= t·k / slots allows
        counts = torch.multinomial(torch.rand(E, generator=generator) ** 4, total,
                                   replacement=True, generator=generator).bincount(minlength=E)
        launches = [wgrad_items(counts, split, chunk, slots) for split in (1, 2, 3)]
        covered = torch.zeros(E, dtype=torch.int64)
        for items in launches:
            covered.index_add_(0, items.expert, items.rows)
        assert torch.equal(covered, counts), (counts, chunk, slots)
        whole, chunks, firsts = launches
        assert chunks.to_slot.all() and not (whole.to_slot.any() or firsts.to_slot.any())
        assert len(whole.expert) == E and torch.equal(whole.rows == 0, (counts > chunk) | (counts == 0))
        assert len(chunks.expert) == int(firsts.parts.sum()) <= slots
        assert int(torch.cat([items.rows for items in launches]).max()) <= chunk
    nano = _moe_problem(8192, 2688, 128, 1856, 6)
    assert wgrad_split(nano, HOPPER, 64) == (8, 6144)              # 49152 / 8
    assert wgrad_split(_moe_problem(8192, 2688, 512, 1856, 22), HOPPER, 64) == (0, 0)
