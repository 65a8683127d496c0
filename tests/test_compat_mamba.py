"""fusedops.compat's mamba_ssm functions against mamba_ssm's own semantics, on every backend.

``SUPPORT`` states, per public function of ``fusedops.compat.mamba_ssm``, the arguments it takes
and the forms it refuses (with the reason); the tests check that table against the signatures
and the refusals, then run mamba_ssm-style calls (its tests' shapes scaled down, its dtype
mixes) through the torch and Triton backends against float64 reference formulas written here:

    dt'  = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)
    h_t  = exp(dt'_t · A) · h_{t-1} + dt'_t · x_t ⊗ B_t          (per head, B of the head's group)
    y_t  = C_t · h_t + D · x_t,   then y_t · z_t · sigmoid(z_t) = y_t · silu(z_t) when z is given

Sequence ids (``seq_idx``) follow mamba_ssm's state passing, which starts from id 0 and zeroes
the carried state wherever the id changes: the state of a row restarts from zero at every
change of id, and ``initial_states`` enters only the row's leading run of id 0 (a row whose
first id is not 0 never sees it). That is what docs/mamba2_scan.md documents for fusedops (and
``fusedops.compat.mamba_ssm`` states); the reference below implements exactly that rule.
``cu_seqlens`` resets nothing: it only selects the varlen states (mamba_ssm's rule).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from fusedops.compat import mamba_ssm as compat
from fusedops.errors import UnsupportedError, ValidationError

from helpers import BACKENDS, DEVICE

SCAN_BACKENDS = [b for b in BACKENDS if b in ("torch", "triton")]

SUPPORT = {
    "mamba_chunk_scan_combined": dict(
        supported=("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states",
                   "seq_idx", "cu_seqlens", "dt_softplus", "dt_limit", "return_final_states",
                   "return_varlen_states", "state_dtype", "backend"),
        refused={
            "return_varlen_states": "with b > 1 or without cu_seqlens (mamba_ssm asserts the "
                                    "same: varlen states are of one packed row)",
            "state_dtype": "a dtype other than fp32, bf16, fp16",
        },
        differentiable="out, final_states (not with return_varlen_states, as in mamba_ssm)"),
    "selective_state_update": dict(
        supported=("state", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus",
                   "state_batch_indices", "dt_limit", "backend"),
        refused={
            "state": "Mamba1's [b, dim, n] state (no head dim): Mamba1 is not implemented",
            "dt": "values that differ along p (per-channel dt): Mamba2 ties dt across p",
            "A": "values that differ along p or n: Mamba2's A is one scalar per head",
            "dt_bias": "values that differ along p: Mamba2's dt_bias is one scalar per head",
        },
        differentiable=None),
    "varlen_states": dict(
        supported=("x", "dt", "A", "B", "cu_seqlens", "entering", "chunk_size", "dt_bias",
                   "dt_softplus", "dt_limit"),
        refused={},
        differentiable=None),
}
"""Per compat function: the arguments it supports, the forms it refuses (argument -> why) and
which outputs are differentiable."""


def rnd(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(DEVICE, dtype)


def rel_l2(value, ref) -> float:
    value, ref = value.double(), ref.double()
    return float((value - ref).norm() / ref.norm().clamp_min(1e-30))


TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
"""Relative L2 error against float64 from the same (rounded) inputs: fp32 kernels accumulate in
fp32 (~1e-6); 16-bit runs round the products' operands and the outputs to the input dtype, as
mamba_ssm does (docs/mamba2_scan.md, Numerics)."""


# -- the float64 reference formulas ------------------------------------------------------------
def dt_transform(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    u = dt.double() + (0.0 if dt_bias is None else dt_bias.double())
    if dt_softplus:
        u = F.softplus(u)        # threshold 20, as mamba_ssm's kernels
    return torch.clamp(u, min=dt_limit[0], max=dt_limit[1])


def ssd_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                  dt_limit=(0.0, math.inf), initial_states=None, seq_idx=None):
    """The token-by-token recurrence in float64 (differentiable): (y [b, l, h, p] float64,
    final states [b, h, p, n], the state after every token [b, l, h, p, n])."""
    b, l, h, p = x.shape
    rep = h // B.shape[2]
    x64, A64 = x.double(), A.double()
    Bh, Ch = B.double().repeat_interleave(rep, 2), C.double().repeat_interleave(rep, 2)
    u = dt_transform(dt, dt_bias, dt_softplus, dt_limit)                    # [b, l, h]
    state = x64.new_zeros(b, h, p, B.shape[3])
    if initial_states is not None:
        keep = torch.ones(b, dtype=torch.float64, device=x.device) if seq_idx is None else \
            (seq_idx[:, 0] == 0).double()
        state = initial_states.double() * keep[:, None, None, None]
    ys, states = [], []
    for t in range(l):
        if seq_idx is not None and t > 0:
            state = state * (seq_idx[:, t] == seq_idx[:, t - 1]).double()[:, None, None, None]
        decay = torch.exp(u[:, t] * A64)[..., None, None]
        state = decay * state + (u[:, t, :, None, None] * x64[:, t, ..., None]
                                 * Bh[:, t, :, None, :])
        y = (state * Ch[:, t, :, None, :]).sum(-1)
        if D is not None:
            y = y + x64[:, t] * (D.double()[:, None] if D.dim() == 1 else D.double())
        ys.append(y)
        states.append(state)
    y = torch.stack(ys, 1)
    if z is not None:
        y = y * z.double() * torch.sigmoid(z.double())
    return y, state, torch.stack(states, 1)


def step_reference(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf)):
    """mamba_ssm's selective_state_update_ref for Mamba2's per-head dt and A, in float64:
    (new state, out)."""
    h = x.shape[1]
    rep = h // B.shape[1]
    u = dt_transform(dt, dt_bias, dt_softplus, dt_limit)                    # [b, h]
    Bh, Ch = B.double().repeat_interleave(rep, 1), C.double().repeat_interleave(rep, 1)
    new = (torch.exp(u * A.double())[..., None, None] * state.double()
           + u[..., None, None] * x.double()[..., None] * Bh[:, :, None, :])
    out = (new * Ch[:, :, None, :]).sum(-1)
    if D is not None:
        out = out + x.double() * (D.double()[:, None] if D.dim() == 1 else D.double())
    if z is not None:
        out = out * F.silu(z.double())
    return new, out


# -- the support table ---------------------------------------------------------------------------
def test_the_table_names_every_public_function_and_every_argument():
    """Every public function of fusedops.compat.mamba_ssm has a row, and a row's supported
    arguments are the function's parameters (a refused form is of a supported argument)."""
    public = {name for name, f in inspect.getmembers(compat, inspect.isfunction)
              if f.__module__ == compat.__name__ and not name.startswith("_")}
    assert public == set(SUPPORT)
    for name, row in SUPPORT.items():
        params = tuple(inspect.signature(getattr(compat, name)).parameters)
        assert params == row["supported"], name
        assert set(row["refused"]) <= set(params), name
        assert getattr(compat, name).__doc__, name


