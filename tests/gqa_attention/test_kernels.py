"""GQA attention: the kernels. Tile tables per architecture, autotune candidates, compile-time
specialisation and compiled-out operands, determinism, GPU-only shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusedops
from fusedops import GQAAttentionBackward, GQAAttentionDecode, GQAAttentionForward
from fusedops.gqa_attention import AttentionProblem, DecodeAttentionProblem
from fusedops.gqa_attention.info import KERNEL_TOLERANCE
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.testing import assert_close

from helpers import requires_cuda

from .support import BACKENDS, CPU, _problem, compare, packed, qkv, run


KERNELS = [b for b in BACKENDS if b != "torch"]


# -- 3. kernels against the reference ------------------------------------------------------------
CASES = [
    dict(shape=(2, 37, 45, 4, 2, 24), causal=False),
    dict(shape=(2, 37, 45, 4, 2, 24), causal=True),
    dict(shape=(1, 50, 30, 4, 1, 32), causal=True),
    dict(shape=(1, 40, 40, 2, 2, 16), window_size=(5, 3)),
    dict(shape=(1, 70, 70, 2, 1, 64), causal=True, window_size=(20, -1)),
    dict(shape=(1, 20, 20, 4, 2, 128), causal=True),
]


# sm_80's tables read every tile through pointers and masks, sm_90's and sm_100's through tensor
# descriptors of each sequence (TMA); sm_90's and sm_100's d = 256 dk/dv kernels hold dk and dv
# transposed (the head dim as M)
ARCHS = ("sm_80", "sm_90", "sm_100")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['shape']}-{c.get('causal', False)}-{c.get('window_size', '')}")
def test_kernels_match_reference(backend, case, arch):
    from fusedops.core.target import compiling_for
    q, k, v, do = qkv(*case["shape"], seed=4)
    opts = {k_: v_ for k_, v_ in case.items() if k_ != "shape"}
    with compiling_for(arch):
        got = run(backend, q, k, v, do, **opts)
    compare(got, run("torch", q, k, v, do, **opts), KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", KERNELS)
def test_head_dim_256_on_every_table(backend, arch):
    """d = 256 through each architecture's tiles: on sm_90 and sm_100 the dk/dv kernel
    accumulates dkᵀ and dvᵀ (the head dim as every accumulating product's M), packed and dense."""
    from fusedops.backends.triton.gqa_attention import program as kernels
    from fusedops.core.target import compiling_for
    q, k, v, do = qkv(1, 70, 70, 2, 1, 256, seed=17)
    (pq, pk, pv, pdo), opts = packed([37, 1, 45], [40, 3, 45], 2, 1, 256, seed=18)
    with compiling_for(arch):
        lse = torch.zeros(1, 2, 70)
        problem = GQAAttentionBackward(q, k, v, q, lse, do, causal=True, backend=backend).problem
        assert kernels.backward_tiles(problem).features_m == (arch != "sm_80")
        dense = run(backend, q, k, v, do, causal=True)
        varlen = run(backend, pq, pk, pv, pdo, causal=True, **opts)
    compare(dense, run("torch", q, k, v, do, causal=True), KERNEL_TOLERANCE[torch.float32])
    compare(varlen, run("torch", pq, pk, pv, pdo, causal=True, **opts),
            KERNEL_TOLERANCE[torch.float32])


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_kernels_low_precision(backend, dtype):
    q, k, v, do = qkv(2, 33, 33, 4, 2, 64, dtype, seed=5)
    compare(run(backend, q, k, v, do, causal=True), run("torch", q, k, v, do, causal=True), KERNEL_TOLERANCE[dtype])


# key blocks of 32 against query blocks of 16: per key block, the diagonal's (or a window edge's)
# blocks masked, the blocks that see all 32 keys unmasked, the last partial query block masked
# (offsets of -2 and a right edge of 14 put the first unmasked block one row past a multiple of
# 16, where an off-by-one in the rounding would unmask a block that needs the mask)
EDGE_CASES = [
    dict(sq=150, sk=150, causal=True),
    dict(sq=150, sk=148, causal=True),
    dict(sq=150, sk=120, causal=True),                      # bottom-right: query i sees j <= i - 30
    dict(sq=110, sk=150, causal=True, window_size=(70, -1)),
    dict(sq=130, sk=130, causal=False, window_size=(60, 14)),
]


@pytest.mark.parametrize("backend", KERNELS)
def test_descriptor_scratch_needs_a_128_byte_aligned_workspace(backend, monkeypatch):
    """The TMA kernels keep their tensor descriptors in the workspace (``global_scratch``), which
    Triton aligns to 128 bytes: on a GPU (or the PTX emulator) a workspace 16 bytes off is
    refused, naming the alignment; without the emulator the CPU interpreter keeps descriptors in
    host memory: 16 bytes, as any buffer."""
    q, k, v, _ = qkv(1, 40, 40, 2, 1, 32, seed=3)
    plan = GQAAttentionForward(q, k, v, causal=True, backend=backend).compile()
    assert plan.workspace_size > 0
    assert plan._program.workspace_alignment(torch.device("cuda")) == 128
    monkeypatch.setenv("FUSEDOPS_EMULATE", "1")
    assert plan._program.workspace_alignment(torch.device("cpu")) == 128
    monkeypatch.delenv("FUSEDOPS_EMULATE")
    assert plan._program.workspace_alignment(torch.device("cpu")) == 16
    if q.device.type != "cuda":
        return
    raw = torch.empty(plan.workspace_size + 256, dtype=torch.uint8, device=q.device)
    aligned = raw[-raw.data_ptr() % 128:]
    outs = plan.allocate_outputs()
    plan.execute(q, k, v, **outs, workspace=aligned[:plan.workspace_size])
    with pytest.raises(ValidationError, match=r"workspace: expected a data pointer aligned to 128"):
        plan.execute(q, k, v, **outs, workspace=aligned[16:16 + plan.workspace_size])


@pytest.mark.parametrize("features_m", [False, True], ids=["keys-as-M", "features-as-M"])
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_dkdv_kernel_masks_exactly_the_edge_blocks(backend, case, features_m):
    """The dk/dv kernel skips the mask arithmetic on the query blocks that see every key of its
    key block (``unmasked_queries``) and walks the blocks from the last one down: with small
    tiles each mask shape has such blocks between masked ones, and every gradient matches the
    reference, with dk and dv held either way round."""
    from fusedops.backends.triton.gqa_attention import program as kernels
    opts = {k_: v_ for k_, v_ in case.items() if k_ not in ("sq", "sk")}
    q, k, v, do = qkv(2, case["sq"], case["sk"], 4, 2, 32, seed=13)
    expected = run("torch", q, k, v, do, **opts)
    plan = GQAAttentionBackward(q, k, v, expected["o"], expected["lse"], do, backend=backend, **opts)
    tiles = kernels.backward_tiles(plan.problem)
    config = kernels.BackwardTiles(kernels.Tiles(16, 32, 4), tiles.dq, features_m)
    plan._program, plan._launch = kernels.backward_program(plan.problem, config=config), None
    got = plan.compile().execute(q, k, v, expected["o"], expected["lse"], do,
                                 **plan.allocate_outputs(), workspace=plan.allocate_workspace())
    for name in ("dq", "dk", "dv"):
        assert_close(got[name], expected[name], KERNEL_TOLERANCE[torch.float32], name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_bitwise_reproducible(backend):
    q, k, v, do = qkv(2, 40, 40, 8, 2, 32, seed=7)
    first, second = run(backend, q, k, v, do, causal=True), run(backend, q, k, v, do, causal=True)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def test_kernel_specialisation_ignores_batch_and_compiles_out_absent_operands():
    """Compile-cache keys hold plan-time values: another batch reuses the kernels. Without
    packing, paging or an FP8 cache the optional pointers are constexpr None."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.gqa_attention import program as kernels
    a = AttentionProblem(torch.bfloat16, 2, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, False, 1024, 1024, CPU)
    b = AttentionProblem(torch.bfloat16, 7, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, False, 3584, 3584, CPU)
    assert kernels.forward_spec(a) == kernels.forward_spec(b)
    assert kernels.backward_specs(a) == kernels.backward_specs(b)
    spec = kernels.forward_spec(a)
    assert spec.constexpr("cu_seqlens_q_ptr") is None and spec.constexpr("cu_seqlens_k_ptr") is None
    d = DecodeAttentionProblem(torch.bfloat16, torch.bfloat16, 2, 1, 8, 2, 64, False, 64, 1, 64,
                               0.125, False, 1, CPU)
    for spec in kernels.decode_specs(d).values():
        absent = [n for n in ("block_table_ptr", "k_scale_ptr", "v_scale_ptr", "status_ptr")
                  if n in dict(spec.signature)]
        assert all(spec.constexpr(n) is None for n in absent), spec.name
    # packed: the sanitising stage and the kernels do not specialise on nseq or the tokens
    p2 = AttentionProblem(torch.bfloat16, 2, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, True, 700, 700, CPU, True)
    p7 = AttentionProblem(torch.bfloat16, 7, 512, 512, 8, 2, 64, True, (-1, -1), 0.125, True, 3000, 3000, CPU, True)
    assert kernels.sanitise_spec(p2) == kernels.sanitise_spec(p7)
    assert kernels.forward_spec(p2) == kernels.forward_spec(p7)
    assert kernels.backward_specs(p2) == kernels.backward_specs(p7)
    assert kernels.sanitise_spec(p2).constexpr("HAS_STATUS") is True


def test_default_num_splits_follow_the_sm_count_batch_heads_and_capacity():
    """The fewest key ranges (each at least 512 positions, at most 32) whose b·h_kv·splits
    programs fill their waves to within 90% of the best count's; the plan takes the SM count of
    its target family when built on the CPU."""
    from fusedops.core.machines import wave_efficiency
    from fusedops.gqa_attention.contract import default_num_splits
    from fusedops.core.target import compiling_for, multiprocessors
    assert [default_num_splits(8192, p, 132)
            for p in (1, 8, 32, 64, 128, 512)] == [15, 15, 4, 2, 1, 1]
    assert [default_num_splits(8192, p, 148) for p in (8, 64, 512, 1024)] == [15, 9, 2, 1]
    assert default_num_splits(300, 8, 132) == 1 and default_num_splits(512, 1, 132) == 1
    assert default_num_splits(65536, 1, 132) == 29          # 32 at most: 29 is within 90%
    assert wave_efficiency(512, 132) == 512 / 132 / 4 and wave_efficiency(264, 132) == 1.0
    def desc(*shape, dtype=torch.bfloat16):
        return fusedops.TensorDesc(shape, dtype, device="cpu")
    for (b, hkv), arch, splits in (((1, 8), "sm_90", 15), ((8, 8), "sm_90", 2),
                                   ((64, 8), "sm_90", 1), ((8, 8), "sm_100", 9)):
        with compiling_for(arch):
            assert multiprocessors(torch.device("cpu")) == {"sm_90": 132, "sm_100": 148}[arch]
            plan = GQAAttentionDecode(q=desc(b, 1, 4 * hkv, 128), k_new=desc(b, 1, hkv, 128),
                                      v_new=desc(b, 1, hkv, 128), k_cache=desc(b, 8192, hkv, 128),
                                      v_cache=desc(b, 8192, hkv, 128),
                                      cache_seqlens=desc(b, dtype=torch.int32), backend="torch")
        assert plan.problem.num_splits == splits, (b, hkv, arch)


def test_triton_refuses_float64():
    if "triton" not in BACKENDS:
        pytest.skip("triton does not run here")
    q, k, v, _ = qkv(1, 4, 4, 2, 1, 16, torch.float64)
    with pytest.raises(UnsupportedError, match=r"triton: the Triton attention kernels take bf16/fp16/fp32"):
        GQAAttentionForward(q, k, v, backend="triton")


# -- 6. GPU --------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_production_shapes_against_sdpa(hkv, causal):
    q, k, v, do = qkv(2, 2048, 2048, 32, hkv, 128, torch.bfloat16, seed=20)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=causal,
                                       enable_gqa=True).transpose(1, 2)
    grads = torch.autograd.grad(o, leaves, do)
    r = run("triton", q, k, v, do, causal=causal)
    tol = KERNEL_TOLERANCE[torch.bfloat16]
    compare({k_: r[k_] for k_ in ("o", "dq", "dk", "dv")}, dict(o=o, dq=grads[0], dk=grads[1], dv=grads[2]), tol)


def test_tile_tables_follow_the_target_arch_and_offer_candidates():
    from fusedops.backends.triton.gqa_attention import program as kernels
    from fusedops.backends.triton.gqa_attention import tiles as T
    from fusedops.core.target import compiling_for
    for d in (64, 128, 256):
        p = _problem(s=4096, d=d, causal=False)
        dec = DecodeAttentionProblem(torch.bfloat16, torch.bfloat16, 2, 1, 8, 2, d, True, 64, 4, 256,
                                     0.125, False, 2, CPU, pages=8)
        for arch in ("sm_80", "sm_90", "sm_100"):
            (fwd, why_f), (bwd, why_b), (dt, why_d) = (T.FORWARD[arch][max(64, d)],
                                                        T.BACKWARD[arch][max(64, d)], T.DECODE[arch])
            assert why_f and why_b and why_d
            with compiling_for(arch):
                assert T.forward_tiles(p) == fwd and T.backward_tiles(p) == bwd
                assert kernels.forward_candidates(p)[0] == fwd
                assert kernels.backward_candidates(p)[0] == bwd
                assert kernels.decode_candidates(dec)[0] == dt
                spec = kernels.forward_spec(p)
                assert (spec.constexpr("BM"), spec.num_warps, spec.maxnreg) == (fwd.bm, fwd.warps,
                                                                                 fwd.maxnreg)
                assert spec.cost is not None and spec.cost.mma_rows == fwd.bm
                for config in kernels.forward_candidates(p)[1:]:
                    assert kernels.forward_program(p, config=config).kernels[0].constexpr("BM") == config.bm
                for config in kernels.backward_candidates(p):
                    specs = kernels.backward_specs(p, config)
                    assert specs["dq"].constexpr("BM") == config.dq.bm
                    assert all(s.cost is not None for s in specs.values())
                assert all(s.cost is not None for s in kernels.decode_specs(dec).values())
    small = _problem(s=40, d=64)                  # tiles cut to the longest sequence
    assert T.forward_tiles(small).bm == 64 and T.forward_tiles(_problem(s=10)).bm == 16


def test_tuning_tensors_are_valid_index_data_at_the_modelled_lengths():
    """Autotune times candidates on the index data the cost models assume: packed offsets of the
    longest sequences the plan allows, every decode row at the fullest context, a block table
    within the pool; the host checks accept them."""
    from fusedops.gqa_attention.contract import sequence_lengths
    from fusedops.gqa_attention.samples import production
    from fusedops.core.desc import TensorDesc
    plans = {label: [c.build("torch") for c in calls] for label, calls in production()}
    fwd = plans["attn packed hkv8 d128 causal status"][0]
    t = fwd._tuning_tensors()
    assert t["cu_seqlens_q"].tolist() == [0, 4096, 8192, 12288, 16384, 16384, 16384, 16384, 16384]
    assert sequence_lengths(fwd.problem)[:5] == [(4096, 4096)] * 4 + [(0, 0)]
    fwd.check_index_values(**t)
    dec = plans["decode T4 paged fp8"][0]
    t = dec._tuning_tensors()
    assert t["cache_seqlens"].tolist() == [8192 - 4] * 64 and t["k_scale"].shape == (8,)
    dec.check_index_values(cache_seqlens=t["cache_seqlens"], block_table=t["block_table"])
    q = TensorDesc((2, 8, 4, 16), torch.float32, device=CPU)
    dense = GQAAttentionForward(q, TensorDesc((2, 8, 2, 16), torch.float32, device=CPU),
                                TensorDesc((2, 8, 2, 16), torch.float32, device=CPU))
    assert dense._tuning_tensors() == {}


@pytest.mark.skipif(not KERNELS, reason="needs the triton backend")
def test_every_backward_candidate_computes_the_same_gradients():
    from fusedops.backends.triton.gqa_attention import program as kernels
    q, k, v, do = qkv(1, 70, 70, 4, 2, 32, seed=41)
    expected = run("triton", q, k, v, do, causal=True)
    plan = GQAAttentionBackward(q, k, v, expected["o"], expected["lse"], do, causal=True,
                                backend="triton")
    for config in kernels.backward_candidates(plan.problem)[1:]:
        plan._program, plan._launch = kernels.backward_program(plan.problem, config=config), None
        got = plan.compile().execute(q, k, v, expected["o"], expected["lse"], do,
                                     **plan.allocate_outputs(), workspace=plan.allocate_workspace())
        for name in ("dq", "dk", "dv"):
            assert_close(got[name], expected[name], KERNEL_TOLERANCE[torch.float32], name)
