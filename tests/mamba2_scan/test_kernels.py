"""Mamba2 chunked scan: the kernels. Tile tables per architecture, autotune candidates, compile-time
specialisation and compiled-out operands, determinism, GPU-only shapes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import fusedops
import fusedops.ops
from fusedops import Mamba2ChunkScanBackward, Mamba2ChunkScanForward, TensorDesc
from fusedops.mamba2_scan import samples
from fusedops.mamba2_scan.info import INFO
from fusedops.opinfo import Case, Tolerance
from fusedops.testing import assert_close

from helpers import DEVICE, GPU_BACKENDS, KERNEL_BACKENDS, dtype_id, requires_cuda

from .support import (KERNEL_TOLERANCE, SCAN_BACKENDS, SEQ_IDX, _descs, _production,
                      _scan_with_status, _seq_case, _seq_run, _with_cu, compare, run,
                      with_options)


SCAN_KERNEL_BACKENDS = [b for b in KERNEL_BACKENDS if b in Mamba2ChunkScanForward.backends]


# -- 2. every backend against the reference and the oracle ---------------------------------------
KERNEL_CASES = [
    ("all-options", torch.float32, {}), ("varlen", torch.float32, {}),
    ("plain", torch.float32, dict(dt_limit=(0.5, 1.5))), ("D-per-channel", torch.float32, {}),
    ("multi-tile", torch.float32, {}), ("odd-dims", torch.float32, {}),
    ("all-options", torch.float16, {}), ("all-options", torch.bfloat16, {}),
    ("varlen", torch.float32, dict(recompute_states=True)),
]


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
@pytest.mark.parametrize("name,dtype,options", KERNEL_CASES,
                         ids=[f"{n}-{dtype_id(d)}{'-' + '-'.join(o) if o else ''}"
                              for n, d, o in KERNEL_CASES])
def test_kernels_match_reference(backend, name, dtype, options):
    case = samples.small(name, dtype, seed=6, device=DEVICE, **options)
    expected = run(with_options(case, recompute_states=False), "torch")
    compare(run(case, backend), expected, KERNEL_TOLERANCE[dtype])


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
def test_kernels_at_dt_limits_and_softplus_threshold(backend):
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=7, device=DEVICE,
                        dt_softplus=False, dt_limit=(0.25, 1.5))
    case.tensors["dt"][0, :6, 0] = torch.tensor([0.25, 1.5, 0.2, 1.6, 0.25, 1.0])
    result = run(case, backend)
    compare(result, run(case, "torch"), KERNEL_TOLERANCE[torch.float32])
    assert [bool(v != 0) for v in result["ddt"][0, :4, 0]] == [True, True, False, False]
    case = samples.make(1, 20, 2, 8, 1, 8, torch.float32, seed=8, device=DEVICE)
    case.tensors["dt"][0, :4, 1] = torch.tensor([20.0, 20.5, 19.5, -30.0])
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_four_row_blocks_per_segment_match_reference(backend, packed):
    """Chunk 256 (four 64-row blocks per segment) with steps of ~0.01, so the decay over a whole
    segment stays near 1: the decay gradient's straddling pairs across every pair of row blocks
    (the d(C·B) kernel's whole-tile sums for the blocks between) count in ddt and dA."""
    case = samples.make(1, 300, 2, 8, 1, 8, torch.float32, seed=12, device=DEVICE, D="h",
                        initial_states=True, dfinal=True, chunk=256, dt_softplus=False,
                        lengths=[270, 30] if packed else None)
    case.tensors["dt"] = 0.02 * torch.rand(1, 300, 2, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_backward_bitwise_reproducible(backend):
    case = samples.small("varlen", torch.float32, seed=10, device=DEVICE)
    first, second = run(case, backend), run(case, backend)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_triton_programs_compile_absent_operands_out():
    """Without D, z, dt_bias, initial states or packed sequences no kernel takes a pointer for
    them (they are constexpr None, never another tensor)."""
    pytest.importorskip("triton")
    descs = _descs(1, 64, 4, 16, 2, 16, z=False)
    descs.update(D=None, dt_bias=None)
    plans = (Mamba2ChunkScanForward(**descs, chunk_size=32, backend="torch"),
             Mamba2ChunkScanBackward(**descs, dy=descs["x"], chunk_size=32, backend="torch"))
    optional = {"D_ptr", "z_ptr", "bias_ptr", "h0_ptr", "cu_ptr", "off_ptr", "ypre_ptr",
                "dfinal_ptr", "dh0_ptr", "dD_part_ptr", "dbias_part_ptr", "dbias_ptr", "dD_ptr",
                "cu_out_ptr", "status_ptr", "runs_ptr", "entering_ptr", "seq_idx_ptr",
                "dypre_ptr", "dz_ptr"}
    for plan in plans:
        program = plan.kernel_program("triton")
        for kernel in program.kernels:
            assert not optional & set(kernel.runtime_arg_names()), kernel.name
        assert not any(k.constexpr("GATE") for k in program.kernels
                       if k.name == "ssd_chunk_states_bwd_kernel")


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
def test_kernels_read_only_the_sanitised_offsets(backend):
    """Without a status word the reporting is compiled out, never the sanitising: the outputs
    equal those with one, and equal the torch backend's."""
    case = _with_cu(samples.small("varlen", torch.float32, seed=32, device=DEVICE),
                    [0, 50, 5, 21, 22, 2**31 - 1])
    with_status, _, _ = _scan_with_status(case, backend)
    without = run(case, backend)
    for name, value in without.items():
        assert torch.equal(value, with_status[name]), name
    compare(without, run(case, "torch"), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", SCAN_KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind", list(SEQ_IDX))
def test_kernels_with_seq_idx_match_oracle(backend, dtype, kind):
    case = _seq_case(dtype, kind, seed=44)
    compare(_seq_run(case, backend), INFO.oracle(case), INFO.tolerance("y", dtype))


def test_tile_table_follows_the_target_arch():
    """One entry per architecture, each with its reason; the programs take the target's entry
    (or ``config=``), and the autotune candidates start with it."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_scan import program as kernels
    from fusedops.backends.triton.mamba2_scan import tiles as kernels_tiles
    from fusedops.core.target import compiling_for
    fwd, bwd = _production("scan h128 p64 n128 Q256")
    assert set(kernels.TILES) == {"sm_80", "sm_90", "sm_100"}
    for arch, (entry, why) in kernels.TILES.items():
        assert why
        with compiling_for(arch):
            assert kernels.tiles(fwd.problem) == kernels.tiles(fwd.problem, entry)
            assert kernels.forward_candidates(fwd.problem)[0] == entry
            assert kernels.backward_candidates(bwd.problem)[0] == entry
    other = kernels.ScanTiles(BQ=32, BP=32, BN=128, BLOCK_H=8, FUSED=False)
    t = kernels.tiles(fwd.problem, other)
    assert (t.BQ, t.BP, t.BN, t.BLOCK_H, t.FUSED) == (32, 32, 128, 8, False)
    names = [k.name for k in kernels.forward_program(fwd.problem, config=other).kernels]
    assert names == ["ssd_dt_cumsum_kernel", "ssd_cb_kernel", "ssd_chunk_states_kernel",
                     "ssd_chunk_scan_fwd_kernel"]
    scan = kernels.forward_program(fwd.problem, config=other).kernels[-1]
    assert scan.grid == (2 * 8 * 64 * 128, 1, 1)      # p / BP x Q / BQ programs per (segment, head)
    fused = replace(other, FUSED=True, FUSED_WARPS=4, FUSED_STAGES=2)
    walk = kernels.forward_program(fwd.problem, config=fused).kernels[-1]
    assert walk.name == "ssd_fused_fwd_kernel"
    assert walk.grid == (2 * 2 * 128, 1, 1)            # p / BP programs per (sequence, head)
    assert (walk.num_warps, walk.num_stages) == (4, 2)
    with compiling_for("sm_90"):
        (dbc,) = [k for k in kernels.backward_program(bwd.problem).kernels
                  if k.name == "ssd_dbc_kernel"]
    # dB and dC of every row block (4) and state tile (the whole state: 1), then dx of every
    # row block and head-dim tile (1), per segment·group
    assert dbc.grid == ((2 * 4 * 1 + 4 * 1) * 64 * 8, 1, 1)
    names = [k.name for k in kernels.backward_program(bwd.problem).kernels]
    assert "ssd_cb_kernel" in names and "ssd_chunk_scan_bwd_dx_kernel" not in names
    apart = replace(kernels.TILES["sm_90"][0], DX_IN_DBC=False)
    names = [k.name for k in kernels.backward_program(bwd.problem, config=apart).kernels]
    assert "ssd_cb_kernel" not in names and "ssd_chunk_scan_bwd_dx_kernel" in names
    wide = samples.make(1, 20, 2, 64, 1, kernels_tiles.FUSED_MAX_STATE + 1, device="cpu")
    wide_plan = Mamba2ChunkScanForward(**{k: wide.tensors[k] for k in samples._FORWARD_TENSORS},
                                       **wide.options, backend="torch")
    assert not kernels.tiles(wide_plan.problem).FUSED      # the walk would hold 256 state columns
    wide_candidates = kernels.forward_candidates(wide_plan.problem)
    assert len({kernels.tiles(wide_plan.problem, c) for c in wide_candidates}) \
        == len(wide_candidates) == 4                        # the two pipelines' entries coincide


SPLIT_COMPILE = """
import json
from dataclasses import replace
from fusedops.backends.triton.mamba2_scan import program as kernels
from fusedops.core.target import compiling_for
from fusedops.kernel_report.compiled import compile_triton
from fusedops.mamba2_scan import samples
(calls,) = [c for label, c in samples.production() if label == "scan h128 p64 n128 Q256"]
fwd = calls[0].build("torch")
for arch in ("sm_90a", "sm_100a"):
    with compiling_for(arch):
        split = replace(kernels.TILES[arch.removesuffix("a")][0], FUSED=False)
        specs = kernels.forward_program(fwd.problem, config=split).kernels[-2:]
    for spec in specs:
        compiled, _ = compile_triton(spec, arch)
        print(json.dumps([arch, spec.name, compiled.spill_bytes]))
"""


def test_split_forward_kernels_compile_without_spills():
    """The split forward's kernels (``FUSED=False``: an autotune candidate, and the states kernel
    the backward runs with recompute_states) compile for sm_90a and sm_100a at the production
    shape without spilling (in a process without the interpreter; the default plans' kernels
    are the kernel report's)."""
    pytest.importorskip("triton")
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SPLIT_COMPILE], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [name for _, name, _ in rows] == ["ssd_chunk_states_kernel",
                                             "ssd_chunk_scan_fwd_kernel"] * 2
    assert all(spill == 0 for _, _, spill in rows), rows


def test_tuning_tensors_are_valid_packed_offsets():
    """Timing a packed plan's candidates uses valid cu_seqlens: an even split of the tokens."""
    fwd, bwd = _production("scan varlen Q256")
    for plan in (fwd, bwd):
        cu = plan._tuning_tensors()["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.shape == (65,)
        assert cu[0] == 0 and cu[-1] == 8192 and bool((cu.diff() == 128).all())
        assert plan._tuning_binding()["cu_seqlens"] is not None
    plain, _ = _production("scan h128 p64 n128 Q256")
    assert plain._tuning_tensors() == {}


@pytest.mark.parametrize("backend", [b for b in SCAN_KERNEL_BACKENDS if b == "triton"])
def test_every_autotune_candidate_computes_the_scan(backend):
    """Each candidate's forward and backward programs (the other forward pipeline, dx in its own
    launch, another state tile, head-dim tile) give the reference's results; with z, so the
    backward walk's gate runs on 2 state tiles (only the first writes dz and dy·silu(z)) and,
    at BP = 32, 2 head-dim tiles. Against the float64 reference of the same inputs. dA sums
    dt_k·da_k over the tokens, terms that cancel: the kernels' decay weights
    exp(Acum_i - Acum_j) carry the rounding of the fp32 cumulative sums (the torch path forms
    each difference as its own sum), and the cancellation magnifies it to 0.5-2e-5 of dA here
    (1e-4 at other seeds; the torch path's fp32 error is 0.7-10e-6), so dA gets DA_FP32. So does
    ddt_bias, the sum of ddt over the tokens: its terms cancel too, magnifying ddt's 1.5e-6 to
    1.2-1.7e-5 here (2.1e-5 on another CPU)."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    case = samples.make(1, 70, 2, 64, 1, 128, torch.float32, seed=3, device=DEVICE, chunk=64,
                        D="h", z=True, dt_bias=True, initial_states=True, dfinal=True)
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in case.tensors.items()}
    expected = run(Case(case.label, wide, case.options), "torch")
    t = case.tensors
    fwd_t = {k: t[k] for k in samples._FORWARD_TENSORS}
    probe = Mamba2ChunkScanForward(**fwd_t, **case.options, backend=backend)
    configs = kernels.forward_candidates(probe.problem)
    assert len({kernels.tiles(probe.problem, c) for c in configs}) == len(configs) == 5
    for config in configs:
        fwd = Mamba2ChunkScanForward(**fwd_t, **case.options, backend=backend)
        fwd._program = kernels.forward_program(fwd.problem, config=config)
        outputs = fwd.compile().allocate_outputs()
        fwd.execute(**fwd_t, **outputs, workspace=fwd.allocate_workspace())
        bwd = Mamba2ChunkScanBackward(**fwd_t, dy=t["dy"], dfinal_states=t["dfinal_states"],
                                      **case.options, backend=backend)
        bwd._program = kernels.backward_program(bwd.problem, config=config)
        grads = bwd.compile().allocate_outputs()
        bwd.execute(**fwd_t, dy=t["dy"], saved=outputs["saved"],
                    dfinal_states=t["dfinal_states"], **grads, workspace=bwd.allocate_workspace())
        names = [name for name in expected if name in outputs or name in grads]
        compare(dict(outputs, **grads), expected, KERNEL_TOLERANCE[torch.float32],
                [name for name in names if name not in ("dA", "ddt_bias")])
        for name in ("dA", "ddt_bias"):
            assert_close(grads[name], expected[name], DA_FP32, name)


DA_FP32 = Tolerance(2e-4, 2e-4, "fp32: dA and ddt_bias sum terms that cancel (see the test above)")


@pytest.mark.parametrize("backend", [b for b in SCAN_KERNEL_BACKENDS if b == "triton"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("dx_in_dbc", [False, True], ids=["dx-apart", "dx-in-dbc"])
def test_dbc_kernel_over_several_state_tiles(backend, packed, dx_in_dbc):
    """The dB/dC kernel with the state split into DBC_NNB = 2 tiles: each tile's programs form
    the d(C·B) tiles again, only the first writes C·B (without DX_IN_DBC) and the straddling
    pieces, and every tile writes its U, W' and <dH1, H0> partials, which ddt and dA sum in
    tile order (n = 32 in 16-wide tiles, 2 row blocks of 16 per segment; packed: sequences
    ending inside row blocks and an empty one, so dB/dC programs past a segment's end return
    while dx's write their zero partials). With DX_IN_DBC the launch's dx programs (each
    looping the group's 2 heads; p = 32 in 16-wide head-dim tiles, two programs a row block)
    read the C·B the prologue wrote."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    case = samples.make(1, 70, 2, 32, 1, 32, torch.float32, seed=5, device=DEVICE, chunk=32,
                        D="h", z=True, dt_bias=True, initial_states=not packed,
                        dfinal=not packed, lengths=[21, 0, 49] if packed else None)
    wide = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in case.tensors.items()}
    expected = run(Case(case.label, wide, case.options), "torch")
    t = case.tensors
    fwd_t = {k: t[k] for k in samples._FORWARD_TENSORS if k in t}
    config = kernels.ScanTiles(BQ=16, BP=16, BN=16, BLOCK_H=2, DBC_BN=16, DX_IN_DBC=dx_in_dbc)
    fwd = Mamba2ChunkScanForward(**fwd_t, **case.options, backend=backend)
    fwd._program = kernels.forward_program(fwd.problem, config=config)
    outputs = fwd.compile().allocate_outputs()
    fwd.execute(**fwd_t, **outputs, workspace=fwd.allocate_workspace())
    extra = {} if packed else dict(dfinal_states=t["dfinal_states"])
    bwd = Mamba2ChunkScanBackward(**fwd_t, dy=t["dy"], **extra, **case.options, backend=backend)
    bwd._program = kernels.backward_program(bwd.problem, config=config)
    assert kernels.tiles(bwd.problem, config).DBC_BN == 16
    launches = [k.name for k in bwd._program.kernels]
    assert ("ssd_chunk_scan_bwd_dx_kernel" in launches) != dx_in_dbc
    assert ("ssd_cb_kernel" in launches) == dx_in_dbc
    grads = bwd.compile().allocate_outputs()
    bwd.execute(**fwd_t, dy=t["dy"], saved=outputs["saved"], **extra, **grads,
                workspace=bwd.allocate_workspace())
    names = [name for name in expected if name in grads]
    assert {"dB", "dC", "ddt", "dx"} <= set(names)
    compare(grads, expected, KERNEL_TOLERANCE[torch.float32],
            [name for name in names if name != "dA"])
    assert_close(grads["dA"], expected["dA"], DA_FP32, "dA")


def _forward_with(case, config, extra=()):
    """y, final_states, the saved buffer and (without cu_seqlens) segment_states of the Triton
    forward program built with tile-table entry ``config``; ``extra``: more tensor names."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    t = case.tensors
    fwd_t = {k: t[k] for k in (*samples._FORWARD_TENSORS, *extra)}
    descs = {}
    if t.get("cu_seqlens") is None:
        b, l, h, p = t["x"].shape
        segments = b * -(-l // case.options["chunk_size"])
        descs["segment_states"] = TensorDesc((segments, h, p, t["B"].shape[-1]), torch.float32,
                                             device=t["x"].device)
    fwd = Mamba2ChunkScanForward(**fwd_t, **descs, **case.options, backend="triton")
    fwd._program = kernels.forward_program(fwd.problem, config=config)
    outputs = fwd.compile().allocate_outputs()
    fwd.execute(**fwd_t, **outputs, workspace=fwd.allocate_workspace())
    return outputs


SPLIT_CASES = {
    "all-options": lambda: samples.small("all-options", torch.float32, seed=6, device=DEVICE),
    "varlen": lambda: samples.small("varlen", torch.float32, seed=6, device=DEVICE),
    "multi-tile": lambda: samples.small("multi-tile", torch.float32, seed=6, device=DEVICE),
    "odd-dims": lambda: samples.small("odd-dims", torch.float32, seed=6, device=DEVICE),
    "bf16": lambda: samples.small("all-options", torch.bfloat16, seed=6, device=DEVICE),
    "seq-idx": lambda: _seq_case(torch.float32, "batch", seed=44),
}


@pytest.mark.skipif("triton" not in SCAN_KERNEL_BACKENDS, reason="the Triton backend is absent")
@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_fused_and_split_forwards_agree(name):
    """The fused walk (``FUSED=True``) and the states + output kernels (``FUSED=False``) give
    the same y, final states and segment states (without packed sequences) within rounding, and
    both match the torch backend. The fused walk rounds its register state to x's dtype for the
    state term as the split output kernel reads the stored copy, and sums the state term in one
    product over n (the split kernel in BN-wide steps): fp32 results agree to ~1e-6."""
    from fusedops.backends.triton.mamba2_scan import program as kernels
    case = SPLIT_CASES[name]()
    extra = ("seq_idx",) if "seq_idx" in case.tensors else ()
    base = kernels.TILES["sm_90"][0]
    fused, split = (_forward_with(case, replace(base, FUSED=flag), extra)
                    for flag in (True, False))
    assert set(fused) == set(split)
    tolerance = KERNEL_TOLERANCE[case.tensors["x"].dtype]
    compare(fused, split, tolerance, ["y", "final_states", "segment_states"])
    reference = (_seq_run(case, "torch") if extra else run(case, "torch"))
    compare(fused, reference, tolerance, ["y", "final_states"])


# -- 6. GPU checks -------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS if b == "triton"])
@pytest.mark.parametrize("chunk", [128, 256])
def test_gpu_nemotron_shape_bf16(backend, chunk):
    """h=128 p=64 n=128 g=8 in bf16 against the fp32 torch reference."""
    case = samples.make(2, 2048, 128, 64, 8, 128, torch.bfloat16, seed=20, device=DEVICE,
                        chunk=chunk, **samples.ALL_OPTIONS)
    compare(run(case, backend), run(case, "torch"), KERNEL_TOLERANCE[torch.bfloat16])


@requires_cuda
@pytest.mark.gpu
def test_gpu_offsets_beyond_2_31_elements():
    """b·l·h·p > 2^31: the second row of a large batch equals the same row run alone."""
    h, p, g, n = 128, 64, 8, 64
    l = 2**31 // (h * p) // 2 + 256
    t = samples.make(2, l, h, p, g, n, torch.bfloat16, seed=23, device=DEVICE).tensors
    core = {k: t[k] for k in ("x", "dt", "A", "B", "C")}
    del t
    fwd = Mamba2ChunkScanForward(**core, chunk_size=256, dt_softplus=True).compile()
    y = torch.empty_like(core["x"])
    fwd.execute(*core.values(), y, torch.empty(2, h, p, n, device=DEVICE), fwd.allocate_saved(),
                workspace=fwd.allocate_workspace())
    row = {k: v[1:].contiguous() if k != "A" else v for k, v in core.items()}
    alone = fusedops.mamba2_chunk_scan_forward(*row.values(), 256, dt_softplus=True)["y"]
    assert torch.equal(y[1:], alone)