def _scan_inputs(b=2, l=37, h=4, p=8, g=2, n=16, dtype=torch.float32, seed=0):
    return dict(x=rnd(b, l, h, p, seed=seed, dtype=dtype), dt=rnd(b, l, h, seed=seed + 1, dtype=dtype),
                A=-torch.rand(h, generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE) - 0.5,
                B=rnd(b, l, g, n, seed=seed + 3, dtype=dtype), C=rnd(b, l, g, n, seed=seed + 4, dtype=dtype))


def _step_inputs(b=3, h=4, p=8, g=2, n=16, x_dtype=torch.float16, seed=0):
    """mamba_ssm's test_selective_state_update_with_heads (tie_hdim) at a small size: x, dt and
    z in the activation dtype, B, C, D, dt_bias fp32, dt, dt_bias, A, D expanded over p (and n)."""
    dt = rnd(b, h, seed=seed + 1, dtype=x_dtype)
    bias = torch.rand(h, generator=torch.Generator().manual_seed(seed + 2)).to(DEVICE) - 4.0
    A = -torch.rand(h, generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE) - 1.0
    D = rnd(h, seed=seed + 4)
    return dict(x=rnd(b, h, p, seed=seed, dtype=x_dtype), dt=dt[..., None].expand(b, h, p),
                A=A[:, None, None].expand(h, p, n), B=rnd(b, g, n, seed=seed + 5),
                C=rnd(b, g, n, seed=seed + 6), D=D[:, None].expand(h, p),
                z=rnd(b, h, p, seed=seed + 7, dtype=x_dtype), dt_bias=bias[:, None].expand(h, p),
                per_head=dict(dt=dt, A=A, D=D, dt_bias=bias))


