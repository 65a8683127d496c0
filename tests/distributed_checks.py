"""The checks tests/test_distributed.py runs inside one spawned process group per world size.

Each check runs on every rank of the group (gloo, CPU) and raises AssertionError on a mismatch.
References are single-process results of the same operators (torch backend, float64): every
rank compares its part of the distributed result with its part of the reference, and the
gradients of replicated tensors summed over the group with the reference's.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from fusedops import layers, ops
from fusedops.distributed import (ExpertParallelMoE, SequenceLayout, context_parallel_gqa_attention,
                                  context_parallel_mamba2_scan, expert_parallel_relu2_moe)
from fusedops.layers.parallel import (ContextParallelGQAAttention, ContextParallelMamba2Mixer,
                                         ExpertParallelReLU2MoE)
from fusedops.errors import ValidationError
from fusedops.registry import family
from fusedops.testing import assert_close, runnable_backends

F64, F32 = torch.float64, torch.float32
SCAN, ATTENTION, MOE = family("mamba2_scan"), family("gqa_attention"), family("relu2_moe")
TRITON = "triton" in runnable_backends(torch.device("cpu"))


def _random(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _leaves(tensors: dict, dtype, device="cpu") -> dict:
    return {k: (v.to(dtype) if v.is_floating_point() else v).to(device, copy=True)
            .requires_grad_(v.is_floating_point()) for k, v in tensors.items()}


def _summed(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t


def _same(runs: list[list[torch.Tensor]], what: str) -> None:
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"{what}: result {i} differs between two runs (not bitwise equal)"


# -- Mamba2 ---------------------------------------------------------------------------------------
def _scan(rank, world, layout, batch, cu=None, backend="torch", dtype=F64, repeats=1, device="cpu"):
    gen = torch.Generator().manual_seed(len(layout.pieces) + layout.total)
    h, p, g, n, total = 4, 8, 2, 8, layout.total
    nseq = batch if cu is None else len(cu) - 1
    full = dict(x=_random(gen, batch, total, h, p), dt=_random(gen, batch, total, h),
                A=-torch.rand(h, generator=gen, dtype=F64) - 0.5, B=_random(gen, batch, total, g, n),
                C=_random(gen, batch, total, g, n), z=_random(gen, batch, total, h, p),
                D=_random(gen, h), dt_bias=_random(gen, h), h0=_random(gen, nseq, h, p, n))
    dy, dfinal = _random(gen, batch, total, h, p), _random(gen, nseq, h, p, n)
    options = dict(dt_softplus=True, dt_limit=(0.0, 4.0))
    ref = _leaves(full, F64)
    y, final = ops.mamba2_chunk_scan(ref["x"], ref["dt"], ref["A"], ref["B"], ref["C"], 16, D=ref["D"],
                                     z=ref["z"], dt_bias=ref["dt_bias"], initial_states=ref["h0"],
                                     cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32),
                                     backend="torch", **options)
    ((y * dy).sum() + (final * dfinal).sum()).backward()
    sharded = ("x", "dt", "B", "C", "z")
    runs = []
    for _ in range(repeats):
        mine = _leaves({k: layout.shard(v, rank) if k in sharded else v for k, v in full.items()}, dtype,
                       device)
        for k in ("A", "D", "dt_bias", "h0"):
            mine[k] = mine[k].detach().to(accumulator(dtype)).requires_grad_()
        y_l, final_l = context_parallel_mamba2_scan(
            mine["x"], mine["dt"], mine["A"], mine["B"], mine["C"], layout, 16, D=mine["D"], z=mine["z"],
            dt_bias=mine["dt_bias"], initial_states=mine["h0"], cu_seqlens=cu, backend=backend, **options)
        ((y_l * layout.shard(dy, rank).to(device, dtype)).sum() +
         (final_l * dfinal.to(device, final_l.dtype)).sum()).backward()
        runs.append([y_l.detach(), final_l.detach(), *(mine[k].grad for k in full)])
    tol = lambda name: SCAN.tolerance(name, dtype)
    assert_close(y_l, layout.shard(y.detach(), rank), tol("y"), f"rank {rank} y")
    assert_close(_summed(final_l), final.detach(), tol("final_states"), "final_states (summed)")
    for k in full:
        expected = layout.shard(ref[k].grad, rank) if k in sharded else ref[k].grad
        got = mine[k].grad if k in sharded else _summed(mine[k].grad)
        assert_close(got, expected, tol("d" + k), f"rank {rank} d{k}")
    if repeats > 1:
        _same(runs, f"scan on {backend}")


def accumulator(dtype):
    return F64 if dtype == F64 else F32


def scan_dense_uneven_torch(rank, world):
    _scan(rank, world, SequenceLayout.contiguous([10, 14] if world == 2 else [5, 0, 7, 4]), 2)


def scan_dense_zigzag_torch(rank, world):
    _scan(rank, world, SequenceLayout.zigzag(37, world), 2, repeats=2)


def scan_empty_rank_torch(rank, world):
    _scan(rank, world, SequenceLayout.contiguous([0, 24] if world == 2 else [0, 0, 24, 1]), 1)


def scan_varlen_crossing_torch(rank, world):
    _scan(rank, world, SequenceLayout.zigzag(40, world), 1, cu=[0, 3, 9, 9, 31, 40])
    _scan(rank, world, SequenceLayout.contiguous([13, 27] if world == 2 else [9, 0, 3, 28]), 1,
          cu=[0, 1, 10, 10, 25, 32])


def scan_varlen_triton(rank, world):
    _scan(rank, world, SequenceLayout.zigzag(24, world), 1, cu=[0, 3, 9, 9, 24], backend="triton",
          dtype=F32, repeats=2)


# -- attention ------------------------------------------------------------------------------------
def _attention(rank, world, layout, causal=True, overlap=True, backend="torch", dtype=F64, repeats=1,
               device="cpu"):
    gen = torch.Generator().manual_seed(layout.total)
    b, total, hq, hkv, d = 2, layout.total, 4, 2, 16
    full = dict(q=_random(gen, b, total, hq, d), k=_random(gen, b, total, hkv, d),
                v=_random(gen, b, total, hkv, d))
    do = _random(gen, b, total, hq, d)
    ref = _leaves(full, F64)
    o = ops.gqa_attention(ref["q"], ref["k"], ref["v"], causal=causal, backend="torch")
    (o * do).sum().backward()
    runs = []
    for _ in range(repeats):
        mine = _leaves({k: layout.shard(v, rank) for k, v in full.items()}, dtype, device)
        o_l = context_parallel_gqa_attention(mine["q"], mine["k"], mine["v"], layout, causal=causal,
                                             overlap=overlap, backend=backend)
        (o_l * layout.shard(do, rank).to(device, dtype)).sum().backward()
        runs.append([o_l.detach(), *(mine[k].grad for k in full)])
    assert_close(o_l, layout.shard(o.detach(), rank), ATTENTION.tolerance("o", dtype), f"rank {rank} o")
    for k in full:
        assert_close(mine[k].grad, layout.shard(ref[k].grad, rank), ATTENTION.tolerance("d" + k, dtype),
                     f"rank {rank} d{k}")
    if repeats > 1:
        _same(runs, f"attention on {backend}")


def attention_zigzag_torch(rank, world):
    _attention(rank, world, SequenceLayout.zigzag(37, world), repeats=2)
    _attention(rank, world, SequenceLayout.zigzag(37, world), overlap=False)


def attention_uneven_empty_rank_torch(rank, world):
    _attention(rank, world, SequenceLayout.contiguous([10, 0] if world == 2 else [5, 0, 7, 4]))
    _attention(rank, world, SequenceLayout.zigzag(24, world), causal=False)


def attention_triton(rank, world):
    _attention(rank, world, SequenceLayout.zigzag(37, world), backend="triton", dtype=F32, repeats=2)


# -- MoE ------------------------------------------------------------------------------------------
def _moe_inputs(tokens, E=8, H=16, I=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    T = sum(tokens)
    return dict(x=_random(gen, T, H), w_up=_random(gen, E, I, H) / H ** 0.5,
                w_down=_random(gen, E, H, I) / I ** 0.5, logits=_random(gen, T, E)), _random(gen, T, H)


def _kept_ids(ids, tokens, world, experts_per_rank, capacity):
    """The ids with every assignment the capacity-bounded dispatch drops set to -1: per
    (source, destination) pair only the first ``capacity`` tokens (in order) with an expert on
    the destination keep their experts there."""
    kept, at = ids.clone(), 0
    for n in tokens:
        used = [0] * world
        for t in range(at, at + n):
            for d in sorted({int(i) // experts_per_rank for i in ids[t]}):
                used[d] += 1
                if used[d] > capacity:
                    kept[t][ids[t] // experts_per_rank == d] = -1
        at += n
    return kept


def _moe(rank, world, tokens, capacity=None, backend="torch", dtype=F64, repeats=1, k=3, device="cpu"):
    full, d_out = _moe_inputs(tokens)
    E = full["w_up"].shape[0]
    El = E // world
    lo = sum(tokens[:rank])
    rows, experts = slice(lo, lo + tokens[rank]), slice(rank * El, (rank + 1) * El)
    ref = _leaves(full, F64)
    weights, ids = ops.moe_router(ref["logits"], k, backend="torch")
    if capacity is not None:
        ids = _kept_ids(ids, tokens, world, El, capacity)
    out = ops.relu2_moe(ref["x"], ref["w_up"], ref["w_down"], ids, weights, backend="torch")
    (out * d_out).sum().backward()
    runs = []
    for _ in range(repeats):
        mine = _leaves(dict(x=full["x"][rows], w_up=full["w_up"][experts], w_down=full["w_down"][experts],
                            logits=full["logits"][rows]), dtype, device)
        mine["logits"] = mine["logits"].detach().to(accumulator(dtype)).requires_grad_()
        w_l, ids_l = ops.moe_router(mine["logits"], k, backend=backend)
        o_l = expert_parallel_relu2_moe(mine["x"], mine["w_up"], mine["w_down"], ids_l, w_l,
                                        capacity=capacity,
                                        max_tokens=None if capacity is None else max(tokens),
                                        backend=backend)
        (o_l * d_out[rows].to(device, dtype)).sum().backward()
        runs.append([o_l.detach(), *(mine[n].grad for n in mine)])
    tol = MOE.tolerance("out", dtype)
    assert_close(o_l, out.detach()[rows], tol, f"rank {rank} out")
    for name, part in (("x", rows), ("w_up", experts), ("w_down", experts), ("logits", rows)):
        assert_close(mine[name].grad, ref[name].grad[part], tol, f"rank {rank} d{name}")
    if repeats > 1:
        _same(runs, f"expert-parallel MoE on {backend}")


def moe_dropless_torch(rank, world):
    _moe(rank, world, [7, 12] if world == 2 else [5, 0, 9, 3], repeats=2)


def moe_empty_ranks_torch(rank, world):
    _moe(rank, world, [0, 12] if world == 2 else [0, 0, 9, 3])


def moe_capacity_torch(rank, world):
    tokens = [7, 12] if world == 2 else [5, 1, 9, 3]
    _moe(rank, world, tokens, capacity=max(tokens))       # C >= tokens: drops nothing
    _moe(rank, world, tokens, capacity=2)                 # drops: as the ids set to -1


def moe_triton(rank, world):
    _moe(rank, world, [7, 12], backend="triton", dtype=F32, repeats=2)
    _moe(rank, world, [7, 12], capacity=3, backend="triton", dtype=F32)


def moe_plan_with_caller_buffers(rank, world):
    """ExpertParallelMoE as a plan: sized for t_max, executed twice with fewer tokens (a
    different count per rank) into the same buffers, bitwise equal, and equal to the
    single-process experts with every rank's expert weights."""
    from fusedops import TensorDesc
    t_max, k, H, I, El = 8, 2, 16, 24, 2
    gen = torch.Generator().manual_seed(rank)
    x = _random(gen, 5 + rank, H)
    w_up, w_down = _random(gen, El, I, H) / H ** 0.5, _random(gen, El, H, I) / I ** 0.5
    ids = torch.randint(0, El * world, (x.shape[0], k), generator=gen, dtype=torch.int32)
    weights = torch.rand(x.shape[0], k, generator=gen, dtype=F64)
    desc = lambda *shape, dtype=F64: TensorDesc(shape, dtype, device="cpu")
    plan = ExpertParallelMoE(desc(t_max, H), w_up, w_down, desc(t_max, k, dtype=torch.int32),
                             desc(t_max, k), backend="torch").compile()
    assert plan.rows == world * t_max and plan.send_rows == t_max * min(k, world)
    workspace, saved = plan.allocate_workspace(), plan.allocate_saved()
    d_out = _random(gen, *x.shape)
    runs = []
    for _ in range(2):
        out = torch.empty_like(x)
        splits = plan.forward(x, w_up, w_down, ids, weights, out, saved, workspace=workspace)["splits"]
        grads = [torch.empty_like(x), torch.empty_like(weights), torch.empty(El, I, H, dtype=F64),
                 torch.empty(El, H, I, dtype=F64)]
        plan.backward(w_up, w_down, d_out, saved, *grads, splits=splits, workspace=workspace)
        runs.append([out.clone(), *(g.clone() for g in grads)])
    _same(runs, "ExpertParallelMoE plan")
    inference = ExpertParallelMoE(desc(t_max, H), w_up, w_down, desc(t_max, k, dtype=torch.int32),
                                  desc(t_max, k), is_inference=True, backend="torch").compile()
    assert inference.saved_size == 0
    out = torch.empty_like(x)
    inference.forward(x, w_up, w_down, ids, weights, out, workspace=inference.allocate_workspace())
    assert torch.equal(out, runs[0][0]), "is_inference: another output"
    every = [torch.empty_like(w_up) for _ in range(world)], [torch.empty_like(w_down) for _ in range(world)]
    dist.all_gather(every[0], w_up)
    dist.all_gather(every[1], w_down)
    ref = _leaves(dict(x=x, w_up=torch.cat(every[0]), w_down=torch.cat(every[1]), weights=weights), F64)
    expected = ops.relu2_moe(ref["x"], ref["w_up"], ref["w_down"], ids, ref["weights"], backend="torch")
    (expected * d_out).sum().backward()
    tol = MOE.tolerance("out", F64)
    assert_close(runs[0][0], expected.detach(), tol, "out")
    assert_close(runs[0][1], ref["x"].grad, tol, "d_x")
    assert_close(runs[0][2], ref["weights"].grad, tol, "d_topk_weights")
    assert_close(_summed(torch.cat([torch.zeros(rank * El, I, H, dtype=F64), runs[0][3],
                                    torch.zeros((world - rank - 1) * El, I, H, dtype=F64)])),
                 _summed(ref["w_up"].grad), tol, "d_w_up")


