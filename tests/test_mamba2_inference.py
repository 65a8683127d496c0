"""Mamba2 inference (docs/mamba2_inference.md): every backend against the float64 recurrence,
state update == scan, replay identity, rollback == the accepted prefix, stochastic rounding
statistics, the cancellation example, padding, validation, the memory calculator, GPU checks.
The plan contract (execute checks, no torch op in execute, descs, repr, graph capture) is tested
for every plan in test_plan_contract.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedops
from fusedops import Mamba2StateRollback, Mamba2StateUpdate
from fusedops.core.status import Status
from fusedops.errors import ValidationError
from fusedops.mamba2_inference import samples
from fusedops.mamba2_inference.info import INFO
from fusedops.memory import MIB, NEMOTRON_3_ULTRA
from fusedops.opinfo import Tolerance
from fusedops.testing import assert_close

from helpers import BACKENDS, DEVICE, GPU_BACKENDS, check_against_oracle, dtype_id, requires_cuda

BACKENDS = [b for b in BACKENDS if b in Mamba2StateUpdate.backends]
FP32 = Tolerance(1e-5, 5e-5, "fp32 recurrence against the fp32 chunked scan, other order")
CORE = ("x", "dt", "A", "B", "C")


def decode_inputs(b, T, h, p, g, n, *, seed=0, dtype=torch.float32, **options):
    """(core: x, dt, A, B, C; opts: D, z, dt_bias, dt_softplus; the case's state)."""
    case = samples.make(b, T, h, p, g, n, dtype, D="h", z=True, dt_bias=True, seed=seed,
                        device=DEVICE, **options)
    t = case.tensors
    core = {k: t[k] for k in CORE}
    return core, dict(D=t["D"], z=t["z"], dt_bias=t["dt_bias"], dt_softplus=True), t["state"]


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


def test_single_token_shapes():
    """x [b, h, p] (one token): y comes back [b, h, p], snapshots [b, 2, h, p, n]."""
    core, opts, state = decode_inputs(3, 1, 2, 8, 1, 8, seed=2)
    one = {k: (v[:, 0] if k != "A" else v) for k, v in core.items()}
    expected = state.clone()
    y = fusedops.mamba2_state_update(expected, *core.values(), backend="torch", **opts)["y"]
    out = fusedops.mamba2_state_update(state, *one.values(), backend="torch", return_snapshots=True,
                                       **dict(opts, z=opts["z"][:, 0]))
    assert torch.equal(out["y"], y[:, 0]) and torch.equal(state, expected)
    assert out["snapshots"].shape == (3, 2, 2, 8, 8) and torch.equal(out["snapshots"][:, 1], state)


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


@pytest.mark.parametrize("call,match", [
    ("update-past", r"^state_batch_indices: expected entries in \[0, 5\) or -1 \(any negative entry "
                    r"is padding\), got state_batch_indices\[2\] = 9$"),
    ("update-duplicate", r"^state_batch_indices: expected distinct slots among the valid rows, got "
                         r"state_batch_indices\[2\] = 3 = state_batch_indices\[0\]$"),
    ("rollback-accepted", r"^accepted: expected entries in \[0, 4\) \(at most T = 3 tokens\), got "
                          r"accepted\[1\] = -2$"),
    ("rollback-past", r"^state_batch_indices: expected entries in \[0, 5\) or -1 .* got "
                      r"state_batch_indices\[2\] = 9$"),
])
def test_check_inputs_names_the_bad_entry(call, match, monkeypatch):
    """check_inputs=True (or FUSEDOPS_CHECK_INPUTS=1) checks the index values on the host before
    anything runs, naming the argument and the first bad entry; nothing is written."""
    b, T = 3, 3
    core, opts, _ = decode_inputs(b, T, 2, 8, 1, 8, seed=44, slots=5)
    state = torch.randn(5, 2, 8, 8, device=DEVICE)
    before = state.clone()
    indices = {"update-past": [3, -1, 9], "update-duplicate": [3, -1, 3],
               "rollback-accepted": [3, -1, 0], "rollback-past": [3, -1, 9]}[call]
    idx = torch.tensor(indices, dtype=torch.int32, device=DEVICE)
    accepted = torch.tensor([1, -2, 0], dtype=torch.int32, device=DEVICE)
    snapshots = torch.zeros(b, T + 1, 2, 8, 8, device=DEVICE)
    if call.startswith("update"):
        def run(**kw):
            return fusedops.mamba2_state_update(state, *core.values(), state_batch_indices=idx,
                                                backend="torch", **opts, **kw)
        plan = Mamba2StateUpdate(state, *core.values(), state_batch_indices=idx, backend="torch", **opts)
    else:
        if call == "rollback-past":
            accepted = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEVICE)
        def run(**kw):
            return fusedops.mamba2_rollback(state, snapshots, accepted, state_batch_indices=idx,
                                            backend="torch", **kw)
        plan = Mamba2StateRollback(state, snapshots, accepted, state_batch_indices=idx, backend="torch")
    with pytest.raises(ValidationError, match=match):
        run(check_inputs=True)
    with pytest.raises(ValidationError, match=match):
        plan.check_index_values(state_batch_indices=idx, accepted=accepted)
    monkeypatch.setenv("FUSEDOPS_CHECK_INPUTS", "1")
    with pytest.raises(ValidationError, match=match):
        run()
    assert torch.equal(state, before)
    run(check_inputs=False)                  # memory-safe anyway (the kernels skip the rows)


