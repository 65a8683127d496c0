"""Routed ReLU2 MoE: the kernels. Tile tables per architecture, autotune candidates, compile-time
specialisation and compiled-out operands, determinism, GPU-only shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fusedops
from fusedops import MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward, TensorDesc
from fusedops.relu2_moe.info import EXPERT_TOLERANCE
from fusedops.opinfo import Tolerance
from fusedops.testing import assert_close

from helpers import DEVICE, requires_cuda

from .support import KERNELS, compare, experts_case, run_experts


GPU_KERNELS = KERNELS if torch.cuda.is_available() else []


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_match_the_torch_backend(backend, dtype):
    # same rounding points; only the order of fp32 sums differs
    case = experts_case(45, 64, 7, 80, 3, shared=48, dtype=dtype, seed=5)
    expected = run_experts("torch", case)
    tol = {torch.float32: Tolerance(2e-6, 2e-5, "fp32 sums in another order"),
           torch.float16: Tolerance(1e-4, 1e-3, "an fp16 rounding of u, a or out that flips"),
           torch.bfloat16: Tolerance(8e-4, 8e-3, "a bf16 rounding of u, a or out that flips")}[dtype]
    compare(run_experts(backend, case), expected, tol)


@pytest.mark.parametrize("backend", KERNELS)
def test_device_dispatch_layout(backend):
    """counts, tile-padded offsets and each expert's assignments in order, read from saved."""
    case = experts_case(40, 16, 7, 24, 3, seed=17)
    case["topk_ids"][1, 0] = -1
    plan = ReLU2MoEForward(*(case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")),
                           backend=backend).compile()
    saved = plan.allocate_saved().fill_(0xFF)
    out = torch.empty_like(case["x"])
    plan.execute(*(case[n] for n in ("x", "w_up", "w_down", "topk_ids", "topk_weights")), out, saved,
                 workspace=plan.allocate_workspace())
    layout = plan.program.saved
    tile = next(s.kernel for s in plan.program.stages if s.name == "moe_offsets_kernel").constexpr("TILE")
    counts, offsets, rows = (layout.carve(saved, n).tensor().cpu() for n in ("counts", "offsets", "sorted"))
    flat = case["topk_ids"].reshape(-1).cpu()
    expected_counts = torch.bincount(flat[flat >= 0], minlength=7)
    assert torch.equal(counts, expected_counts.int())
    padded = (expected_counts + tile - 1) // tile * tile
    assert torch.equal(offsets, torch.cat([torch.zeros(1), padded.cumsum(0)]).int())
    for e in range(7):
        start = int(offsets[e])
        assert rows[start:start + int(counts[e])].tolist() == (flat == e).nonzero().flatten().tolist()
    assert plan.saved_size == layout.size


@pytest.mark.parametrize("shared,is_inference", [(0, True), (8, False)])
def test_absent_operands_are_compiled_out(shared, is_inference):
    """The Triton programs pass no placeholder for an operand a launch does not have: the shared
    expert's buffers without one, the dispatch of the dense shared GEMMs, the routing weights
    of unweighted GEMMs, u outside the dgrad-down epilogue, the rows and ids outside a
    combining epilogue are constexpr None; every tensor a stage binds is one the plan declares
    (or a piece of its workspace or saved buffer). With a shared expert its down GEMM sums the
    rows (no combine kernel); without one the combine kernel does."""
    pytest.importorskip("triton")
    case = experts_case(8, 16, 4, 24, 2, shared=shared, device="cpu")
    descs = {n: TensorDesc.from_tensor(v) for n, v in case.items()}
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared_descs = {n: descs.get(n) for n in ("shared_w_up", "shared_w_down")}
    plans = [ReLU2MoEForward(*(descs[n] for n in names), **shared_descs, is_inference=is_inference,
                             backend="torch"),
             ReLU2MoEBackward(*(descs[n] for n in names), descs["d_out"], **shared_descs,
                              backend="torch")]
    for plan in plans:
        program = plan.kernel_program("triton")
        if is_inference and isinstance(plan, ReLU2MoEForward):
            assert program.saved.size == 0
        declared = set(plan._descs) | {"workspace"}
        for stage in program.stages:
            constexprs = dict(stage.kernel.constexprs)
            bound = {v for v in stage.bind.values() if isinstance(v, str)}
            assert bound <= declared, (stage.name, bound - declared)
            if stage.name == "moe_gemm_kernel":
                routed, weighted = constexprs["ROUTED"], constexprs["WEIGHTED"]
                for arg in ("sorted_ptr", "offsets_ptr", "counts_ptr"):
                    assert (arg in constexprs) == (not routed) and (constexprs.get(arg, 0) is None) == (not routed)
                assert ("weight_ptr" in constexprs) == (not weighted)
                assert ("u_ptr" in constexprs) == (constexprs["EPILOGUE"] != 2)
                combining = constexprs["EPILOGUE"] == 3
                assert combining == (stage.bind["out_ptr"] in ("out", "d_x")) and \
                    (not combining or not routed)
                for arg in ("rows_ptr", "ids_ptr", "stride_out"):
                    assert (arg in constexprs) == (not combining)
        combines = [s for s in program.stages if s.name == "moe_combine_kernel"]
        assert len(combines) == (0 if shared else 1)
        assert any(s.name == "moe_gemm_kernel" and not dict(s.kernel.constexprs)["ROUTED"]
                   for s in program.stages) == bool(shared)


# -- 3b. tile tables, autotune candidates and the cost model ---------------------------------------
def _experts_plan(cls, case, backend="torch", **options):
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    extra = dict(d_out=case["d_out"]) if cls is ReLU2MoEBackward else {}
    shared = {n: case.get(n) for n in ("shared_w_up", "shared_w_down")}
    return cls(*(case[n] for n in names), **extra, **shared, backend=backend, **options)


def test_tile_tables_follow_the_arch_and_candidates_keep_the_saved_layout():
    """Every arch has an entry with its reason; the candidates start with it, never change the
    routed row tile (the dispatch padding the forward saves) and split it evenly."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.relu2_moe import program as kernels
    from fusedops.backends.triton.relu2_moe import router as router_kernels
    from fusedops.backends.triton.relu2_moe import tiles as tiles
    from fusedops.core.target import compiling_for
    for t, k in ((200, 2), (16, 1)):                   # row tile 128, then decode-sized (16)
        case = experts_case(t, 16, 4, 24, k, shared=8, device="cpu")
        fwd = _experts_plan(ReLU2MoEForward, case)
        bwd = _experts_plan(ReLU2MoEBackward, case)
        for arch, (entry, why) in tiles.TILES.items():
            assert why and tiles.ROUTER_TILES[arch][1]
            with compiling_for(arch):
                assert tiles.tiles_for(fwd.problem) == entry
                found = kernels.forward_candidates(fwd.problem)
                assert found[0] == entry and len(found) >= 3 and len(set(found)) == len(found)
                tile = tiles.row_tile(fwd.problem)
                saved = kernels.forward_program(fwd.problem).saved.size
                for config in found:
                    assert tiles.row_tile(fwd.problem, config) == tile
                    assert tile % tiles.routed_bm(fwd.problem, config) == 0
                    assert kernels.forward_program(fwd.problem, config).saved.size == saved
                    assert kernels.backward_program(bwd.problem, config).saved.size == saved
        assert router_kernels.forward_candidates(fwd.problem)[0] == tiles.ROUTER_TILES["sm_90"][0]


@pytest.mark.parametrize("backend", KERNELS)
def test_tuning_tensors_are_a_valid_routing_and_a_real_dispatch(backend):
    """The autotune inputs: k distinct valid experts per token, and for the backward the saved
    buffer a forward wrote for them (counts that add up to t·k)."""
    case = experts_case(40, 16, 7, 24, 3, shared=8, seed=21)
    bwd = _experts_plan(ReLU2MoEBackward, case, backend=backend)
    tensors = bwd._tuning_tensors()
    ids = tensors["topk_ids"]
    assert ids.dtype == torch.int32 and ids.shape == (40, 3)
    assert ((ids >= 0) & (ids < 7)).all()
    assert all(len(set(row)) == 3 for row in ids.tolist())
    counts = bwd.program.saved.carve(tensors["saved"], "counts").tensor().cpu()
    assert torch.equal(counts, torch.bincount(ids.reshape(-1).long().cpu(), minlength=7).int())
    router = MoERouterBackward(torch.randn(40, 7, device=DEVICE), case["topk_ids"],
                               case["topk_weights"], backend=backend)
    assert ((router._tuning_tensors()["topk_ids"] < 7)).all()


@pytest.mark.parametrize("backend", KERNELS)
def test_every_candidate_computes_the_same_results(backend):
    """Each autotune candidate's forward and backward programs (other column tiles, split row
    tiles, weight-gradient steps) give the table entry's results."""
    from fusedops.backends.triton.relu2_moe import program as kernels
    case = experts_case(200, 16, 4, 24, 2, shared=8, dtype=torch.float16, seed=22)
    fwd = _experts_plan(ReLU2MoEForward, case, backend=backend).compile()
    bwd = _experts_plan(ReLU2MoEBackward, case, backend=backend).compile()
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}

    def run():
        out, saved = torch.empty_like(case["x"]), fwd.allocate_saved()
        fwd.execute(*(case[n] for n in names), out, saved, **shared,
                    workspace=fwd.allocate_workspace())
        grads = bwd.allocate_outputs()
        bwd.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                    workspace=bwd.allocate_workspace())
        return dict(out=out, **grads)
    reference = run()
    configs = kernels.forward_candidates(fwd.problem)
    assert any(c.bm_split > 1 for c in configs)
    for config in configs[1:]:
        for plan, program in ((fwd, kernels.forward_program), (bwd, kernels.backward_program)):
            plan._program = program(plan.problem, config=config)
            plan._launch = None
            plan.compile()
        result = run()
        for name, value in reference.items():     # sums in another order: another rounding
            assert_close(result[name], value, EXPERT_TOLERANCE[torch.float16], f"{config} {name}")


