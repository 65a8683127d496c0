"""Mamba2 inference: the math. The reference against float64 oracles and gradcheck, every backend against the
reference, edge cases and invalid index data (what each backend computes from them).
"""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops import Mamba2StateUpdate
from fusedops.core.status import Status
from fusedops.mamba2_inference import samples
from fusedops.mamba2_inference.info import INFO
from fusedops.opinfo import Tolerance
from fusedops.testing import assert_close

from helpers import DEVICE, check_against_oracle, dtype_id

from .support import BACKENDS, decode_inputs


FP32 = Tolerance(1e-5, 5e-5, "fp32 recurrence against the fp32 chunked scan, other order")


def part(core, opts, start, stop):
    """Tokens [start, stop) of every row."""
    sliced = {k: (v[:, start:stop].contiguous() if k != "A" else v) for k, v in core.items()}
    return sliced, dict(opts, z=opts["z"][:, start:stop].contiguous())


# -- 1. every backend against the float64 recurrence ---------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("kind,index", [("small", i) for i in range(len(samples.SMALL))]
                         + [("edge", i) for i in range(len(samples.EDGE))])
def test_update_and_rollback_match_oracle(backend, dtype, kind, index):
    case = INFO.cases(kind, dtype=dtype, device=DEVICE)[index]
    check_against_oracle(INFO, case, INFO.run(case, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_rows_touch_nothing(backend):
    """Padding rows and rows past the cache leave every slot alone and get zero y rows and
    snapshots; a rollback whose accepted count is outside [0, T] leaves the slot as the update
    wrote it."""
    case = INFO.cases("edge", device=DEVICE)[1]
    r = INFO.run(case, backend)
    assert torch.equal(r["state"], case.tensors["state"])
    assert not r["y"].any() and not r["snapshots"].float().any()
    case = INFO.cases("edge", device=DEVICE)[3]
    r = INFO.run(case, backend)
    assert torch.equal(r["state"][0], r["snapshots"][0, -1])


# -- 2. the update against the scan; replay; rollback ------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token_updates_equal_the_chunked_scan(backend):
    b, l, h, p, g, n = 2, 21, 4, 8, 2, 16
    core, opts, h0 = decode_inputs(b, l, h, p, g, n, seed=1)
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
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_replay_reproduces_states_and_outputs(backend, state_dtype):
    """Original: a 3-token launch, then two 1-token launches (offsets advancing by T). Replay:
    one 5-token launch from the checkpoint with the cached inputs and the same offsets."""
    b, h, p, g, n = 3, 2, 8, 1, 8
    core, opts, checkpoint = decode_inputs(b, 5, h, p, g, n, seed=3, state_dtype=state_dtype)
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
    core, opts, initial = decode_inputs(b, T, h, p, g, n, seed=5, state_dtype=torch.float16, slots=4)
    indices = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    rng = dict(_stochastic(b), rng_offset=torch.tensor([5, 2**40], device=DEVICE))
    drafted = initial.clone()
    snapshots = fusedops.mamba2_state_update(drafted, *core.values(), backend=backend, **opts, **rng,
                                             state_batch_indices=indices, checkpoint_period=period,
                                             return_snapshots=True)["snapshots"]
    assert torch.equal(snapshots[:, 0], initial[[3, 1]]) and torch.equal(snapshots[:, T], drafted[[3, 1]])
    for k in range(T + 1):
        rolled = drafted.clone()
        returned = fusedops.mamba2_rollback(rolled, snapshots,
                                            torch.full((b,), k, dtype=torch.int32, device=DEVICE),
                                            state_batch_indices=indices, backend=backend)
        assert returned is rolled
        prefix = initial.clone()
        if k:
            step, step_opts = part(core, opts, 0, k)
            fusedops.mamba2_state_update(prefix, *step.values(), backend=backend, **step_opts, **rng,
                                         state_batch_indices=indices, checkpoint_period=period)
        assert torch.equal(rolled, prefix), f"accepted {k}"
    assert torch.equal(rolled[[0, 2]], initial[[0, 2]])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_stochastic_rounding_is_unbiased_and_within_one_ulp(backend, state_dtype):
    """M rows with identical inputs and different seeds: every stored value is one of the two
    neighbours of the fp32 result, and their mean converges to it. Bound: 6 standard deviations
    of the mean of M Bernoulli draws over one ulp (a false failure has probability < 1e-8)."""
    M, h, p, g, n = 512, 1, 4, 1, 4
    core, opts, start = decode_inputs(1, 1, h, p, g, n, seed=8, state_dtype=state_dtype)
    core = {k: (v.expand(M, *v.shape[1:]).contiguous() if k != "A" else v) for k, v in core.items()}
    opts = dict(opts, z=opts["z"].expand(M, *opts["z"].shape[1:]).contiguous())
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
    for _ in range(2):
        twice = start.expand(M, h, p, n).contiguous()
        fusedops.mamba2_state_update(twice, *core.values(), backend=backend, **opts)
        assert torch.equal(twice[0], exact.to(state_dtype)) and torch.equal(twice[0], twice[-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fewer_writes_are_not_always_more_accurate(backend):
    """The cancellation example of docs/mamba2_inference.md on fp16's unit grid ([1024, 2048)
    has ulp 1): inputs -0.9, -0.9, -0.5, -0.1 from 1536. Writing every token ends at 1534
    (error 0.4), every two tokens at 1533 (error 0.6): fewer writes, larger error."""
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


# -- 3. index data: skipped rows, the status word, host checks, option types ---------------------
def _update_with_status(backend, indices, slots=5, status_value=0, poison=True):
    """An update with snapshots and a status word, y and snapshots poisoned (NaN) first; returns
    (y, snapshots, state before, state after, status)."""
    b = len(indices)
    core, opts, _ = decode_inputs(b, 3, 2, 8, 1, 8, seed=40, slots=slots, indices=indices)
    state = torch.randn(slots, 2, 8, 8, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    before = state.clone()
    idx = torch.tensor(indices, dtype=torch.int32, device=DEVICE)
    status = torch.full((1,), status_value, dtype=torch.int32, device=DEVICE)
    snapshots = fusedops.TensorDesc((b, 4, *state.shape[1:]), state.dtype, device=state.device)
    plan = Mamba2StateUpdate(state, *core.values(), state_batch_indices=idx, snapshots=snapshots,
                             status=status, backend=backend, **opts).compile()
    y = torch.full_like(core["x"], float("nan") if poison else 0.0)
    snapshots = torch.full(plan.desc("snapshots").shape, float("nan") if poison else 0.0, device=DEVICE)
    plan.execute(state, *core.values(), y, D=opts["D"], z=opts["z"], dt_bias=opts["dt_bias"],
                 state_batch_indices=idx, snapshots=snapshots, status=status)
    return y, snapshots, before, state, int(status)


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_rows_write_zeros_and_report_slots_past_the_cache(backend):
    """A negative slot (padding: no bit) and a slot past the cache (SLOT_INDEX): no slot is
    touched, y rows and snapshots of the row are exactly 0 (over poisoned buffers); the other
    rows are computed as without them."""
    y, snapshots, before, after, status = _update_with_status(backend, [3, -1, 0, 7, -2**31])
    assert status == Status.SLOT_INDEX
    for row in (1, 3, 4):
        assert torch.equal(y[row], torch.zeros_like(y[row])), row
        assert torch.equal(snapshots[row], torch.zeros_like(snapshots[row])), row
    assert torch.isfinite(y[[0, 2]]).all() and torch.isfinite(snapshots[[0, 2]]).all()
    untouched = [1, 2, 4]
    assert torch.equal(after[untouched], before[untouched])
    assert torch.equal(snapshots[0, -1], after[3]) and torch.equal(snapshots[2, -1], after[0])
    _, _, _, _, status = _update_with_status(backend, [3, -1, 0, 4, -7])
    assert status == 0                       # padding only: valid
    _, _, _, _, status = _update_with_status(backend, [3, -1, 0, 4, 2**31 - 1], status_value=0x20)
    assert status == 0x20 | Status.SLOT_INDEX     # never cleared; bits accumulate


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollback_skips_and_reports_invalid_rows(backend):
    """accepted outside [0, T] (ACCEPTED_COUNT, padding rows included) or a slot past the cache
    (SLOT_INDEX): the row's slot is unchanged; a padding row sets no bit of its own."""
    b, T, slots = 5, 3, 6
    state = torch.randn(slots, 2, 8, 8, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    snapshots = torch.randn(b, T + 1, 2, 8, 8, generator=torch.Generator().manual_seed(43)).to(DEVICE)

    def rollback(indices, accepted):
        rolled = state.clone()
        status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        fusedops.mamba2_rollback(rolled, snapshots,
                                 torch.tensor(accepted, dtype=torch.int32, device=DEVICE),
                                 state_batch_indices=torch.tensor(indices, dtype=torch.int32,
                                                                  device=DEVICE),
                                 status=status, backend=backend)
        return rolled, int(status)

    rolled, status = rollback([5, -1, 0, 2, 3], [1, 0, 3, 2, 0])
    assert status == 0
    assert torch.equal(rolled[5], snapshots[0, 1]) and torch.equal(rolled[2], snapshots[3, 2])
    assert torch.equal(rolled[[1, 4]], state[[1, 4]])
    rolled, status = rollback([5, -1, 0, 2, 3], [4, 0, -1, 2**31 - 1, 0])
    assert status == Status.ACCEPTED_COUNT
    assert torch.equal(rolled[[5, 0, 2]], state[[5, 0, 2]]) and torch.equal(rolled[3], snapshots[4, 0])
    rolled, status = rollback([6, -1, 0, 2, -2**31], [1, 0, 1, 1, 1])
    assert status == Status.SLOT_INDEX
    assert torch.equal(rolled[0], snapshots[2, 1])
    assert torch.equal(rolled[[1, 3, 4, 5]], state[[1, 3, 4, 5]])
    _, status = rollback([1, -1, 0, 2, 3], [1, 9, 1, 1, 1])
    assert status == Status.ACCEPTED_COUNT     # a padding row's accepted count is checked too
