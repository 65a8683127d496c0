"""Sample inputs of the MoE family, and router forward, experts forward and backward, router
backward through its plans (for the tests, the demo, the AOT compiles and the benchmark)."""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype
from ..core.status import STATUS_DTYPE, Status
from ..opinfo import Case, PlanCall
from .plans import MoERouter, MoERouterBackward, ReLU2MoEBackward, ReLU2MoEForward

ROUTER_OPTIONS = ("top_k", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
ROUTER_BACKWARD_OPTIONS = ("norm_topk_prob", "routed_scaling_factor")
SHARED = ("shared_w_up", "shared_w_down")

# (t, H, E, k, I, I_shared) of the demonstration: small on the CPU, Nemotron 3 Nano on a GPU
DEMO_CPU = {"torch": (256, 256, 16, 4, 384, 256), "triton": (48, 64, 6, 2, 96, 64)}
DEMO_GPU = (4096, 2688, 128, 6, 1856, 3712)


def router_logits(t: int, E: int, *, bias: bool, seed: int = 0, dtype=torch.float32,
                  device="cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [t, E] = 2 N(0, 1) in ``dtype``, correction bias [E] = 0.2 N(0, 1) fp32 or
    None)."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, E, generator=gen) * 2).to(device, dtype)
    b = (torch.randn(E, generator=gen) * 0.2).to(device) if bias else None
    return logits, b


def expert_inputs(t: int, H: int, E: int, I: int, k: int, *, shared: int = 0,
                  dtype=torch.float32, seed: int = 0, device="cpu") -> dict[str, torch.Tensor]:
    """Inputs of the expert path alone: x, w_up (N(0, 1/H)), w_down (N(0, 1/I)), topk_ids (k
    distinct random experts per token), topk_weights (in [0.1, 1.1)), d_out and, with
    ``shared``, a shared expert of that width."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    case = dict(x=r(t, H), w_up=r(E, I, H) / H ** 0.5, w_down=r(E, H, I) / I ** 0.5,
                topk_ids=torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)]).int(),
                topk_weights=torch.rand(t, k, generator=gen) + 0.1, d_out=r(t, H))
    if shared:
        case.update(shared_w_up=r(shared, H) / H ** 0.5, shared_w_down=r(H, shared) / shared ** 0.5)
    wdt = accumulator_dtype(dtype)
    return {n: v.to(device, torch.int32 if n == "topk_ids" else (wdt if n == "topk_weights" else dtype))
            for n, v in case.items()}


def separated_logits(t: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[t, E]: per token a random permutation of E levels evenly spaced in [-2, 2], so the
    sigmoid scores differ by far more than an fp32 rounding and every dtype selects alike."""
    levels = torch.linspace(-2.0, 2.0, E) if E > 1 else torch.zeros(1)
    return torch.stack([levels[torch.randperm(E, generator=gen)] for _ in range(t)])


def make(t: int, H: int, E: int, I: int, k: int, *, shared: int = 0, dtype=torch.float32,
         seed: int = 0, device="cpu", bias: bool = True, n_group: int = 1, topk_group: int = 1,
         norm_topk_prob: bool = True, routed_scaling_factor: float = 2.5,
         favourite: int | None = None) -> Case:
    """A router + experts case: x, the expert weights and d_out in ``dtype``; logits
    (``separated_logits``; +5 on expert ``favourite``, which every token then selects) and a
    correction bias (0.01 N(0, 1)) in fp32 (float64 for float64)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x, w_up, w_down, d_out = r(t, H), r(E, I, H) / H ** 0.5, r(E, H, I) / I ** 0.5, r(t, H)
    su, sd = (r(shared, H) / H ** 0.5, r(H, shared) / shared ** 0.5) if shared else (None, None)
    logits = separated_logits(t, E, gen)
    if favourite is not None:
        logits[:, favourite] += 5.0
    b = r(E) * 0.01 if bias else None
    acc = accumulator_dtype(dtype)

    def low(v):
        return None if v is None else v.to(device, dtype)
    tensors = dict(x=low(x), logits=logits.to(device, acc),
                   correction_bias=None if b is None else b.to(device, acc),
                   w_up=low(w_up), w_down=low(w_down), shared_w_up=low(su), shared_w_down=low(sd),
                   d_out=low(d_out))
    label = (f"t={t} H={H} E={E} k={k} I={I}{f' +shared {shared}' if shared else ''}"
             f"{f' groups {topk_group}/{n_group}' if n_group > 1 else ''} "
             f"{str(dtype).removeprefix('torch.')}")
    return Case(label, tensors, dict(top_k=k, n_group=n_group, topk_group=topk_group,
                                     norm_topk_prob=norm_topk_prob,
                                     routed_scaling_factor=routed_scaling_factor))


def make_router(t: int, E: int, k: int, *, dtype=torch.float32, seed: int = 0, device="cpu",
                n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                routed_scaling_factor: float = 2.5) -> Case:
    """A router-only case: logits (``separated_logits``) and a correction bias (0.01 N(0, 1)) in
    the router's dtype (fp32; float64 for float64) and d_topk_weights [t, k] (N(0, 1)), which
    ``run`` hands to the router's backward; no expert weights (``is_router_case``)."""
    gen = torch.Generator().manual_seed(seed)
    logits = separated_logits(t, E, gen)
    bias, d_weights = torch.randn(E, generator=gen) * 0.01, torch.randn(t, k, generator=gen)
    acc = accumulator_dtype(dtype)
    label = (f"router t={t} E={E} k={k}{f' groups {topk_group}/{n_group}' if n_group > 1 else ''}"
             f" {str(acc).removeprefix('torch.')}")
    return Case(label, dict(logits=logits.to(device, acc), correction_bias=bias.to(device, acc),
                            d_topk_weights=d_weights.to(device, acc)),
                dict(top_k=k, n_group=n_group, topk_group=topk_group,
                     norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor))


def is_router_case(case: Case) -> bool:
    """Whether ``case`` exercises the router alone (``make_router``: no expert weights)."""
    return case.tensors.get("x") is None


def tiles(dtype=torch.bfloat16, device="cpu") -> list[Case]:
    """The production tiles (``production()``) on problems small enough for the PTX emulator.
    The routed row tile follows the mean rows per expert (t·k / E: 128 from 96 on, 16 below
    24), the shared expert's dense row tile the token count (128 from 65 tokens, 64 from 33),
    the column and K tiles H, I and the shared width (128 columns from 65, K steps of 64 from
    33; at 16-row tiles 64 columns from 33 and K steps of 128 from 65), the combine's columns
    H (256 from 129) and the router's tokens per program E (8, 4, 2 at E = 128, 256, 512):

    - 96 tokens to both of 2 experts (96 rows each: one ragged 128-row tile per expert) with
      a 128-wide shared expert (one ragged 128-row dense tile): every 128 x 128 GEMM of the
      forward and backward (K steps of 64 over H = 192; relu(u)²'s 32 over I = 96), the
      weight gradients' 128 x 128 tiles, split over K past 64 rows (the split table and the
      fp32 slots), the shared expert's two weight gradients in one launch;
    - 40 tokens to 2 of 8 experts (decode-sized: 16-row tiles, products transposed; 7 to 17
      rows an expert, the 17th a tile of its own) with a 128-wide shared expert (64-row dense
      tiles), H = 128;
    - 144 tokens to 2 of 3 experts, every token to expert 1 (144 rows: two row tiles, the
      second of 16), no shared expert (the combine, 256 columns over H = 192);
    - the router alone (``make_router``: E = 128 and 512, no experts there: a grid of E·15
      padded rows takes minutes to emulate) at Nano's E = 128, k = 6 (13 tokens), Super's
      E = 512, k = 22 (5 tokens) and the grouped E = 256, k = 8, top 4 of 8 groups (7
      tokens), each with a bias: its forward and backward, the last program ragged.

    I = 96: every up GEMM's single column tile and the weight gradients' rows ragged (I =
    1856 leaves production's last column tile half full)."""
    c = dict(dtype=dtype, device=device)
    return [make(96, 192, 2, 96, 2, shared=128, seed=40, **c),
            make(40, 128, 8, 96, 2, shared=128, seed=44, **c),
            make(144, 192, 3, 96, 2, favourite=1, seed=42, **c),
            make_router(13, 128, 6, seed=45, **c),
            make_router(5, 512, 22, seed=46, **c),
            make_router(7, 256, 8, n_group=8, topk_group=4, seed=47, **c)]


def cases(kind: str, *, dtype=torch.float32, device="cpu", backend: str = "torch") -> list[Case]:
    """small: oracle shapes (with and without a shared expert, a bias, grouping and the
    normalisation); edge: t = 1 with k = E = 1, k = E = 5, every token to one expert (17 rows:
    one more than a row tile), two dispatch blocks (260 assignments); tiles: the production
    tiles on small problems (``tiles``); demo: the demonstration's shape for ``backend`` (small
    ones on the CPU)."""
    c = dict(dtype=dtype, device=device)
    if kind == "small":
        return [make(8, 16, 4, 24, 2, shared=8, **c),
                make(19, 32, 6, 48, 2, shared=40, seed=4, **c),
                make(13, 16, 12, 24, 3, n_group=4, topk_group=2, seed=5, **c),
                make(9, 32, 8, 16, 1, bias=False, norm_topk_prob=False, seed=6, **c)]
    if kind == "edge":
        return [make(1, 16, 1, 24, 1, seed=7, **c),
                make(6, 16, 5, 24, 5, shared=8, seed=8, **c),
                make(17, 16, 4, 24, 2, favourite=3, seed=9, **c),
                make(130, 16, 6, 16, 2, seed=10, **c)]
    if kind == "tiles":
        return tiles(dtype, device)
    if kind == "demo":
        on_cpu = torch.device(device).type == "cpu"
        t, H, E, k, I, S = DEMO_CPU.get(backend, DEMO_CPU["torch"]) if on_cpu else DEMO_GPU
        return [make(t, H, E, I, k, shared=S, bias=False, seed=3, **c)]
    raise ValueError(f"kind: expected small, edge, tiles or demo, got {kind!r}")


def production() -> list[tuple[str, list[PlanCall]]]:
    """The routers of Nemotron 3 Nano (E=128, k=6), Super (E=512, k=22) and a DeepSeek-style
    grouped one (E=256, 8 groups, top-4 groups, k=8), fp32 logits with a bias; the experts at
    Nano shapes (H=2688, E=128, k=6, I=1856, shared 3712) for t=8192 (row tile 128) and t=64
    (decode-sized, tile 16, forward only, also for inference) and at Super's (latent 1024,
    E=512, k=22, I=2688, t=8192); bf16, as TensorDescs on the CPU. The Nano router backward
    and the Nano t=8192 experts take a status word (the reporting compiled in), the others
    none."""
    def desc(shape, dtype=torch.bfloat16):
        return TensorDesc(shape, dtype, device="cpu")
    out = []
    t = 8192
    status = desc((1,), torch.int32)
    for label, E, k, groups, top_groups in (("nano E128 k6", 128, 6, 1, 1),
                                            ("super E512 k22", 512, 22, 1, 1),
                                            ("grouped E256 k8 g8/4", 256, 8, 8, 4)):
        logits = desc((t, E), torch.float32)
        word = status if label.startswith("nano") else None
        out.append((f"router {label}", [
            PlanCall(MoERouter, dict(logits=logits, correction_bias=desc((E,), torch.float32)),
                     dict(top_k=k, n_group=groups, topk_group=top_groups,
                          routed_scaling_factor=2.5)),
            PlanCall(MoERouterBackward, dict(logits=logits, topk_ids=desc((t, k), torch.int32),
                                             d_topk_weights=desc((t, k), torch.float32),
                                             status=word),
                     dict(routed_scaling_factor=2.5))]))
    for label, t, H, E, k, I, S, backward in (("nano t8192", 8192, 2688, 128, 6, 1856, 3712, True),
                                              ("nano t64", 64, 2688, 128, 6, 1856, 3712, False),
                                              ("super t8192", 8192, 1024, 512, 22, 2688, 0, True)):
        experts = dict(x=desc((t, H)), w_up=desc((E, I, H)), w_down=desc((E, H, I)),
                       topk_ids=desc((t, k), torch.int32), topk_weights=desc((t, k), torch.float32),
                       shared_w_up=desc((S, H)) if S else None,
                       shared_w_down=desc((H, S)) if S else None,
                       status=status if label == "nano t8192" else None)
        calls = [PlanCall(ReLU2MoEForward, experts)]
        if not backward:
            calls.append(PlanCall(ReLU2MoEForward, experts, dict(is_inference=True)))
        if backward:
            calls.append(PlanCall(ReLU2MoEBackward, dict(experts, d_out=experts["x"]),
                                  dict(accumulate=True)))
        out.append((f"moe {label}", calls))
    return out


def _execute(plan, tensors) -> dict[str, torch.Tensor]:
    """Executes a compiled plan on ``tensors`` (by name) with freshly allocated outputs and
    workspace; returns the outputs by name."""
    outputs = plan.allocate_outputs()
    args = {o.name: tensors.get(o.name) for o in plan.operands if o.is_read}
    plan.execute(**args, **outputs, workspace=plan.allocate_workspace())
    return outputs


def _status(device) -> torch.Tensor:
    """A zeroed status word on ``device``."""
    return torch.zeros(1, dtype=STATUS_DTYPE, device=device)


def _expert_tensors(t, weights, ids) -> dict:
    return dict(x=t["x"], w_up=t["w_up"], w_down=t["w_down"], topk_ids=ids, topk_weights=weights,
                **{n: t.get(n) for n in SHARED})


def plan_calls(case: Case, backend: str) -> list[PlanCall]:
    """The four plans of ``case`` in INFO.plans order: the router (run on ``backend`` for the
    experts' ids and weights), the experts' forward (run for the backward's saved buffer), the
    experts' backward, and the router's backward (with a fixed d_topk_weights); the three that
    read topk_ids with a status word each. A router-only case: the router and its backward
    (with the case's d_topk_weights)."""
    t, o = case.tensors, case.options
    device = t["logits"].device
    router = PlanCall(MoERouter, dict(logits=t["logits"], correction_bias=t.get("correction_bias")),
                      {n: o[n] for n in ROUTER_OPTIONS})
    routed = _execute(router.build(backend).compile(), router.tensors)
    if is_router_case(case):
        return [router, PlanCall(MoERouterBackward,
                                 dict(logits=t["logits"], topk_ids=routed["topk_ids"],
                                      d_topk_weights=t["d_topk_weights"], status=_status(device)),
                                 {n: o[n] for n in ROUTER_BACKWARD_OPTIONS})]
    experts = _expert_tensors(t, routed["topk_weights"], routed["topk_ids"])
    forward = PlanCall(ReLU2MoEForward, dict(experts, status=_status(device)))
    saved = _execute(forward.build(backend).compile(), forward.tensors)["saved"]
    backward = PlanCall(ReLU2MoEBackward, dict(experts, d_out=t["d_out"], saved=saved,
                                               status=_status(device)))
    weights = routed["topk_weights"]
    d_weights = torch.linspace(-1.0, 1.0, weights.numel(), dtype=weights.dtype,
                               device=weights.device).reshape(weights.shape)
    router_backward = PlanCall(
        MoERouterBackward, dict(logits=t["logits"], topk_ids=routed["topk_ids"],
                                d_topk_weights=d_weights, status=_status(device)),
        {n: o[n] for n in ROUTER_BACKWARD_OPTIONS})
    return [router, forward, backward, router_backward]


def run(case: Case, backend: str) -> dict[str, torch.Tensor]:
    """Router forward, experts forward and backward, router backward (with the experts'
    d_topk_weights) through the plans with caller-allocated buffers; returns topk_weights,
    topk_ids, out, d_x, d_topk_weights, d_w_up, d_w_down (d_shared_w_up, d_shared_w_down) and
    d_logits. A router-only case: the router and its backward (with the case's d_topk_weights);
    returns topk_weights, topk_ids and d_logits."""
    t, o = case.tensors, case.options
    bias = t.get("correction_bias")
    router = MoERouter(t["logits"], correction_bias=bias, backend=backend,
                       **{n: o[n] for n in ROUTER_OPTIONS}).compile()
    routed = _execute(router, t)
    if is_router_case(case):
        router_backward = MoERouterBackward(t["logits"], routed["topk_ids"], t["d_topk_weights"],
                                            backend=backend,
                                            **{n: o[n] for n in ROUTER_BACKWARD_OPTIONS}).compile()
        d_logits = _execute(router_backward, dict(t, topk_ids=routed["topk_ids"]))["d_logits"]
        return dict(topk_weights=routed["topk_weights"], topk_ids=routed["topk_ids"],
                    d_logits=d_logits)
    experts = _expert_tensors(t, routed["topk_weights"], routed["topk_ids"])
    shared = {n: experts[n] for n in SHARED}
    names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
    forward = ReLU2MoEForward(*(experts[n] for n in names), **shared, backend=backend).compile()
    out = _execute(forward, experts)
    backward = ReLU2MoEBackward(*(experts[n] for n in names), t["d_out"], **shared,
                                backend=backend).compile()
    grads = _execute(backward, dict(experts, d_out=t["d_out"], saved=out["saved"]))
    router_backward = MoERouterBackward(t["logits"], routed["topk_ids"], grads["d_topk_weights"],
                                        backend=backend,
                                        **{n: o[n] for n in ROUTER_BACKWARD_OPTIONS}).compile()
    d_logits = _execute(router_backward, dict(t, topk_ids=routed["topk_ids"],
                                              d_topk_weights=grads["d_topk_weights"]))["d_logits"]
    return dict(topk_weights=routed["topk_weights"], topk_ids=routed["topk_ids"], out=out["out"],
                **grads, d_logits=d_logits)


# -- index-data fuzzing (docs/plans.md, "Index data") ----------------------------------------------
FUZZ_SHAPE = (12, 16, 5, 24, 3, 8)      # t, H, E, I, k, I_shared: small, the interpreter is slow
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _fuzz_draws(seed: int, t: int, E: int, k: int):
    """(label, topk_ids [t, k] int32, expected Status) draws: valid ids (some -1 padding), then
    ids past E, negative ids, the int32 extremes and a mix, each in a few random slots."""
    gen = torch.Generator().manual_seed(seed)
    valid = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(t)]).int()
    draws = [("valid ids", valid, Status.OK)]
    padded = valid.clone()
    padded[torch.rand(t, k, generator=gen) < 0.3] = -1
    padded[0] = -1                                   # a token with no routed expert at all
    draws.append(("valid ids with -1 padding", padded, Status.OK))
    bad_values = {"ids past E": lambda n: E + torch.randint(0, 40, (n,), generator=gen),
                  "negative ids": lambda n: -torch.randint(2, 40, (n,), generator=gen),
                  "int32 extremes": lambda n: torch.tensor([INT32_MIN, INT32_MAX, E])[
                      torch.randint(0, 3, (n,), generator=gen)],
                  "mixed": lambda n: torch.randint(-2 * E, 2 * E, (n,), generator=gen)}
    for label, values in bad_values.items():
        ids = padded.clone()
        where = torch.rand(t, k, generator=gen) < 0.35
        where[1, 0] = True                           # at least one bad id in each draw
        bad = values(int(where.sum()))
        if label == "mixed":
            bad[0] = E                               # one out of range for sure
        ids[where] = bad.int()
        draws.append((label, ids, Status.EXPERT_ID))
    return draws