@pytest.mark.parametrize("argument", ["return_varlen_states", "state_dtype", "state", "dt", "A",
                                      "dt_bias"])
def test_refused_forms_raise_naming_the_argument(argument):
    """Each refused form of the table raises its error, naming the argument."""
    t = _scan_inputs(b=2, l=20)
    core = [t[k] for k in ("x", "dt", "A", "B", "C")]
    s = _step_inputs(x_dtype=torch.float32)
    state = torch.zeros(3, 4, 8, 16, device=DEVICE)
    step = [s[k] for k in ("x", "dt", "A", "B", "C")]
    if argument == "return_varlen_states":
        cu = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
        with pytest.raises(ValidationError, match=r"^x: expected b == 1 with return_varlen_states"):
            compat.mamba_chunk_scan_combined(*core, 16, cu_seqlens=cu, return_varlen_states=True)
        with pytest.raises(ValidationError, match=r"^cu_seqlens: expected the packed sequences"):
            compat.mamba_chunk_scan_combined(*[v[:1] if v.dim() > 1 else v for v in core], 16,
                                             return_varlen_states=True)
    elif argument == "state_dtype":
        with pytest.raises(ValidationError, match=r"^state_dtype: expected None or one of .*got torch.int8"):
            compat.mamba_chunk_scan_combined(*core, 16, state_dtype=torch.int8)
    elif argument == "state":
        with pytest.raises(UnsupportedError, match=r"selective_state_update: state: expected Mamba2's"):
            compat.selective_state_update(state[:, 0], s["x"][:, 0], s["dt"][:, 0], s["A"][0],
                                          s["B"][:, 0], s["C"][:, 0])
    else:
        untied = dict(dt=rnd(3, 4, 8, seed=9), A=-torch.rand(4, 8, 16, device=DEVICE),
                      dt_bias=rnd(4, 8, seed=10))[argument]
        args = dict(zip(("x", "dt", "A", "B", "C"), step))
        kwargs = {"dt_bias": untied} if argument == "dt_bias" else {}
        if argument != "dt_bias":
            args[argument] = untied
        with pytest.raises(UnsupportedError, match=rf"selective_state_update: {argument}: expected "
                                                   r"values tied across the head dim"):
            compat.selective_state_update(state, *args.values(), **kwargs)


# -- mamba_chunk_scan_combined --------------------------------------------------------------------
SCAN_CASES = {
    # every option, dt clamped at both ends of dt_limit, initial states, final states
    "all-options": dict(D="h", z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.3, 1.2),
                        initial_states=True),
    # D per channel, raw positive dt (no softplus, no bias), no gate
    "D-per-channel": dict(D="hp", positive_dt=True),
}