def test_status_word_and_slot_count_validation():
    core, _, state = decode_inputs(2, 1, 2, 8, 1, 8)
    with pytest.raises(ValidationError, match=r"^status: expected dtype int32, got float32"):
        Mamba2StateUpdate(state, *core.values(), status=torch.zeros(1, device=DEVICE), backend="torch")
    snapshots = torch.zeros(2, 2, 2, 8, 8, device=DEVICE)
    accepted = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValidationError, match=r"^status: expected shape \[1\] = \[1\], got \[1, 1\]"):
        Mamba2StateRollback(state, snapshots, accepted, backend="torch",
                            status=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValidationError, match=r"^state: expected at least b = 2 slots without "
                                              r"state_batch_indices, got 1"):
        Mamba2StateRollback(state[:1], snapshots, accepted, backend="torch")


WRONG_UPDATE_OPTIONS = [("dt_softplus", 1), ("dt_limit", "wide"), ("rounding", 1),
                        ("checkpoint_period", 2.0), ("return_snapshots", 1), ("backend", 3),
                        ("current_stream", "stream"), ("check_inputs", "yes"),
                        ("rng_seed", 1.5), ("rng_offset", object())]


@pytest.mark.parametrize("option,value", WRONG_UPDATE_OPTIONS,
                         ids=[f"{o}-{i}" for i, (o, _) in enumerate(WRONG_UPDATE_OPTIONS)])
@pytest.mark.parametrize("wrapper", ["update", "replay"])
def test_wrong_typed_update_options_raise_validation_errors(wrapper, option, value):
    core, _, _ = decode_inputs(2, 1, 2, 8, 1, 8)
    state = torch.zeros(2, 2, 8, 8, dtype=torch.float16, device=DEVICE)
    before = state.clone()
    stochastic = option.startswith("rng")
    options = dict(rounding="stochastic", rng_seed=1, rng_offset=0) if stochastic else {}
    options[option] = value
    fn = fusedops.mamba2_state_update if wrapper == "update" else fusedops.mamba2_replay
    with pytest.raises(ValidationError, match=rf"^{option}: expected"):
        fn(state, *core.values(), **options, **({} if option == "backend" else {"backend": "torch"}))
    assert torch.equal(state, before)


@pytest.mark.parametrize("option,value", [("backend", 3), ("current_stream", "stream"),
                                          ("check_inputs", 1)])
