"""Sample inputs of the state update and rollback, and an update (with snapshots) followed by a
rollback through the plans (for the tests, the demo, the AOT compiles and the benchmarks)."""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc
from ..core.status import STATUS_DTYPE, Status
from ..opinfo import Case, PlanCall
from .contract import DEFAULT_DT_LIMIT, RNG_DTYPE
from .plans import Mamba2StateRollback, Mamba2StateUpdate

UPDATE_TENSORS = ("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "state_batch_indices")


def make(b: int, T: int, h: int, p: int, g: int, n: int, dtype=torch.float32, *,
         state_dtype=torch.float32, slots: int | None = None, indices=None, D: str | None = None,
         z: bool = False, dt_bias: bool = False, rounding: str = "nearest", period: int = 1,
         accepted=None, dt_dtype=None, dt_softplus: bool = True, dt_limit=DEFAULT_DT_LIMIT,
         seed: int = 0, device="cpu") -> Case:
    """Random x, dt, B, C, z, D, dt_bias N(0, 1), A = -0.5 - U[0, 1), a state cache [slots, h,
    p, n] N(0, 1) in ``state_dtype`` (slots: b by default), slot ``indices`` (a list; negative:
    padding; past the cache: skipped and reported), the per-row seeds and offsets of stochastic
    rounding (offsets near 2^32, so the counter's high word changes), the ``accepted`` counts of
    the rollback (default: row i accepts i mod (T + 1) tokens) and a zero snapshots buffer [b, T+1, h, p, n]. Options:
    dt_softplus, dt_limit, rounding, checkpoint_period."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    slots = b if slots is None else slots
    t = dict(x=rnd(b, T, h, p).to(device, dtype), dt=rnd(b, T, h).to(device, dt_dtype or dtype),
             A=(-0.5 - torch.rand(h, generator=gen)).to(device),
             B=rnd(b, T, g, n).to(device, dtype), C=rnd(b, T, g, n).to(device, dtype),
             state=rnd(slots, h, p, n).to(device, state_dtype),
             D=None if D is None else rnd(*((h,) if D == "h" else (h, p))).to(device),
             z=rnd(b, T, h, p).to(device, dtype) if z else None,
             dt_bias=rnd(h).to(device) if dt_bias else None,
             state_batch_indices=None if indices is None else torch.tensor(
                 indices, dtype=torch.int32, device=device))
    stochastic = rounding == "stochastic"
    t["rng_seed"] = torch.randint(0, 2**40, (b,), generator=gen).to(device) if stochastic else None
    t["rng_offset"] = ((2**32 - 2 + torch.arange(b)) * (torch.arange(b) % 2)).to(device, RNG_DTYPE) \
        if stochastic else None
    t["accepted"] = torch.tensor(accepted if accepted is not None else [i % (T + 1) for i in range(b)],
                                 dtype=torch.int32, device=device)
    t["snapshots"] = torch.zeros(b, T + 1, h, p, n, dtype=state_dtype, device=device)
    extras = "".join(f" {k}" for k, on in (("D" + (D or ""), D), ("z", z), ("dt_bias", dt_bias),
                                           (f"slots {indices}", indices is not None)) if on)
    label = (f"b={b} T={T} h={h} p={p} g={g} n={n} {str(dtype).removeprefix('torch.')} state "
             f"{str(state_dtype).removeprefix('torch.')} {rounding} every {period}{extras}")
    return Case(label, t, dict(dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                               rounding=rounding, checkpoint_period=period))


SMALL = [
    # slot pool with padding, bf16 state rounded stochastically every 2 tokens, a row whose
    # accepted count is past T (skipped by the rollback)
    ((3, 4, 4, 8, 2, 16), dict(state_dtype=torch.bfloat16, slots=5, indices=[3, -1, 0], D="h",
                               z=True, dt_bias=True, rounding="stochastic", period=2,
                               accepted=[2, 1, 7])),
    # fp16 state to nearest, D per channel, odd p and n, a dt clamp without softplus
    ((2, 3, 2, 20, 1, 24), dict(state_dtype=torch.float16, D="hp", dt_softplus=False,
                                dt_limit=(0.05, 2.0), accepted=[3, 0])),
    # fp32 state, one token, one group per head, a slot no row uses
    ((2, 1, 3, 8, 3, 8), dict(slots=3, z=True, accepted=[1, 0])),
]

EDGE = [
    ((1, 1, 1, 1, 1, 1), dict()),                                           # every size 1
    ((2, 2, 2, 8, 1, 8), dict(state_dtype=torch.float16, slots=3, indices=[-1, 3],
                              rounding="stochastic")),                      # every row skipped
    ((1, 5, 1, 65, 1, 130), dict(state_dtype=torch.float16, slots=2, indices=[1],
                                 rounding="stochastic", period=3, D="hp",
                                 accepted=[4])),                            # tiles of p and n
    ((2, 3, 2, 16, 2, 16), dict(state_dtype=torch.bfloat16, dt_dtype=torch.float32,
                                dt_bias=True, accepted=[-1, 2])),           # fp32 dt; a refused rollback
]

TILES = [
    # a speculative launch on an fp16 state rounded stochastically, slots with padding, a row
    # that accepts all 4 tokens
    ((3, 4, 2, 64, 1, 128), dict(state_dtype=torch.float16, slots=5, indices=[4, -1, 1], D="h",
                                 z=True, dt_bias=True, rounding="stochastic", accepted=[4, 1, 2])),
    # bf16 state rounded stochastically, snapshots every 2 tokens, two groups
    ((2, 4, 4, 64, 2, 128), dict(state_dtype=torch.bfloat16, D="h", z=True, dt_bias=True,
                                 rounding="stochastic", period=2, accepted=[3, 0])),
    # one token on an fp32 state, slots in another order
    ((2, 1, 2, 64, 1, 128), dict(slots=3, indices=[2, 0], D="h", z=True, dt_bias=True,
                                 accepted=[1, 0])),
    # a speculative launch on an fp16 state rounded to nearest
    ((2, 4, 2, 64, 1, 128), dict(state_dtype=torch.float16, D="h", z=True, dt_bias=True,
                                 accepted=[2, 4])),
]
"""The production blocks (``production()``: p = 64, n = 128, D, z, dt_bias, one token and
four with snapshots, each state dtype and rounding): 16 head-dim rows a program on 8 warps
(to nearest) and 8 rows on 4 warps under a 128-register budget (stochastic: Philox), the
state's 128 columns whole; a few rows and heads."""

DEMO = {"torch": ((8, 4, 8, 32, 2, 64), 16), "triton": ((2, 2, 2, 16, 1, 16), 4)}
"""The demonstration's shapes (b, T, h, p, g, n) and slots on the CPU; on a GPU 8 rows of a
64-slot cache at h=128, p=64, n=128, g=8 (Nemotron-H), a 4-token speculative launch."""
DEMO_GPU = ((8, 4, 128, 64, 8, 128), 64)


def cases(kind: str, *, dtype=torch.float32, device="cpu", backend: str = "torch") -> list[Case]:
    """small: slot pools with padding, every storage dtype and rounding; edge: sizes 1, every row
    skipped, several p and n tiles, fp32 dt, a refused rollback; tiles: the production blocks
    on a few rows (TILES); demo: a speculative launch of 4 tokens on an fp16 state with
    stochastic rounding (D, z, dt_bias, padding), then its rollback."""
    if kind == "small":
        return [make(*shape, dtype, seed=1 + i, device=device, **options)
                for i, (shape, options) in enumerate(SMALL)]
    if kind == "edge":
        return [make(*shape, dtype, seed=11 + i, device=device, **options)
                for i, (shape, options) in enumerate(EDGE)]
    if kind == "tiles":
        return [make(*shape, dtype, seed=21 + i, device=device, **options)
                for i, (shape, options) in enumerate(TILES)]
    if kind == "demo":
        on_cpu = torch.device(device).type == "cpu"
        shape, slots = DEMO.get(backend, DEMO["triton"]) if on_cpu else DEMO_GPU
        b = shape[0]
        indices = [slots - 1 - 2 * i if i % 4 != 3 else -1 for i in range(b)]
        return [make(*shape, dtype, state_dtype=torch.float16, slots=slots, indices=indices,
                     D="h", z=True, dt_bias=True, rounding="stochastic", seed=2, device=device)]
    raise ValueError(f"kind: expected small, edge, tiles or demo, got {kind!r}")


def production() -> list[tuple[str, list[PlanCall]]]:
    """Decode at h=128, p=64, n=128, g=8 (bf16 activations, D, z, dt_bias, a 512-slot pool, 256
    rows, a status word) for each state dtype and rounding: one token, and a speculative 4-token
    launch with snapshots; the fp16 rollback. TensorDescs on the CPU."""
    def desc(*shape, dtype=torch.bfloat16):
        return TensorDesc(shape, dtype, device="cpu")

    b, slots, h, p, g, n = 256, 512, 128, 64, 8, 128
    out = []
    for state_dtype, rounding in ((torch.float32, "nearest"), (torch.float16, "nearest"),
                                  (torch.float16, "stochastic"), (torch.bfloat16, "stochastic")):
        name = f"{str(state_dtype).removeprefix('torch.')}{' stochastic' if rounding == 'stochastic' else ''}"
        for T, snaps in ((1, False), (4, True)):
            tensors = dict(state=desc(slots, h, p, n, dtype=state_dtype), x=desc(b, T, h, p),
                           dt=desc(b, T, h), A=desc(h, dtype=torch.float32), B=desc(b, T, g, n),
                           C=desc(b, T, g, n), D=desc(h, dtype=torch.float32), z=desc(b, T, h, p),
                           dt_bias=desc(h, dtype=torch.float32),
                           state_batch_indices=desc(b, dtype=torch.int32),
                           snapshots=desc(b, T + 1, h, p, n, dtype=state_dtype) if snaps else None,
                           status=desc(1, dtype=STATUS_DTYPE))
            out.append((f"decode T={T} {name}{' snapshots' if snaps else ''}", [
                PlanCall(Mamba2StateUpdate, tensors, dict(dt_softplus=True, rounding=rounding))]))
    out.append(("rollback fp16", [PlanCall(Mamba2StateRollback, dict(
        state=desc(slots, h, p, n, dtype=torch.float16),
        snapshots=desc(b, 5, h, p, n, dtype=torch.float16), accepted=desc(b, dtype=torch.int32),
        state_batch_indices=desc(b, dtype=torch.int32), status=desc(1, dtype=STATUS_DTYPE)))]))
    return out


def _update_args(t, state, snapshots) -> dict:
    return dict({k: t[k] for k in UPDATE_TENSORS}, state=state, snapshots=snapshots)


def plan_calls(case: Case, backend: str) -> list[PlanCall]:
    """The update (with snapshots) and the rollback of ``case``, each with a status word; the
    rollback's snapshots come from running the update on ``backend`` (on a copy of the state)."""
    t = case.tensors
    device = t["x"].device
    update = PlanCall(Mamba2StateUpdate,
                      dict(_update_args(t, t["state"], t["snapshots"]), rng_seed=t["rng_seed"],
                           rng_offset=t["rng_offset"], status=_status(device)), case.options)
    snapshots = torch.zeros_like(t["snapshots"])
    plan = update.build(backend).compile()
    plan.execute(**_update_args(t, t["state"].clone(), snapshots), y=torch.zeros_like(t["x"]),
                 rng_seed=t["rng_seed"], rng_offset=t["rng_offset"], status=_status(device))
    rollback = PlanCall(Mamba2StateRollback, dict(state=t["state"], snapshots=snapshots,
                                                  accepted=t["accepted"],
                                                  state_batch_indices=t["state_batch_indices"],
                                                  status=_status(device)))
    return [update, rollback]


def _status(device) -> torch.Tensor:
    return torch.zeros(1, dtype=STATUS_DTYPE, device=device)


def run(case: Case, backend: str) -> dict[str, torch.Tensor]:
    """The update with snapshots on a copy of the state, then the rollback to each row's
    accepted snapshot; returns y, snapshots (zero-filled buffers: skipped rows stay zero) and
    the state."""
    t = case.tensors
    state, snapshots = t["state"].clone(), torch.zeros_like(t["snapshots"])
    update = Mamba2StateUpdate(**_update_args(t, state, snapshots), **case.options,
                               backend=backend).compile()
    y = torch.zeros_like(t["x"])
    update.execute(**_update_args(t, state, snapshots), y=y, rng_seed=t["rng_seed"],
                   rng_offset=t["rng_offset"])
    rollback = Mamba2StateRollback(state, snapshots, t["accepted"],
                                   state_batch_indices=t["state_batch_indices"],
                                   backend=backend).compile()
    rollback.execute(state, snapshots, t["accepted"], state_batch_indices=t["state_batch_indices"])
    return dict(y=y, snapshots=snapshots, state=state)


# -- index-data fuzzing ---------------------------------------------------------------------------
FUZZ_SHAPE = (4, 2, 2, 4, 1, 4)           # b, T, h, p, g, n
FUZZ_SLOTS = 6
SLOT_KINDS = ("valid", "past-cache", "extreme")
ACCEPTED_KINDS = ("valid", "above-T", "negative", "extreme")


def _draw_slots(kind: str, gen: torch.Generator, b: int, slots: int) -> list[int]:
    """Distinct valid slots with padding (negative entries), plus, by ``kind``, a slot past the
    cache or extreme int32 values."""
    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))
    idx = torch.randperm(slots, generator=gen)[:b].tolist()
    idx[randint(0, b)] = -randint(1, 100)
    if kind == "past-cache":
        idx[randint(0, b)] = slots + randint(0, 50)
    elif kind == "extreme":
        idx[0], idx[-1] = 2**31 - 1, -2**31
    return idx


