"""Mamba2 inference: the plans' contract. Construction and validation errors naming the argument, options,
views and strides, the status word, host checks, eager wrappers and torch ops, CUDA Graph capture.
"""

from __future__ import annotations

import pytest
import torch

import fusedops
from fusedops import Mamba2StateRollback, Mamba2StateUpdate
from fusedops.core.status import Status
from fusedops.errors import ValidationError
from fusedops.memory import MIB, NEMOTRON_3_ULTRA
from fusedops.testing import HostReads

from helpers import DEVICE, GPU_BACKENDS, requires_cuda

from .support import BACKENDS, decode_inputs


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
    with HostReads() as mode:
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