def _skewed_case(dtype):
    """300 tokens, 5 experts, k = 2: every token's first expert is 0 and 250 tokens' second is 1
    (every 7th token's second dropped), so experts 0 and 1 pass the split-K chunk."""
    case = experts_case(300, 32, 5, 48, 2, shared=16, dtype=dtype, seed=3)
    ids = case["topk_ids"]
    ids[:, 0] = 0
    ids[:250, 1] = 1
    ids[250:, 1] = torch.arange(50, dtype=ids.dtype, device=ids.device) % 3 + 2
    ids[::7, 1] = -1
    return case


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skewed_routing_splits_the_weight_gradients_deterministically(backend, dtype):
    """A hot expert's rows go to split-K chunks (fp32 slots, added in chunk order): the results
    match the torch backend, repeat bit for bit, add to accumulated gradients once, and agree
    with the unsplit kernels (another order of fp32 sums)."""
    from fusedops.backends.triton.relu2_moe import program as kernels
    from fusedops.backends.triton.relu2_moe.tiles import tiles_for
    case = _skewed_case(dtype)
    bwd = _experts_plan(ReLU2MoEBackward, case, backend=backend)
    slots, chunk = kernels._wgrad_split(bwd.problem, tiles_for(bwd.problem))
    counts = torch.bincount(case["topk_ids"][case["topk_ids"] >= 0].long().cpu(), minlength=5)
    assert slots and int(counts.max()) > 2 * chunk
    expected = run_experts("torch", case)
    tol = {torch.float32: Tolerance(2e-6, 2e-5, "fp32 sums in another order"),
           torch.float16: Tolerance(1e-4, 1e-3, "an fp16 rounding of u, a or out that flips")}[dtype]
    first, second = run_experts(backend, case), run_experts(backend, case)
    compare(first, expected, tol)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}
    _, saved = fusedops.relu2_moe_forward(*(case[n] for n in names), **shared, backend=backend)
    for config in (None, dataclasses.replace(tiles_for(bwd.problem), wgrad_split_slots=0)):
        plan = _experts_plan(ReLU2MoEBackward, case, backend=backend, accumulate=True)
        if config is not None:
            plan._program = kernels.backward_program(plan.problem, config=config)
        plan.compile()
        grads = {n: torch.full(plan.desc(n).shape, 0.5, dtype=plan.desc(n).dtype, device=DEVICE)
                 for n in plan.gradient_names}
        plan.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                     workspace=plan.allocate_workspace())
        for n in ("d_w_up", "d_w_down"):
            assert_close(grads[n], first[n] + 0.5, Tolerance(1e-5, 1e-5, "fp32 sums in another "
                                                             "order"), f"{config} {n}")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("wdt", [torch.float32, torch.float16])