def _scan_case(kind, dtype, seed=10, b=2, l=37):
    t = _scan_inputs(b=b, l=l, dtype=dtype, seed=seed)
    spec = SCAN_CASES[kind]
    h, p, n = t["x"].shape[2], t["x"].shape[3], t["B"].shape[3]
    kwargs = dict(dt_softplus=spec.get("dt_softplus", False), dt_limit=spec.get("dt_limit", (0.0, math.inf)))
    if spec.get("positive_dt"):
        t["dt"] = (t["dt"].float().abs() * 0.3 + 0.05).to(dtype)
    if spec.get("D"):
        kwargs["D"] = rnd(h, seed=seed + 5) if spec["D"] == "h" else rnd(h, p, seed=seed + 5)
    if spec.get("z"):
        kwargs["z"] = rnd(b, l, h, p, seed=seed + 6, dtype=dtype)
    if spec.get("dt_bias"):
        kwargs["dt_bias"] = rnd(h, seed=seed + 7, scale=0.5)
    if spec.get("initial_states"):
        kwargs["initial_states"] = rnd(b, h, p, n, seed=seed + 8)
    return t, kwargs


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(SCAN_CASES))
def test_chunk_scan_matches_the_recurrence(backend, dtype, kind):
    """out and final_states (fp32, as mamba_ssm returns them) against the float64 recurrence;
    with dt_limit some dt' sit on each bound."""
    t, kwargs = _scan_case(kind, dtype)
    out, final = compat.mamba_chunk_scan_combined(*t.values(), 16, **kwargs, return_final_states=True,
                                                  backend=backend)
    y, state, _ = ssd_reference(*t.values(), **kwargs)
    assert out.dtype == dtype and out.shape == t["x"].shape and final.dtype == torch.float32
    assert rel_l2(out, y) < TOLERANCE[dtype] and rel_l2(final, state) < TOLERANCE[dtype]
    if "dt_limit" in SCAN_CASES[kind]:
        u = dt_transform(t["dt"], kwargs["dt_bias"], True)
        assert (u < 0.3).any() and (u > 1.2).any()     # both bounds clamp something


SEQ_IDX = [[0] * 10 + [1] * 20 + [2] * 7,     # changes mid-chunk and at token 30
           [0] * 37,                          # one sequence: the initial state throughout
           [3] * 5 + [4] * 31 + [5]]          # first id 3: the initial state never enters


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_seq_idx_restarts_rows_and_initial_states_enter_the_leading_run_of_id_0(backend):
    """batch 3 with initial_states: every row restarts from zero where its id changes; row 1
    (all id 0) carries its initial state to the end, row 2 (ids from 3) never sees it; y and
    final_states against the float64 recurrence with that rule, and against each sequence run
    on its own."""
    t, kwargs = _scan_case("all-options", torch.float32, seed=20, b=3)
    seq_idx = torch.tensor(SEQ_IDX, dtype=torch.int32, device=DEVICE)
    out, final = compat.mamba_chunk_scan_combined(*t.values(), 16, **kwargs, seq_idx=seq_idx,
                                                  return_final_states=True, backend=backend)
    y, state, _ = ssd_reference(*t.values(), **kwargs, seq_idx=seq_idx)
    assert rel_l2(out, y) < 1e-4 and rel_l2(final, state) < 1e-4
    # the rule, spelled out: row 0's second sequence is a fresh run from zero ...
    rest = {k: v for k, v in kwargs.items() if k != "initial_states"}
    piece = {k: v[:1, 10:30] for k, v in t.items() if k != "A"}
    alone = compat.mamba_chunk_scan_combined(piece["x"], piece["dt"], t["A"], piece["B"], piece["C"], 16,
                                             **dict(rest, z=rest["z"][:1, 10:30]), backend=backend)
    assert rel_l2(out[:1, 10:30], alone) < 1e-4
    # ... and row 2 equals the same row with no initial state at all
    no_init = compat.mamba_chunk_scan_combined(*[v[2:] if v.dim() > 1 else v for v in t.values()], 16,
                                               **dict(rest, z=rest["z"][2:]), seq_idx=seq_idx[2:],
                                               backend=backend)
    assert rel_l2(out[2:], no_init) < 1e-5
    # int64 ids (what torch.arange-based code produces) are taken as well
    out64 = compat.mamba_chunk_scan_combined(*t.values(), 16, **kwargs, seq_idx=seq_idx.long(),
                                             backend=backend)
    assert torch.equal(out64, out)