def test_wrong_typed_rollback_options_raise_validation_errors(option, value):
    state = torch.zeros(2, 2, 8, 8, device=DEVICE)
    snapshots = torch.zeros(2, 2, 2, 8, 8, device=DEVICE)
    accepted = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    backend = {} if option == "backend" else {"backend": "torch"}
    with pytest.raises(ValidationError, match=rf"^{option}: expected"):
        fusedops.mamba2_rollback(state, snapshots, accepted, **{option: value}, **backend)


class _HostReads(TorchDispatchMode):
    """Records the operators that read a device value on the host (.item(), bool(), tolist())."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


def test_torch_backend_reads_no_index_value_on_the_host():
    """The torch backend validates slots and accepted counts with device ops only."""
    b, T = 3, 2
    core, opts, _ = decode_inputs(b, T, 2, 8, 1, 8, seed=45, slots=4)
    state = torch.randn(4, 2, 8, 8, device=DEVICE)
    idx = torch.tensor([3, -1, 9], dtype=torch.int32, device=DEVICE)
    status = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    snapshots = torch.zeros(b, T + 1, 2, 8, 8, device=DEVICE)
    update = Mamba2StateUpdate(state, *core.values(), state_batch_indices=idx, snapshots=snapshots,
                               status=status, backend="torch", **opts).compile()
    accepted = torch.tensor([1, 5, 0], dtype=torch.int32, device=DEVICE)
    rollback = Mamba2StateRollback(state, snapshots, accepted, state_batch_indices=idx,
                                   status=status, backend="torch").compile()
    y = torch.empty_like(core["x"])
    with _HostReads() as mode:
        update.execute(state, *core.values(), y, D=opts["D"], z=opts["z"], dt_bias=opts["dt_bias"],
                       state_batch_indices=idx, snapshots=snapshots, status=status)
        rollback.execute(state, snapshots, accepted, state_batch_indices=idx, status=status)
    assert mode.reads == []
    assert int(status) == Status.SLOT_INDEX | Status.ACCEPTED_COUNT


# -- 4. validation and the plans' declarations ---------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_validation(backend):
    core, _, _ = decode_inputs(2, 1, 2, 8, 1, 8)
    state = torch.zeros(2, 2, 8, 8, device=DEVICE)
    with pytest.raises(ValidationError, match=r"rounding: 'stochastic' needs a bf16 or fp16 state"):
        Mamba2StateUpdate(state, *core.values(), rounding="stochastic", backend=backend)
    with pytest.raises(ValidationError, match=r"checkpoint_period: expected an int >= 1, got 0"):
        Mamba2StateUpdate(state, *core.values(), checkpoint_period=0, backend=backend)
    with pytest.raises(ValidationError, match=r"checkpoint_period: expected an int >= 1, got 2.0"):
        Mamba2StateUpdate(state, *core.values(), checkpoint_period=2.0, backend=backend)
    with pytest.raises(ValidationError, match=r"rounding: expected 'nearest' or 'stochastic', got 'up'"):
        Mamba2StateUpdate(state, *core.values(), rounding="up", backend=backend)
    with pytest.raises(ValidationError, match=r"dt_limit: expected lo <= hi"):
        Mamba2StateUpdate(state, *core.values(), dt_limit=(1.0, 0.0), backend=backend)
    with pytest.raises(ValidationError, match=r"state: expected shape \[slots, h, p, n\] with h = 2, p = 8"):
        Mamba2StateUpdate(torch.zeros(2, 2, 4, 8, device=DEVICE), *core.values(), backend=backend)
    with pytest.raises(ValidationError, match=r"state: expected at least b = 2 slots"):
        Mamba2StateUpdate(state[:1], *core.values(), backend=backend)
    with pytest.raises(ValidationError, match=r"snapshots: expected shape \[b, T\+1, h, p, n\] = \[2, 2, 2, 8, 8\]"):
        Mamba2StateUpdate(state, *core.values(), snapshots=torch.zeros(2, 1, 2, 8, 8, device=DEVICE),
                          backend=backend)
    half = state.half()
    plan = Mamba2StateUpdate(half, *core.values(), rounding="stochastic", backend=backend).compile()
    y = torch.empty_like(core["x"])
    with pytest.raises(ValidationError, match=r"rng_seed: expected a torch.Tensor, got NoneType"):
        plan.execute(half, *core.values(), y)
    with pytest.raises(ValidationError, match=r"y: must not overlap x"):
        plan.execute(half, *core.values(), core["x"], rng_seed=torch.zeros(2, dtype=torch.int64, device=DEVICE),
                     rng_offset=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    nearest = Mamba2StateUpdate(half, *core.values(), backend=backend).compile()
    with pytest.raises(ValidationError, match=r"rng_seed: this plan was built without rng_seed"):
        nearest.execute(half, *core.values(), y, rng_seed=torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValidationError, match=r"rng_seed: rounding='stochastic' needs a seed and an offset per row"):
        fusedops.mamba2_state_update(half, *core.values(), rounding="stochastic", backend=backend)
    with pytest.raises(ValidationError, match=r"accepted: expected dtype int32, got int64"):
        Mamba2StateRollback(half, torch.zeros(2, 2, 2, 8, 8, dtype=torch.float16, device=DEVICE),
                            torch.zeros(2, dtype=torch.int64, device=DEVICE), backend=backend)


def test_rng_seeds_are_inputs_the_plan_sizes():
    """rng_seed and rng_offset: read-only int64 [b] operands declared by a stochastic plan."""
    core, _, _ = decode_inputs(3, 2, 2, 8, 1, 8)
    plan = Mamba2StateUpdate(torch.zeros(4, 2, 8, 8, dtype=torch.bfloat16, device=DEVICE),
                             *core.values(), rounding="stochastic", backend="torch")
    roles = {o.name: o.role for o in plan.operands}
    for name in ("rng_seed", "rng_offset"):
        assert roles[name] == "in"
        desc = plan.desc(name)
        assert desc.shape == (3,) and desc.dtype == torch.int64
    assert roles["state"] == "inout" and roles["snapshots"] == "out"


def test_triton_programs_compile_absent_operands_out():
    """Without D, z, dt_bias, slot indices, seeds or snapshots the update kernel takes no
    pointer for them (constexpr None, never another tensor); likewise the rollback's indices."""
    pytest.importorskip("triton")
    core, _, state = decode_inputs(2, 1, 2, 8, 1, 8)
    update = Mamba2StateUpdate(state, *core.values(), backend="torch").kernel_program("triton")
    (kernel,) = update.kernels
    names = [a for a in kernel.runtime_arg_names() if not a.startswith("stride_")]
    assert names == ["state_ptr", "x_ptr", "dt_ptr", "A_ptr", "B_ptr", "C_ptr", "y_ptr", "SLOTS",
                     "T", "dt_min", "dt_max"]
    snapshots = torch.zeros(2, 2, 2, 8, 8, device=DEVICE)
    rollback = Mamba2StateRollback(state, snapshots, torch.zeros(2, dtype=torch.int32, device=DEVICE),
                                   backend="torch").kernel_program("triton")
    assert rollback.kernels[0].runtime_arg_names() == ("state_ptr", "snapshots_ptr", "accepted_ptr",
                                                       "SLOTS")


