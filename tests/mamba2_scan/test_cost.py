"""Mamba2 chunked scan: the kernels' cost models (modelled bytes and FLOPs against their floors and the
reuse-distance rule).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fusedops.mamba2_scan import samples

from .support import _production


def test_segment_row_blocks_of_the_model():
    """The loop counts the model sums: a full segment of 4 row blocks, and one of 100 tokens."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan.cost import _Segment
    full = _Segment(256, 1, (64, 64, 64, 64))
    assert (full.rb, full.tri, full.below(), full.above(), full.pair_rows(4)) == \
        (4, 10, 640, 640, 1280)
    short = _Segment(100, 1, (64, 36, 0, 0))
    assert (short.rb, short.tri, short.below(), short.above(), short.pair_rows(4)) == \
        (2, 3, 164, 136, 500)


def test_the_traffic_counter_counts_a_reread_by_reuse_distance():
    """The models' counter (l2_reuse.Programs, docs/performance.md, "How traffic is counted")
    on a grid (4, 2), the first dimension fastest: program p = i + 4·j. Every program loads one
    10-byte tile (twice with ``twice``), 3 bytes alone and stores 1: 14 bytes a program (24
    with ``twice``), so G = 0.5·l2 / 14. Tile i is loaded by programs i and i + 4 (4 apart):
    once if G >= 4 (l2 >= 112), by both programs below; tile j by the 4 consecutive programs of
    its column (1 apart): once if G >= 1 (l2 >= 48 with ``twice``), else once per program (a
    program's own re-load counts once). With i < 2 active, 4 programs run (i + 2·j: tile i 2
    apart, l2 = 56 gives G = 2). Loads alone and stores always count."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.l2_reuse import Programs

    def count(l2, key, active=None, twice=False):
        w = Programs((4, 2), l2, active)
        i, j = w.coords
        every = torch.arange(w.programs)
        for _ in range(1 + twice):
            w.load("a", every, {"i": i, "j": j}[key], 10)
        w.alone(every, 3)
        w.store(every, 1)
        return w.count()

    # (read, written): 8 x 3 bytes alone, 8 x 1 stored
    assert count(112, "i") == (4 * 10 + 24, 8)             # G = 4: the second load hits
    assert count(111, "i") == (8 * 10 + 24, 8)             # G = 3.96: it misses
    assert count(48, "j", twice=True) == (2 * 10 + 24, 8)  # G = 1
    assert count(47, "j", twice=True) == (8 * 10 + 24, 8)  # G < 1: every program's, once
    assert count(56, "i", active=lambda i, j: i < 2) == (2 * 10 + 12, 4)
    assert count(55, "i", active=lambda i, j: i < 2) == (4 * 10 + 12, 4)


def test_the_counter_expands_per_program_loop_bounds():
    """Programs.ranges: one (program, index) per iteration of a loop whose bounds differ
    between programs (the key blocks of a causal query block)."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.l2_reuse import Programs
    prog, index = Programs((3,), 1.0).ranges(torch.tensor([0, 5, 2]), torch.tensor([2, 0, 3]))
    assert prog.tolist() == [0, 0, 2, 2, 2] and index.tolist() == [0, 1, 2, 3, 4]


def test_segment_tokens_follow_the_segment_lengths():
    """The segments the models walk in grid order hold the lengths the floor sums (packed
    sequences: the tuning inputs' even split), then the unused segments."""
    pytest.importorskip("triton")
    from collections import Counter

    from fusedops.backends.triton.mamba2_scan.cost import segment_tokens
    from fusedops.mamba2_scan.contract import segment_lengths
    for label in ("scan h128 p64 n128 Q256", "scan varlen Q256", "scan p80 Q128"):
        problem = _production(label)[0].problem
        tokens = segment_tokens(problem)
        assert len(tokens) == problem.max_segments
        assert Counter(t for t in tokens if t) == dict(segment_lengths(problem)), label
    assert segment_tokens(_production("scan varlen Q256")[0].problem)[:65] == [128] * 64 + [0]