def _draw_accepted(kind: str, gen: torch.Generator, b: int, T: int) -> list[int]:
    """Accepted counts in [0, T], plus, by ``kind``, one above T, one negative, or extremes."""
    acc = torch.randint(0, T + 1, (b,), generator=gen).tolist()
    i = int(torch.randint(0, b, (1,), generator=gen))
    if kind == "above-T":
        acc[i] = T + 1 + int(torch.randint(0, 10, (1,), generator=gen))
    elif kind == "negative":
        acc[i] = -int(torch.randint(1, 10, (1,), generator=gen))
    elif kind == "extreme":
        acc[0], acc[-1] = 2**31 - 1, -2**31
    return acc


def index_fuzz(seed: int, backend: str, device) -> list:
    """The update (with snapshots) over drawn slot indices, and the rollback over drawn slots and
    accepted counts (its snapshots from the update on ``backend`` with the same slots); fp32."""
    from ..testing.fuzz import FuzzCase
    gen = torch.Generator().manual_seed(seed)
    b, T, h, p, g, n = FUZZ_SHAPE
    cases = []
    for i, (slot_kind, accepted_kind) in enumerate(
            [(s, "valid") for s in SLOT_KINDS] + [("valid", a) for a in ACCEPTED_KINDS[1:]]
            + [("past-cache", "above-T")]):
        idx = _draw_slots(slot_kind, gen, b, FUZZ_SLOTS)
        acc = _draw_accepted(accepted_kind, gen, b, T)
        case = make(b, T, h, p, g, n, torch.float32, slots=FUZZ_SLOTS, indices=idx, D="h", z=True,
                    dt_bias=True, accepted=acc, seed=seed + i, device=device)
        update, rollback = plan_calls(case, backend)
        slot_bit = Status.SLOT_INDEX if any(s >= FUZZ_SLOTS for s in idx) else Status.OK
        acc_bit = Status.ACCEPTED_COUNT if any(not 0 <= a <= T for a in acc) else Status.OK
        if accepted_kind == "valid":
            cases.append(FuzzCase(f"update slots={idx}", update, slot_bit))
        cases.append(FuzzCase(f"rollback slots={idx} accepted={acc}", rollback, slot_bit | acc_bit))
    return cases