def fuzz_cases(seed: int, backend: str, device, *, plans: tuple[str, ...]) -> list:
    """FuzzCases of the MoE plans that read topk_ids (``plans``: any of "forward", "inference",
    "backward", "router_backward") on the ``_fuzz_draws``: the dropped assignments' routing
    weights and d_topk_weights are NaN (never read); the backward's saved buffer comes from
    running the forward on ``backend`` with the same ids."""
    from ..testing.fuzz import FuzzCase     # here: ``import fusedops`` does not load the testing kit
    t, H, E, I, k, S = FUZZ_SHAPE
    base = expert_inputs(t, H, E, I, k, shared=S, seed=seed, device=device)
    logits = router_logits(t, E, bias=False, seed=seed, device=device)[0]
    cases = []
    for label, ids, expected in _fuzz_draws(seed, t, E, k):
        ids = ids.to(device)
        dropped = (ids < 0) | (ids >= E)
        weights = base["topk_weights"].masked_fill(dropped, float("nan"))
        experts = dict(_expert_tensors(base, weights, ids))
        if "forward" in plans:
            cases.append(FuzzCase(f"forward, {label}", PlanCall(ReLU2MoEForward, experts), expected))
        if "inference" in plans:
            cases.append(FuzzCase(f"inference forward, {label}",
                                  PlanCall(ReLU2MoEForward, experts, dict(is_inference=True)),
                                  expected))
        if "backward" in plans:
            forward = ReLU2MoEForward(*(experts[n] for n in ("x", "w_up", "w_down", "topk_ids",
                                                               "topk_weights")),
                                      **{n: experts[n] for n in SHARED}, backend=backend).compile()
            saved = _execute(forward, experts)["saved"]
            cases.append(FuzzCase(f"backward, {label}", PlanCall(
                ReLU2MoEBackward, dict(experts, d_out=base["d_out"], saved=saved)), expected))
        if "router_backward" in plans:
            d_weights = torch.linspace(-1.0, 1.0, t * k, device=device).reshape(t, k)
            cases.append(FuzzCase(f"router backward, {label}", PlanCall(
                MoERouterBackward, dict(logits=logits, topk_ids=ids,
                                        d_topk_weights=d_weights.masked_fill(dropped, float("nan"))),
                dict(routed_scaling_factor=2.5)), expected))
    return cases


def index_fuzz(seed: int, backend: str, device) -> list:
    """The registry's fuzz cases (``OpInfo.index_fuzz``): the experts' inference forward and the
    router's backward on every backend, and on the torch backend also the experts' training
    forward and backward. A kernel backend's training forward writes, and its backward reads,
    an opaque ``saved`` buffer of its own layout, which the fuzz test would compare with (or
    hand to) the torch backend's empty one: tests/relu2_moe/test_math.py fuzzes those two per backend
    (``fuzz_cases``) under the same guard bands."""
    extra = ("forward", "backward") if backend == "torch" else ()
    return fuzz_cases(seed, backend, device, plans=("inference", "router_backward") + extra)