CU = [0, 5, 21, 26, 37]
"""Packed sequences (chunk 16): one inside chunk 0, one across chunks 0-1, one inside chunk 1
starting mid-chunk, one across chunks 1-2."""


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("state_dtype", [None, torch.float32, torch.bfloat16], ids=["default", "fp32", "bf16"])
def test_cu_seqlens_selects_varlen_states_and_resets_nothing(backend, state_dtype):
    """b = 1, packed with seq_idx changing at the cu_seqlens offsets: out as the recurrence that
    restarts at each offset, varlen_states [nseq, h, p, n] the sequences' final states in
    state_dtype (default C's dtype, bf16 here); the same cu_seqlens without seq_idx resets
    nothing (out equals the unpacked run), and without return_varlen_states it is not read."""
    t = _scan_inputs(b=1, l=37, dtype=torch.bfloat16, seed=30)
    kw = dict(D=rnd(4, seed=35), dt_bias=rnd(4, seed=36, scale=0.5), dt_softplus=True)
    cu = torch.tensor(CU, dtype=torch.int32, device=DEVICE)
    seq_idx = torch.repeat_interleave(torch.arange(4, device=DEVICE, dtype=torch.int32),
                                      torch.diff(cu))[None]
    out, final, states = compat.mamba_chunk_scan_combined(
        *t.values(), 16, **kw, seq_idx=seq_idx, cu_seqlens=cu, return_final_states=True,
        return_varlen_states=True, state_dtype=state_dtype, backend=backend)
    y, _, every = ssd_reference(*t.values(), **kw, seq_idx=seq_idx)
    ends = every[0, cu[1:] - 1]                                            # [nseq, h, p, n]
    assert states.dtype == (state_dtype or torch.bfloat16) and states.shape == ends.shape
    assert rel_l2(out, y) < TOLERANCE[torch.bfloat16]
    assert rel_l2(states, ends) < TOLERANCE[torch.bfloat16]
    assert rel_l2(final, ends[-1:]) < TOLERANCE[torch.bfloat16]
    assert not out.requires_grad                       # mamba_ssm: no backward with varlen states
    plain = compat.mamba_chunk_scan_combined(*t.values(), 16, **kw, backend=backend)
    unread = compat.mamba_chunk_scan_combined(*t.values(), 16, **kw, cu_seqlens=cu, backend=backend)
    assert torch.equal(unread, plain)
    no_reset, _ = compat.mamba_chunk_scan_combined(*t.values(), 16, **kw, cu_seqlens=cu,
                                                   return_varlen_states=True, backend=backend)
    assert torch.equal(no_reset, plain)


def test_varlen_states_clamps_any_offsets():
    """varlen_states reads offsets clamped into [0, l]: offsets past the tokens or decreasing
    give finite states (a sequence emptied by the clamp: zero), nothing out of bounds."""
    t = _scan_inputs(b=1, l=20, seed=40)
    entering = rnd(2, 4, 8, 16, seed=41)
    cu = torch.tensor([0, 12, 7, 50], dtype=torch.int32, device=DEVICE)
    states = compat.varlen_states(t["x"], t["dt"].abs(), t["A"], t["B"], cu, entering, 16)
    assert states.shape == (3, 4, 8, 16) and torch.isfinite(states).all()
    assert not states[1].any()                                  # [12, 7): empty
    valid = compat.varlen_states(t["x"], t["dt"].abs(), t["A"], t["B"],
                                 torch.tensor([0, 12, 12, 20], dtype=torch.int32, device=DEVICE),
                                 entering, 16)
    assert torch.equal(states, valid)