def test_memory_calculator_matches_the_seed():
    cfg = NEMOTRON_3_ULTRA
    assert cfg.state_bytes(torch.float32) == 48 * 8 * MIB == 384 * MIB
    assert cfg.kv_bytes_per_token(1) == 6144
    assert cfg.crossover_tokens(torch.float32, 1) == 65536
    assert cfg.crossover_tokens(torch.float16, 1) == 32768
    assert cfg.kv_bytes(65536, 1) == cfg.state_bytes(torch.float32)
    assert 64 * cfg.state_bytes(torch.float32) == 24 * 2**30


# -- 5. the performance model, the block table, autotune candidates ------------------------------
def _production(label: str):
    (calls,) = [calls for name, calls in samples.production() if name == label]
    return calls[0].build("torch")


def test_block_table_follows_the_target_arch():
    """One entry per architecture, each with its reason; the programs take the target's entry
    (or ``config=``); the candidates start with it."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_inference import program as kernels, tiles
    from fusedops.core.target import compiling_for
    plan = _production("decode T=4 float16 stochastic snapshots")
    assert set(tiles.TILES) == {"sm_80", "sm_90", "sm_100"}
    for arch, (entry, why) in tiles.TILES.items():
        assert why
        with compiling_for(arch):
            assert tiles.tiles_for(plan.problem) == entry
            assert kernels.update_candidates(plan.problem)[0] == entry
    other = tiles.DecodeTiles(BP=32, BP_STOCHASTIC=4, MAX_WARPS=2)
    (spec,) = kernels.update_program(plan.problem, config=other).kernels
    assert spec.grid == (256, 128, 16) and spec.num_warps == 2     # 64 / 4 rows, 4·128/256 warps


def test_update_model_against_its_floor():
    """The update's model (backends/triton/mamba2_inference/cost.py) on sm_90 is its floor plus
    what reuse distance re-reads. The grid (b, h, p/BP) runs the row fastest: a (row, group)'s
    B and C rows are re-read by the group's next head b = 256 programs later, a (row, head)'s dt
    and B, C by the next head-dim block h·b = 32768 programs later, a row's slot index and seeds
    by every program of the row, b apart. A program moves its dt (T·2 bytes), B and C
    (2·T·n·2), the slot (4) and seeds (16, stochastic), its state tile (BP·n·s read, written,
    and once per snapshot) and x, z, y rows (BP·T·2 each): 16,998 bytes at T = 1 fp32 (BP = 16),
    16,604 at T = 4 fp16 stochastic with snapshots (BP = 8); G = 0.5 · 50 MB over that, about
    1,500: b <= G < h·b, so dt, B and C count once per head-dim block (the floor's once, p/BP
    times), the slot and seeds once. The rollback (grid (b, 256 tiles), the row fastest): a
    row's accepted count and slot are re-read b programs apart, and a program moves 2 x 4096
    fp16 values and 8 bytes: G = 1,525 >= b, so its read is the floor's."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_inference import cost as model
    from fusedops.core.target import compiling_for
    h, p, g, n, e = 128, 64, 8, 128, 2
    for label, b, T, bp, s in (("decode T=1 float32", 256, 1, 16, 4),
                               ("decode T=4 float16 stochastic snapshots", 256, 4, 8, 2)):
        plan = _production(label)
        stochastic, snaps = plan.problem.stochastic, plan.problem.has_snapshots
        moved = (T * e + 2 * T * n * e + 4 + 16 * stochastic
                 + bp * n * s * (2 + (T + 1) * snaps) + 3 * bp * T * e)
        assert b <= 0.5 * 50e6 / moved < h * b, label
        with compiling_for("sm_90"):
            cost = model.update_cost.__wrapped__(plan.problem, bp)
        floor = plan.floor()
        assert cost.bytes_written == floor.bytes_written
        per_block = b * T * (h * e + 2 * g * n * e)         # dt, B and C read once
        assert cost.bytes_read == floor.bytes_read + (p // bp - 1) * per_block, label
    rollback = _production("rollback fp16")
    with compiling_for("sm_90"):
        cost = model.rollback_cost.__wrapped__(rollback.problem, 4096)
    floor = rollback.floor()
    assert 0.5 * 50e6 / (2 * 4096 * 2 + 8) >= 256
    assert cost.bytes_written == floor.bytes_written == 256 * 128 * 64 * 128 * 2
    assert cost.bytes_read == floor.bytes_read


def test_update_kernels_carry_the_model():
    """The update's and the rollback's kernels carry mamba2_inference.cost's cost."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.mamba2_inference import cost as model, tiles
    plan = _production("decode T=1 float16")
    (kernel,) = plan.kernel_program("triton").kernels
    assert kernel.cost == model.update_cost(plan.problem, tiles.head_dim_rows(plan.problem))
    rollback = _production("rollback fp16")
    (kernel,) = rollback.kernel_program("triton").kernels
    assert kernel.cost == model.rollback_cost(rollback.problem, 4096)


def test_tuning_tensors_are_valid_index_data():
    """Candidates are timed with distinct valid slots and accepted counts in [0, T]."""
    update = _production("decode T=1 float16")
    slots = update._tuning_tensors()["state_batch_indices"]
    assert slots.dtype == torch.int32 and slots.shape == (256,)
    assert len(set(slots.tolist())) == 256 and 0 <= int(slots.min()) and int(slots.max()) < 512
    rollback = _production("rollback fp16")
    tensors = rollback._tuning_tensors()
    assert int(tensors["accepted"].min()) == 0 and int(tensors["accepted"].max()) == 4
    core, _, state = decode_inputs(3, 1, 2, 8, 1, 8)
    small = Mamba2StateUpdate(state[:2], *core.values(),
                              state_batch_indices=torch.zeros(3, dtype=torch.int32, device=DEVICE),
                              backend="torch")
    assert sorted(small._tuning_tensors()["state_batch_indices"].tolist()) == [-1, 0, 1]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "triton"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_every_autotune_candidate_gives_the_same_bits(backend, rounding):
    """Each candidate's update (another head-dim block) and rollback (another tile) write the
    same bits as the table's entry: the blocks change no reduction or random draw."""
    from fusedops.backends.triton.mamba2_inference import program as kernels
    case = samples.make(3, 3, 2, 32, 1, 16, torch.float32, state_dtype=torch.bfloat16, slots=5,
                        indices=[4, -1, 1], D="h", z=True, dt_bias=True, rounding=rounding,
                        accepted=[2, 0, 3], seed=4, device=DEVICE)
    t = case.tensors
    args = {k: t[k] for k in samples.UPDATE_TENSORS}
    probe = Mamba2StateUpdate(**args, snapshots=t["snapshots"], **case.options, backend=backend)
    configs = kernels.update_candidates(probe.problem)
    results = []
    for config in configs:
        state, snapshots = t["state"].clone(), torch.zeros_like(t["snapshots"])
        y = torch.zeros_like(t["x"])
        update = Mamba2StateUpdate(**dict(args, state=state), snapshots=snapshots, **case.options,
                                   backend=backend)
        update._program = kernels.update_program(update.problem, config=config)
        update.compile().execute(**dict(args, state=state), y=y, snapshots=snapshots,
                                 rng_seed=t["rng_seed"], rng_offset=t["rng_offset"])
        rollback = Mamba2StateRollback(state, snapshots, t["accepted"], backend=backend,
                                       state_batch_indices=t["state_batch_indices"])
        rollback._program = kernels.rollback_program(rollback.problem, config=config)
        rollback.compile().execute(state, snapshots, t["accepted"],
                                   state_batch_indices=t["state_batch_indices"])
        results.append((y, snapshots, state))
    for y, snapshots, state in results[1:]:
        for got, want in zip((y, snapshots, state), results[0]):
            assert torch.equal(got, want)


# -- GPU -----------------------------------------------------------------------------------------
@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in GPU_BACKENDS if b == "triton"])
def test_gpu_decode_step_graph_capture(backend):
    """One captured decode step (update, then the offsets advanced on the device) replayed three
    times: the torch backend's three steps, and the slots of padding rows untouched."""
    b, h, p, g, n, slots = 64, 128, 64, 8, 128, 96
    core, opts, _ = decode_inputs(b, 1, h, p, g, n, seed=11, dtype=torch.bfloat16)
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