def test_shared_weight_gradients_in_one_launch_are_the_two_launches_bits(backend, wdt):
    """The tile table's ``dense_wgrad_pair`` (sm_90, sm_100) runs the shared expert's two weight
    gradients in one launch, the first's tiles then the second's; with it off (sm_80) they run
    as two. Same tiles, same order of sums: the same bits, accumulated onto the buffers or not,
    in fp32 or in x's dtype."""
    from fusedops.backends.triton.relu2_moe import program as kernels
    from fusedops.backends.triton.relu2_moe.tiles import tiles_for
    case = experts_case(70, 48, 4, 40, 2, shared=160, dtype=torch.float16, seed=21)
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    shared = {n: case[n] for n in ("shared_w_up", "shared_w_down")}
    _, saved = fusedops.relu2_moe_forward(*(case[n] for n in names), **shared, backend=backend)
    results = {}
    for pair in (True, False):
        for accumulate in (True, False):
            plan = _experts_plan(ReLU2MoEBackward, case, backend=backend, accumulate=accumulate,
                                 weight_grad_dtype=wdt)
            config = dataclasses.replace(tiles_for(plan.problem), dense_wgrad_pair=pair)
            plan._program = kernels.backward_program(plan.problem, config=config)
            launches = [s.name for s in plan._program.stages]
            assert launches.count("moe_dense_wgrad_pair_kernel") == pair
            assert launches.count("moe_wgrad_kernel") == 6 + 2 * (not pair)   # routed: split-K
            plan.compile()
            grads = {n: torch.full(plan.desc(n).shape, 0.5, dtype=plan.desc(n).dtype,
                                   device=DEVICE) for n in plan.gradient_names}
            plan.execute(*(case[n] for n in names), case["d_out"], saved, **grads, **shared,
                         workspace=plan.allocate_workspace())
            for n in ("d_shared_w_up", "d_shared_w_down"):
                results[pair, accumulate, n] = grads[n].float() - 0.5 * accumulate
    expected = run_experts("torch", {n: v.double() if v.is_floating_point() else v
                                     for n, v in case.items()})
    for n in ("d_shared_w_up", "d_shared_w_down"):
        for accumulate in (True, False):
            assert torch.equal(results[True, accumulate, n], results[False, accumulate, n]), n
            assert_close(results[True, accumulate, n].double(), expected[n],
                         EXPERT_TOLERANCE[torch.float16], n)


# -- 5. GPU --------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_KERNELS or ["triton"])
def test_gpu_nano_like_shapes_against_the_torch_backend(backend):
    case = experts_case(2048, 1024, 32, 512, 6, shared=1024, dtype=torch.bfloat16, seed=30)
    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(2048, 32, generator=gen).to(DEVICE)
    case["topk_weights"], case["topk_ids"] = fusedops.moe_router(logits, 6, routed_scaling_factor=2.5)
    expected = run_experts("torch", case)
    first, second = run_experts(backend, case), run_experts(backend, case)
    compare(first, expected, Tolerance(8e-3, 3e-2, "bf16 roundings of u or a that flip"))
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} not bitwise reproducible"