def test_gradcheck_float64_through_the_drop_in():
    """out and final_states differentiate for x, dt, A, B, C, D, z, dt_bias and initial_states
    (torch backend, float64), with seq_idx over a batch of 2."""
    b, l, h, p, g, n = 2, 18, 2, 2, 1, 2
    gen = torch.Generator().manual_seed(50)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEVICE).requires_grad_()
    args = [leaf(b, l, h, p), leaf(b, l, h, scale=0.5), (-torch.rand(h, generator=gen, dtype=torch.float64)
                                                         - 0.5).to(DEVICE).requires_grad_(),
            leaf(b, l, g, n), leaf(b, l, g, n), leaf(h), leaf(b, l, h, p), leaf(h, scale=0.5), leaf(b, h, p, n)]
    seq_idx = torch.tensor([[0] * 10 + [1] * 8, [0] * 18], dtype=torch.int32, device=DEVICE)

    def run(x, dt, A, B, C, D, z, dt_bias, initial_states):
        return compat.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D=D, z=z, dt_bias=dt_bias,
                                                initial_states=initial_states, seq_idx=seq_idx,
                                                dt_softplus=True, return_final_states=True,
                                                backend="torch")
    assert torch.autograd.gradcheck(run, args, fast_mode=True)


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_gradients_match_the_recurrence(backend):
    """Every gradient (through out and final_states, seq_idx with initial states, fp32) is
    finite and within 1e-3 (relative L2) of autograd through the float64 recurrence."""
    t, kwargs = _scan_case("all-options", torch.float32, seed=60, b=3)
    seq_idx = torch.tensor(SEQ_IDX, dtype=torch.int32, device=DEVICE)
    leaves = {k: v.clone().requires_grad_() for k, v in {**t, **kwargs}.items()
              if isinstance(v, torch.Tensor)}
    options = dict(dt_softplus=True, dt_limit=kwargs["dt_limit"])
    core = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
    extra = {k: leaves[k] for k in ("D", "z", "dt_bias", "initial_states")}
    out, final = compat.mamba_chunk_scan_combined(*core, 16, **extra, **options, seq_idx=seq_idx,
                                                  return_final_states=True, backend=backend)
    dy, dfinal = rnd(*out.shape, seed=61), rnd(*final.shape, seed=62)
    got = torch.autograd.grad((out * dy).sum() + (final * dfinal).sum(), list(leaves.values()))
    y, state, _ = ssd_reference(*core, **extra, **options, seq_idx=seq_idx)
    expected = torch.autograd.grad((y * dy.double()).sum() + (state * dfinal.double()).sum(),
                                   list(leaves.values()))
    for name, value, ref in zip(leaves, got, expected):
        assert torch.isfinite(value).all(), name
        assert rel_l2(value, ref) < 1e-3, name


# -- selective_state_update -------------------------------------------------------------------------
STEP_DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16),
               (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
               (torch.bfloat16, torch.float32)]
STEP_TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
"""Relative L2 against float64 by the coarser of x's and the state's dtype: the kernels keep
the state in fp32 within a step and round it once when they store it, and y once."""


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
@pytest.mark.parametrize("x_dtype,state_dtype", STEP_DTYPES,
                         ids=[f"x-{str(a)[6:]}-state-{str(s)[6:]}" for a, s in STEP_DTYPES])