# -- layers ---------------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    """A tiny Nemotron-H-style stack (embedding, pre-norm residual blocks, head) of the given
    mixers; ``layout`` is passed to the context-parallel ones."""

    def __init__(self, mixers):
        super().__init__()
        torch.manual_seed(11)
        self.embed = torch.nn.Embedding(50, 32)
        self.norms = torch.nn.ModuleList(torch.nn.RMSNorm(32) for _ in mixers)
        self.mixers = torch.nn.ModuleList(mixers)
        self.head = torch.nn.Linear(32, 50, bias=False)

    def forward(self, ids, layout=None):
        h = self.embed(ids)
        for norm, mixer in zip(self.norms, self.mixers):
            kwargs = {} if isinstance(mixer, layers.ReLU2MoE) or layout is None else dict(layout=layout)
            out = mixer(norm(h), **kwargs)
            h = h + (out[0] if isinstance(out, tuple) else out)
        return self.head(h)


def _mixers(distributed: bool):
    torch.manual_seed(3)
    mamba = dict(chunk_size=16, backend="torch")
    if not distributed:
        moe = layers.ReLU2MoE(32, 8, 24, 2, shared_intermediate=20, routed_scaling_factor=2.5,
                              backend="torch")
        with torch.no_grad():
            moe.gate.weight.normal_(std=0.5)
        return [layers.Mamba2Mixer(32, 4, 8, 2, 8, **mamba),
                layers.GQAAttention(32, 4, 2, 8, backend="torch"),
                moe, layers.Mamba2Mixer(32, 4, 8, 2, 8, **mamba)]
    return [ContextParallelMamba2Mixer(32, 4, 8, 2, 8, **mamba),
            ContextParallelGQAAttention(32, 4, 2, 8, backend="torch"),
            ExpertParallelReLU2MoE(32, 8, 24, 2, shared_intermediate=20, routed_scaling_factor=2.5,
                                   backend="torch"),
            ContextParallelMamba2Mixer(32, 4, 8, 2, 8, **mamba)]


def layers_match_the_single_process_model(rank, world):
    for layout in (SequenceLayout.zigzag(37, world),
                   SequenceLayout.contiguous([2, 35] if world == 2 else [2, 0, 1, 34])):
        ids = torch.randint(0, 50, (2, layout.total), generator=torch.Generator().manual_seed(4))
        single = _Model(_mixers(False))
        ours = _Model(_mixers(True))
        ours.load_state_dict(single.state_dict())
        logits = single(ids)
        mine = ours(layout.shard(ids, rank), layout)
        weight = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
        (logits * weight).sum().backward()
        (mine * layout.shard(weight, rank)).sum().backward()
        assert_close(mine, layout.shard(logits.detach(), rank), F32, f"rank {rank} logits")
        theirs = dict(single.named_parameters())
        for name, p in ours.named_parameters():
            if ".experts." in name:
                experts = ours.mixers[2].experts
                expected = theirs[name].grad[experts.first:experts.first + experts.count]
                got = p.grad
            else:
                expected, got = theirs[name].grad, _summed(p.grad)
            assert_close(got, expected, SCAN.tolerance("dx", F32), f"rank {rank} grad of {name}")


# -- inconsistent metadata --------------------------------------------------------------------------
def _raises(expected_words, fn):
    try:
        fn()
    except ValidationError as error:
        for word in expected_words:
            assert word in str(error), f"{error} does not name {word!r}"
        return
    raise AssertionError(f"no ValidationError naming {expected_words}")


def inconsistent_metadata_raises_on_every_rank(rank, world):
    layout = SequenceLayout.zigzag(40, world)
    gen = torch.Generator().manual_seed(0)
    x, dt = _random(gen, 1, layout.local_length(rank), 4, 8), _random(gen, 1, layout.local_length(rank), 4)
    B = C = _random(gen, 1, layout.local_length(rank), 2, 8)
    A = -torch.ones(4, dtype=F64)
    cu = [0, 10, 40] if rank == 0 else [0, 11, 40]
    _raises(["cu_seqlens", "same value on every rank"],
            lambda: context_parallel_mamba2_scan(x, dt, A, B, C, layout, 16, cu_seqlens=cu))
    other = SequenceLayout.contiguous([layout.local_length(r) for r in range(world)])
    _raises(["layout"], lambda: context_parallel_mamba2_scan(x, dt, A, B, C, layout if rank else other, 16))
    q = _random(gen, 1, layout.local_length(rank), 4, 16 if rank == 0 else 8)
    k = _random(gen, 1, layout.local_length(rank), 2, q.shape[-1])
    _raises(["q", "same value"], lambda: context_parallel_gqa_attention(q, k, k, layout))
    from fusedops import TensorDesc
    t = TensorDesc((4, 16), F32, device="cpu")
    w_up, w_down = torch.zeros(2, 24, 16), torch.zeros(2, 16, 24)
    _raises(["capacity"], lambda: ExpertParallelMoE(
        t, w_up, w_down, TensorDesc((4, 2), torch.int32, device="cpu"), TensorDesc((4, 2), F32, device="cpu"),
        capacity=4 + rank))


def local_error_is_not_a_hang(rank, world):
    """A rank whose own input is wrong raises at once; the others' collective fails at the
    group's timeout instead of hanging."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    layout = SequenceLayout.contiguous([8] * world)
    length = 8 if rank else 7                      # rank 0 holds the wrong number of positions
    x = torch.zeros(1, length, 2, 4, dtype=F64)
    try:
        context_parallel_mamba2_scan(x, torch.zeros(1, length, 2, dtype=F64), -torch.ones(2, dtype=F64),
                                     torch.zeros(1, length, 1, 4, dtype=F64),
                                     torch.zeros(1, length, 1, 4, dtype=F64), layout, 16, group=group)
    except ValidationError as error:
        assert rank == 0 and "x: expected" in str(error) and "rank 0" in str(error), str(error)
    except RuntimeError as error:           # the peers: gloo's timeout (or the closed connection)
        assert rank != 0, str(error)
    else:
        raise AssertionError("no error")
    dist.destroy_process_group(group)


CHECKS = {
    2: [scan_dense_uneven_torch, scan_dense_zigzag_torch, scan_empty_rank_torch, scan_varlen_crossing_torch,
        attention_zigzag_torch, attention_uneven_empty_rank_torch, moe_dropless_torch,
        moe_empty_ranks_torch, moe_capacity_torch, moe_plan_with_caller_buffers,
        layers_match_the_single_process_model, inconsistent_metadata_raises_on_every_rank]
    + ([scan_varlen_triton, attention_triton, moe_triton] if TRITON else []) + [local_error_is_not_a_hang],
    4: [scan_dense_uneven_torch, scan_dense_zigzag_torch, scan_empty_rank_torch, scan_varlen_crossing_torch,
        attention_zigzag_torch, attention_uneven_empty_rank_torch, moe_dropless_torch,
        moe_empty_ranks_torch, moe_capacity_torch, layers_match_the_single_process_model,
        inconsistent_metadata_raises_on_every_rank],
}