def _production_bytes():
    """Sizes the production shape's cost tests count with (b=2, l=8192, h=128, p=64, n=128,
    g=8, Q=256, bf16, BQ=64): T, S, BQ, Q, h, p, g, n, the element size e, then the bytes of x
    (xb), of the segment states in fp32 (state), of one fp32 state per sequence (seq_state),
    of dts or acum (fp32 per segment), of B or C rows (bc) and of the fp32 C·B tiles of the 10
    pairs as stored and loaded (cb: the 4 diagonal tiles' entries j <= i, in the 32-byte
    sectors their rows touch: sum over rows r < 64 of ceil(4(r + 1)/32)·32 = 9216 bytes)."""
    b, l, h, p, g, n, Q, e = 2, 8192, 128, 64, 8, 128, 256, 2
    T, S, BQ = b * l, b * l // Q, 64
    diagonal = sum(-(-4 * (r + 1) // 32) * 32 for r in range(BQ))
    assert diagonal == 9216
    return (T, S, BQ, Q, h, p, g, n, e, T * h * p * e, S * h * p * n * 4, b * h * p * n * 4,
            S * h * Q * 4, T * g * n * e, S * g * (6 * BQ * BQ * 4 + 4 * diagonal))


def test_forward_model_and_floor_at_the_production_shape():
    """The forward's modelled bytes on sm_90 (b=2, l=8192, h=128, p=64, n=128, g=8, Q=256, bf16,
    BQ=BP=BN=64, D and z, initial states, bf16 passed states), recomputed here by reuse distance
    (G = 0.5 · 50 MB over the mean bytes a program moves), and its floor.

    C·B: 10 pairs x S·g = 512 programs, the 10 pairs of a (segment, group) side by side, each
    loading C rows i and B rows j (64·128·2 = 16 KiB each) and storing a 64 x 64 fp32 tile (16
    KiB; 9 KiB of a diagonal one, its entries j <= i): G = 25e6 / 46,285 = 540, more than the
    at most 9 programs between two pairs that
    share C (or B) rows: C and B are read once.
    The fused walk: 256 programs (b·h, one head-dim tile), each walking its sequence's 32
    segments: x (1 MiB), B and C rows (2 MiB each), the 10 C·B tiles of every segment (5 MiB),
    acum and dts (64 KiB), the last acum, z (1 MiB) and the initial state tile (32 KiB) loaded;
    32 bf16 entering tiles (512 KiB), the fp32 final tile (32 KiB), y and y before the gate
    (2 MiB) stored: about 14 MiB a program, G = 25e6 / 14 MiB = 1.7. B, C and C·B are shared
    by the 16 heads of a group, 1 program apart: read once; x, acum and dts are the program's
    own: once. The split pipeline's states and output kernels (``FUSED=False``) are counted in
    ``test_split_forward_model_at_the_production_shape``."""
    pytest.importorskip("triton")
    from fusedops.core.cost import total
    from fusedops.core.target import compiling_for
    with compiling_for("sm_90"):
        fwd, _ = _production("scan h128 p64 n128 Q256")
        kernels = fwd.kernel_program("triton").kernels
    T, S, BQ, Q, h, p, g, n, e, xb, state, seq_state, acum, bc, cb = _production_bytes()
    assert 0.5 * 50e6 / (2 * BQ * n * e + BQ * BQ * 4) > 9
    assert 0.5 * 50e6 / (14 * 2**20) > 1
    expected = {
        "ssd_dt_cumsum_kernel": (T * h * e + 8 * h, 2 * acum),
        "ssd_cb_kernel": (2 * bc, cb),
        "ssd_fused_fwd_kernel": (xb + 2 * bc + cb + 2 * acum + 4 * S * h + xb + seq_state + 4 * h,
                                 state // 2 + seq_state + 2 * xb),  # z, h0, D; y, y before the gate
    }
    assert {k.name: (k.cost.bytes_read, k.cost.bytes_written) for k in kernels} == expected
    floor = fwd.floor()
    assert floor.bytes_read == 2 * xb + T * h * e + 2 * T * g * n * e + 4 * 3 * h + seq_state
    assert floor.bytes_written == xb + seq_state
    assert floor.mma_flops == 4 * T * h * p * n + S * Q * (Q + 1) // 2 * (2 * h * p + 2 * g * n)
    modelled = total(k.cost for k in kernels)
    assert 1.71 < modelled.bytes / floor.bytes < 1.73         # docs/mamba2_scan.md, Performance model


def test_split_forward_model_at_the_production_shape():
    """The split forward (``FUSED=False``) at the shape above, recounted as the fused walk's
    test does.

    States: 512 programs (2 state tiles x b·h), each walking its sequence's 32 segments: x and B
    (32 x 256 rows x 64 x 2 bytes = 1 MiB each), acum and dts (64 KiB), the last acum (128 B),
    the initial state tile (16 KiB) and 32 bf16 entering tiles plus the fp32 final one
    (278,528 B) stored: G = 25e6 / 2,457,728 = 10.2. x is shared by the 2 tiles of a head (1
    apart), B by the 16 heads of a group (2 apart), acum and dts by the 2 tiles: all once.
    Output: 32768 programs (4 row blocks x S·h), row block i loading acum (256 B), C rows i and
    the state tile (16 KiB each), for k <= i a C·B tile (16 KiB), acum, dts (256 B each) and x
    rows (8 KiB), the diagonal x block again for D (8 KiB) and z (8 KiB), storing y and y before
    the gate (16 KiB): a mean of 128,512 bytes (2.5 blocks k), G = 194.5. C and C·B are shared
    by the 16 heads of the group (4 apart), the state, x, acum and dts by the row blocks of the
    (segment, head) (at most 3 apart): all once."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan import program as kernels_module
    from fusedops.core.cost import total
    from fusedops.core.target import compiling_for
    with compiling_for("sm_90"):
        fwd, _ = _production("scan h128 p64 n128 Q256")
        split = replace(kernels_module.TILES["sm_90"][0], FUSED=False)
        kernels = kernels_module.forward_program(fwd.problem, config=split).kernels
    T, S, BQ, Q, h, p, g, n, e, xb, state, seq_state, acum, bc, cb = _production_bytes()
    expected = {
        "ssd_dt_cumsum_kernel": T * h * e + 8 * h + 2 * acum,
        "ssd_cb_kernel": 2 * bc + cb,
        "ssd_chunk_states_kernel": xb + bc + 2 * acum + 4 * S * h + state // 2 + 2 * seq_state,
        "ssd_chunk_scan_fwd_kernel": (state // 2 + xb + 2 * acum + bc + cb
                                      + xb + 4 * h + 2 * xb),      # z, D; y, y before the gate
    }
    assert {k.name: k.cost.bytes for k in kernels} == expected
    modelled = total(k.cost for k in kernels)
    assert 2.18 < modelled.bytes / fwd.floor().bytes < 2.2


def test_backward_dbc_kernel_at_the_production_shape():
    """The modelled bytes of the backward's dB/dC kernel (with the d(C·B) tiles, C·B and the
    straddling pieces) on sm_90 at the production shape (as the forward's test above, bf16
    passed states), recounted by reuse distance, with dx in its own launch (DX_IN_DBC off) and
    in this one (the table's entry). The 8 dB/dC programs of a (segment, group) run side by side
    (dB and dC fastest, then the 4 row blocks; the whole state in one tile).

    dB of row block j loads its B rows (64·128·2 = 16 KiB), for the 4 - j blocks i >= j C rows
    i (16 KiB) and for each of 16 heads dy rows i (8 KiB) and acum i (256 B), then per head x
    rows j (8 KiB), acum j, dts j (256 B each), the last acum (4 B) and the bf16 dH1 tile (64 x
    128 x 2 = 16 KiB), storing 16 partials (256 B each) and its dB rows (16 KiB). dC of row
    block i likewise with the i + 1 blocks j <= i (B rows j, x rows j, acum j and dts j), dy rows
    i, the bf16 H0 tile, and also the C·B tile (16 KiB) and each head's 2·64 + 1 floats of
    pieces of its i + 1 pairs; dC of row block 0 also loads the dH1 tile (shared with dB) and
    stores each head's <dH1, H0> partial (4 B). dH1 and H0 (bf16) are half the fp32 state's
    bytes each. The 8 programs move 851,056 bytes on average: G = 25e6 / 851,056 = 29.4, more
    than the 7 programs between any two of a (segment, group), so B, C, dy, x, acum, dts, dH1
    and H0 are read once. The partials are 16 x 256 bytes for each of the S·g·8 programs:
    S·h·2·Q·4, twice acum's bytes; without dx here the C·B tiles are stored for dx.

    With dx, 4 more programs per (segment, group), one per row block j, loop the group's 16
    heads: B rows j, the dH1 tile, the C·B tiles (i >= j, j) with dy and acum rows i, x, dts
    and (D) dy rows j, storing dx rows j, a BQ·4 ddt partial and a p·4 dD partial per head. The
    12 programs move 1.40 MB on average: G = 17.8, more than the 11 between any two of a
    (segment, group), so of dx's loads only C·B (the prologue's C·B kernel wrote it: C and B
    read once, the tiles written) and D (h·4 bytes) count; dx's rows and partials are
    written."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan import program as scan_kernels
    from fusedops.core.target import compiling_for
    T, S, BQ, Q, h, p, g, n, e, xb, state, seq_state, acum, bc, cb = _production_bytes()
    assert 0.5 * 50e6 / 851_056 > 7
    pieces = S * h * 10 * (2 * BQ + 1) * 4
    read = 2 * bc + 2 * xb + 2 * acum + 4 * S * h + state
    written = pieces + 2 * acum + 2 * bc + 4 * S * h
    with compiling_for("sm_90"):
        _, bwd = _production("scan h128 p64 n128 Q256")
        apart = replace(scan_kernels.TILES["sm_90"][0], DX_IN_DBC=False)
        for config in (apart, None):
            kernels = scan_kernels.backward_program(bwd.problem, config=config).kernels
            costs = [(k.name, k.cost.bytes_read, k.cost.bytes_written) for k in kernels
                     if k.name in ("ssd_cb_kernel", "ssd_dbc_kernel")]
            if config is apart:
                assert costs == [("ssd_dbc_kernel", read, written + cb)]
            else:
                dD = S * h * (Q // BQ) * p * 4
                assert costs == [("ssd_cb_kernel", 2 * bc, cb),
                                 ("ssd_dbc_kernel", read + cb + h * 4,
                                  written + xb + acum + dD)]


def test_every_production_kernel_is_modelled_above_its_floor():
    """Every kernel of every production plan carries a cost; no plan models fewer bytes or
    tensor-core FLOPs than its floor."""
    pytest.importorskip("triton")
    from fusedops.core.cost import total
    for label, calls in samples.production():
        for call in calls:
            plan = call.build("torch")
            kernels = plan.kernel_program("triton").kernels
            assert all(k.cost is not None for k in kernels), label
            modelled, floor = total(k.cost for k in kernels), plan.floor()
            assert modelled.bytes > floor.bytes and modelled.mma_flops >= floor.mma_flops, label
            assert all(k.cost.mma_rows in (0, 64) for k in kernels), label