def test_state_update_takes_mamba_dtype_mixes_and_expanded_views(backend, x_dtype, state_dtype):
    """mamba_ssm's call: x, dt, z in the activation dtype, B, C, D, dt_bias fp32, dt [b, h, p]
    and dt_bias, D [h, p] expanded over p (stride 0), A [h, p, n] expanded over p and n, the
    state in fp32 or the activation dtype, updated in place; against mamba_ssm's reference
    formula in float64."""
    s = _step_inputs(x_dtype=x_dtype, seed=70)
    state = rnd(3, 4, 8, 16, seed=71, dtype=state_dtype)
    before = state.clone()
    out = compat.selective_state_update(state, s["x"], s["dt"], s["A"], s["B"], s["C"], D=s["D"],
                                        z=s["z"], dt_bias=s["dt_bias"], dt_softplus=True, backend=backend)
    ph = s["per_head"]
    new, ref = step_reference(before, s["x"], ph["dt"], ph["A"], s["B"], s["C"], D=ph["D"], z=s["z"],
                              dt_bias=ph["dt_bias"], dt_softplus=True)
    tol = max(STEP_TOLERANCE[x_dtype], STEP_TOLERANCE[state_dtype])
    assert out.dtype == x_dtype and out.shape == s["x"].shape and state.dtype == state_dtype
    assert rel_l2(state, new) < tol and rel_l2(out, ref) < tol


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_state_update_per_channel_D_dt_limit_and_slot_pool(backend):
    """D [h, p] with a value per channel, dt_limit clamping, and state_batch_indices into a pool
    of 5 slots with a padding row (-1): out of the padding row 0, only the two named slots
    change, each to the reference; B, C [b, n] (mamba_ssm's one-group form) as [b, 1, n]; x and
    z as slices of a token's projection give the bits of contiguous copies."""
    s = _step_inputs(x_dtype=torch.float32, seed=80)
    D = rnd(4, 8, seed=81)
    pool = rnd(5, 4, 8, 16, seed=82)
    before = pool.clone()
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=DEVICE)
    kw = dict(D=D, dt_bias=s["dt_bias"], dt_softplus=True, dt_limit=(0.02, 0.05))
    projection = torch.full((3, 80), float("nan"), device=DEVICE)    # a token's [z, x, padding]
    z, x = projection[:, :32].unflatten(1, (4, 8)), projection[:, 32:64].unflatten(1, (4, 8))
    z.copy_(s["z"])
    x.copy_(s["x"])
    out = compat.selective_state_update(pool, x, s["dt"], s["A"], s["B"], s["C"], z=z, **kw,
                                        state_batch_indices=slots, backend=backend)
    ph = s["per_head"]
    assert (dt_transform(ph["dt"], ph["dt_bias"], True) > 0.05).any()
    new, ref = step_reference(before[[4, 4, 1]], s["x"], ph["dt"], ph["A"], s["B"], s["C"], D=D, z=s["z"],
                              dt_bias=ph["dt_bias"], dt_softplus=True, dt_limit=(0.02, 0.05))
    assert not out[1].any()
    for row, slot in ((0, 4), (2, 1)):
        assert rel_l2(pool[slot], new[row]) < 1e-5 and rel_l2(out[row], ref[row]) < 1e-5
    for slot in (0, 2, 3):
        assert torch.equal(pool[slot], before[slot])
    one_group = before.clone()                # mamba_ssm's B, C [b, n]: one group
    expected = before.clone()
    single = compat.selective_state_update(one_group, s["x"], s["dt"], s["A"], s["B"][:, 0], s["C"][:, 0],
                                           **kw, backend=backend)
    grouped = compat.selective_state_update(expected, s["x"], s["dt"], s["A"], s["B"][:, :1], s["C"][:, :1],
                                            **kw, backend=backend)
    assert torch.equal(single, grouped) and torch.equal(one_group, expected)
    again = before.clone()
    dense = compat.selective_state_update(again, s["x"].clone(), s["dt"], s["A"], s["B"], s["C"],
                                          z=s["z"].clone(), **kw, state_batch_indices=slots, backend=backend)
    assert torch.equal(dense, out) and torch.equal(again, pool)


@pytest.mark.parametrize("backend", SCAN_BACKENDS)
def test_state_update_steps_continue_the_chunked_scan(backend):
    """A prefill by mamba_chunk_scan_combined (final_states) followed by selective_state_update
    steps gives what one scan over all tokens gives (mamba_ssm's prefill-then-decode)."""
    t, kwargs = _scan_case("all-options", torch.float32, seed=90, b=2, l=20)
    kwargs.pop("initial_states")
    y = compat.mamba_chunk_scan_combined(*t.values(), 16, **kwargs, backend=backend)
    prefix = {k: (v[:, :17] if v.dim() > 1 else v) for k, v in t.items()}
    _, state = compat.mamba_chunk_scan_combined(*prefix.values(), 16, **dict(kwargs, z=kwargs["z"][:, :17]),
                                                return_final_states=True, backend=backend)
    h, p, n = 4, 8, 16
    for i in range(17, 20):
        out = compat.selective_state_update(
            state, t["x"][:, i], t["dt"][:, i, :, None].expand(2, h, p), t["A"][:, None, None].expand(h, p, n),
            t["B"][:, i], t["C"][:, i], D=kwargs["D"], z=kwargs["z"][:, i], dt_bias=kwargs["dt_bias"],
            dt_softplus=True, dt_limit=kwargs["dt_limit"], backend=backend)
        assert rel_l2(out, y[:, i]) < 1e-4, i
