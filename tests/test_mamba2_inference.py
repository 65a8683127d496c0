"""Mamba2 inference (specs/mamba2.md, Inference): state update == scan, replay identity,
rollback == the accepted prefix, stochastic rounding statistics, the cancellation example,
padding, validation, the memory calculator, GPU checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedops
from fusedops import Mamba2StateRollback, Mamba2StateUpdate
from fusedops.errors import ValidationError
from fusedops.memory import MIB, NEMOTRON_3_ULTRA

from helpers import DEVICE, Tolerance, assert_close, gpu_backends, requires_cuda, runnable_backends

BACKENDS = [b for b in runnable_backends() if b != "cute"]
FP32 = Tolerance(1e-5, 5e-5, "fp32 recurrence against the fp32 chunked scan, other order")


def decode_inputs(b, T, h, p, g, n, *, seed=0, dtype=torch.float32, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    core = dict(x=rnd(b, T, h, p), dt=rnd(b, T, h), A=-0.5 - torch.rand(h, generator=gen),
                B=rnd(b, T, g, n), C=rnd(b, T, g, n))
    core = {k: v.to(device, dtype if k != "A" else torch.float32) for k, v in core.items()}
    opts = dict(D=rnd(h).to(device), z=rnd(b, T, h, p).to(device, dtype), dt_bias=rnd(h).to(device),
                dt_softplus=True)
    return core, opts


def part(core, opts, start, stop):
    """Tokens [start, stop) of every row."""
    sliced = {k: (v[:, start:stop].contiguous() if k != "A" else v) for k, v in core.items()}
    return sliced, dict(opts, z=opts["z"][:, start:stop].contiguous())


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token_updates_equal_the_chunked_scan(backend):
    b, l, h, p, g, n = 2, 21, 4, 8, 2, 16
    core, opts = decode_inputs(b, l, h, p, g, n, seed=1)
    h0 = torch.randn(b, h, p, n, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    scan = fusedops.mamba2_chunk_scan_forward(*core.values(), 16, initial_states=h0, backend=backend,
                                              **opts)
    state = h0.clone()
    ys = []
    for t in range(l):
        step, step_opts = part(core, opts, t, t + 1)
        ys.append(fusedops.mamba2_state_update(state, *step.values(), backend=backend, **step_opts)["y"])
    assert_close(torch.cat(ys, 1), scan["y"], FP32, "y")
    assert_close(state, scan["final_states"], FP32, "state")
    multi = h0.clone()
    y = fusedops.mamba2_state_update(multi, *core.values(), backend=backend, **opts)["y"]
    assert torch.equal(multi, state) and torch.equal(y, torch.cat(ys, 1))


def _stochastic(b, seed=7):
    return dict(rounding="stochastic", rng_seed=torch.arange(seed, seed + b, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
def test_replay_reproduces_states_and_outputs(backend, state_dtype):
    """Original: a 3-token launch, then two 1-token launches (offsets advancing by T). Replay:
    one 5-token launch from the checkpoint with the cached inputs and the same offsets."""
    b, h, p, g, n = 3, 2, 8, 1, 8
    core, opts = decode_inputs(b, 5, h, p, g, n, seed=3)
    checkpoint = torch.randn(b, h, p, n, generator=torch.Generator().manual_seed(4)).to(DEVICE, state_dtype)
    state, ys, offset = checkpoint.clone(), [], 1000
    for start, stop in ((0, 3), (3, 4), (4, 5)):
        step, step_opts = part(core, opts, start, stop)
        ys.append(fusedops.mamba2_state_update(
            state, *step.values(), backend=backend, **step_opts, **_stochastic(b),
            rng_offset=torch.full((b,), offset, device=DEVICE))["y"])
        offset += stop - start
    replay = fusedops.mamba2_replay(checkpoint, *core.values(), backend=backend, **opts, **_stochastic(b),
                                    rng_offset=torch.full((b,), 1000, device=DEVICE))
    assert torch.equal(replay["state"], state)
    assert torch.equal(replay["y"], torch.cat(ys, 1))
    assert not torch.equal(state, checkpoint)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("period", [1, 2, 3])
def test_rollback_equals_running_the_accepted_prefix(backend, period):
    b, T, h, p, g, n = 2, 4, 2, 8, 1, 8
    core, opts = decode_inputs(b, T, h, p, g, n, seed=5)
    initial = torch.randn(4, h, p, n, generator=torch.Generator().manual_seed(6)).to(DEVICE, torch.float16)
    indices = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    rng = dict(_stochastic(b), rng_offset=torch.tensor([5, 2**40], device=DEVICE))
    drafted = initial.clone()
    snapshots = fusedops.mamba2_state_update(drafted, *core.values(), backend=backend, **opts, **rng,
                                             state_batch_indices=indices, checkpoint_period=period,
                                             return_snapshots=True)["snapshots"]
    assert torch.equal(snapshots[:, 0], initial[[3, 1]]) and torch.equal(snapshots[:, T], drafted[[3, 1]])
    for k in range(T + 1):
        rolled = drafted.clone()
        fusedops.mamba2_rollback(rolled, snapshots, torch.full((b,), k, dtype=torch.int32, device=DEVICE),
                                 state_batch_indices=indices, backend=backend)
        prefix = initial.clone()
        if k:
            step, step_opts = part(core, opts, 0, k)
            fusedops.mamba2_state_update(prefix, *step.values(), backend=backend, **step_opts, **rng,
                                         state_batch_indices=indices, checkpoint_period=period)
        assert torch.equal(rolled, prefix), f"accepted {k}"
    assert torch.equal(rolled[[0, 2]], initial[[0, 2]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_unbiased_and_within_one_ulp(backend, state_dtype):
    """M rows with identical inputs and different seeds: every stored value is one of the two
    neighbours of the fp32 result, and their mean converges to it. Bound: 6 standard deviations
    of the mean of M Bernoulli draws over one ulp (a false failure has probability < 1e-8)."""
    M, h, p, g, n = 512, 1, 4, 1, 4
    core, opts = decode_inputs(1, 1, h, p, g, n, seed=8)
    core = {k: (v.expand(M, *v.shape[1:]).contiguous() if k != "A" else v) for k, v in core.items()}
    opts = dict(opts, z=opts["z"].expand(M, *opts["z"].shape[1:]).contiguous())
    start = torch.randn(1, h, p, n, generator=torch.Generator().manual_seed(9)).to(DEVICE, state_dtype)
    exact = start.float().expand(M, h, p, n).contiguous()
    fusedops.mamba2_state_update(exact, *core.values(), backend=backend, **opts)
    exact = exact[0]
    stored = start.expand(M, h, p, n).contiguous()
    fusedops.mamba2_state_update(stored, *core.values(), backend=backend, **opts,
                                 rounding="stochastic", rng_seed=torch.arange(M, device=DEVICE) * 7919,
                                 rng_offset=torch.zeros(M, dtype=torch.int64, device=DEVICE))
    down = exact.to(state_dtype)
    down = torch.where(down.float().abs() > exact.abs(),
                       (down.view(torch.int16) - 1).view(state_dtype), down)     # truncated value
    up = (down.view(torch.int16) + 1).view(state_dtype)
    ulp = (up.float() - down.float()).abs()
    assert bool(((stored == down) | (stored == up)).all()), "a write left the two neighbours"
    frac = ((exact - down.float()) / (up.float() - down.float())).clamp(0, 1)
    mean = stored.float().mean(0)
    bound = 6 * ulp * torch.sqrt(frac * (1 - frac) / M) + 1e-6 * exact.abs()
    assert bool(((mean - exact).abs() <= bound).all()), (mean - exact).abs().max()
    nearest = start.expand(2, h, p, n).contiguous()
    for _ in range(2):
        twice = start.expand(M, h, p, n).contiguous()
        fusedops.mamba2_state_update(twice, *core.values(), backend=backend, **opts)
        assert torch.equal(twice[0], exact.to(state_dtype)) and torch.equal(twice[0], twice[-1])
    del nearest


@pytest.mark.parametrize("backend", BACKENDS)
def test_fewer_writes_are_not_always_more_accurate(backend):
    """seeds/004's cancellation example on fp16's unit grid ([1024, 2048) has ulp 1): inputs
    -0.9, -0.9, -0.5, -0.1 from 1536. Writing every token ends at 1534 (error 0.4), every two
    tokens at 1533 (error 0.6): fewer writes, larger error."""
    u = torch.tensor([-0.9, -0.9, -0.5, -0.1])
    core = dict(x=u.view(1, 4, 1, 1).to(DEVICE), dt=torch.ones(1, 4, 1, device=DEVICE),
                A=torch.zeros(1, device=DEVICE), B=torch.ones(1, 4, 1, 1, device=DEVICE),
                C=torch.ones(1, 4, 1, 1, device=DEVICE))
    finals = {}
    for period in (1, 2):
        state = torch.full((1, 1, 1, 1), 1536.0, dtype=torch.float16, device=DEVICE)
        fusedops.mamba2_state_update(state, *core.values(), checkpoint_period=period, backend=backend)
        finals[period] = state.item()
    exact = 1536.0 + float(u.double().sum())
    assert finals == {1: 1534.0, 2: 1533.0}
    assert abs(finals[2] - exact) > abs(finals[1] - exact)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_and_no_torch_op_in_execute(backend):
    core, opts = decode_inputs(2, 1, 2, 8, 1, 8)
    state = torch.zeros(2, 2, 8, 8, device=DEVICE)
    with pytest.raises(ValidationError, match=r"rounding: 'stochastic' needs a bf16 or fp16 state"):
        Mamba2StateUpdate(state, *core.values(), rounding="stochastic", backend=backend)
    with pytest.raises(ValidationError, match=r"checkpoint_period: expected an int >= 1, got 0"):
        Mamba2StateUpdate(state, *core.values(), checkpoint_period=0, backend=backend)
    with pytest.raises(ValidationError, match=r"state: expected shape \[slots, h, p, n\] with h = 2, p = 8"):
        Mamba2StateUpdate(torch.zeros(2, 2, 4, 8, device=DEVICE), *core.values(), backend=backend)
    with pytest.raises(ValidationError, match=r"state: expected at least b = 2 slots"):
        Mamba2StateUpdate(state[:1], *core.values(), backend=backend)
    half = state.half()
    plan = Mamba2StateUpdate(half, *core.values(), rounding="stochastic", backend=backend).compile()
    y = torch.empty_like(core["x"])
    with pytest.raises(ValidationError, match=r"rng_seed: expected a torch.Tensor, got NoneType"):
        plan.execute(half, *core.values(), y)
    with pytest.raises(ValidationError, match=r"y: must not overlap x"):
        plan.execute(half, *core.values(), core["x"], rng_seed=torch.zeros(2, dtype=torch.int64, device=DEVICE),
                     rng_offset=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    calls = []

    class NoTorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise AssertionError(f"execute() dispatched {func}")
    seed, offset = torch.zeros(2, dtype=torch.int64, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    plan._launch = lambda t, stream: calls.append(t["state"] is half)
    with NoTorchOps():
        plan.execute(half, *core.values(), y, rng_seed=seed, rng_offset=offset)
    assert calls == [True]
    with pytest.raises(ValidationError, match=r"accepted: expected dtype int32, got int64"):
        Mamba2StateRollback(half, torch.zeros(2, 2, 2, 8, 8, dtype=torch.float16, device=DEVICE),
                            torch.zeros(2, dtype=torch.int64, device=DEVICE), backend=backend)


def test_memory_calculator_matches_the_seed():
    cfg = NEMOTRON_3_ULTRA
    assert cfg.state_bytes(torch.float32) == 48 * 8 * MIB == 384 * MIB
    assert cfg.kv_bytes_per_token(1) == 6144
    assert cfg.crossover_tokens(torch.float32, 1) == 65536
    assert cfg.crossover_tokens(torch.float16, 1) == 32768
    assert cfg.kv_bytes(65536, 1) == cfg.state_bytes(torch.float32)
    assert 64 * cfg.state_bytes(torch.float32) == 24 * 2**30


# -- GPU -----------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in gpu_backends() if b == "triton"])
def test_gpu_decode_step_graph_capture(backend):
    b, h, p, g, n, slots = 64, 128, 64, 8, 128, 96
    core, opts = decode_inputs(b, 1, h, p, g, n, seed=11, dtype=torch.bfloat16)
    state = torch.randn(slots, h, p, n, device=DEVICE).half()
    indices = torch.randperm(slots, device=DEVICE)[:b].int()
    indices[::7] = -1
    seed = torch.arange(b, device=DEVICE)
    offset = torch.zeros(b, dtype=torch.int64, device=DEVICE)
    plan = Mamba2StateUpdate(state, *core.values(), state_batch_indices=indices, rounding="stochastic",
                             backend=backend, **opts).compile()
    y = torch.empty_like(core["x"])
    kwargs = dict(D=opts["D"], z=opts["z"], dt_bias=opts["dt_bias"], state_batch_indices=indices,
                  rng_seed=seed, rng_offset=offset)
    before = state.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            plan.execute(state, *core.values(), y, **kwargs)
            offset.add_(1)
    for step in range(3):
        graph.replay()
    torch.cuda.synchronize()
    expected = before.clone()
    for step in range(3):
        fusedops.mamba2_state_update(expected, *core.values(), backend="torch", rounding="stochastic",
                                     rng_seed=seed, rng_offset=torch.full((b,), step, device=DEVICE),
                                     **{k: v for k, v in kwargs.items() if not k.startswith("rng")},
                                     dt_softplus=True)
    assert (state.float() - expected.float()).abs().max() <= 2 * (expected.float().abs().max() * 2**-10)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[indices[indices >= 0].long()] = False
    assert torch.equal(state[untouched], before[untouched])
