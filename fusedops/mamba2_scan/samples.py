"""Sample inputs of the chunked scan, and forward + backward through its plans (for the tests,
the demo, the AOT compiles and the benchmark)."""

from __future__ import annotations

import torch

from ..core.desc import TensorDesc
from ..core.dtypes import accumulator_dtype
from ..core.status import STATUS_DTYPE, Status
from ..opinfo import Case, PlanCall
from .contract import DEFAULT_DT_LIMIT
from .plans import Mamba2ChunkScanBackward, Mamba2ChunkScanForward

OPTIONAL = ("D", "z", "dt_bias", "initial_states", "cu_seqlens")
_FORWARD_TENSORS = ("x", "dt", "A", "B", "C", *OPTIONAL)


def make(b: int, l: int, h: int, p: int, g: int, n: int, dtype=torch.float32, *, seed: int = 0,
         device="cpu", D: str | None = None, z: bool = False, dt_bias: bool = False,
         initial_states: bool = False, lengths=None, dfinal: bool = False, chunk: int = 16,
         dt_softplus: bool = True, dt_limit=DEFAULT_DT_LIMIT,
         recompute_states: bool = False) -> Case:
    """Random inputs of one problem: x, dt, B, C, dy N(0, 1), A = -0.5 - U[0, 1); D ("h": [h],
    "hp": [h, p]), z, dt_bias (0.5 N(0, 1)), initial_states and dfinal_states when asked;
    ``lengths``: packed sequences (b = 1, cu_seqlens). Options: chunk_size, dt_softplus,
    dt_limit, recompute_states."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    wdt = accumulator_dtype(dtype)
    t = dict(x=rnd(b, l, h, p).to(device, dtype), dt=rnd(b, l, h).to(device, dtype),
             A=(-0.5 - torch.rand(h, generator=gen)).to(device, wdt),
             B=rnd(b, l, g, n).to(device, dtype), C=rnd(b, l, g, n).to(device, dtype))
    t.update(dict.fromkeys(OPTIONAL))
    nseq = b
    if lengths is not None:
        if b != 1 or sum(lengths) != l:
            raise ValueError(f"lengths: expected b == 1 and sum(lengths) == l = {l}, got b = {b}, {lengths}")
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        t["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=device)
        nseq = len(lengths)
    if D is not None:
        t["D"] = rnd(*((h,) if D == "h" else (h, p))).to(device, wdt)
    if z:
        t["z"] = rnd(b, l, h, p).to(device, dtype)
    if dt_bias:
        t["dt_bias"] = (0.5 * rnd(h)).to(device, wdt)
    if initial_states:
        t["initial_states"] = rnd(nseq, h, p, n).to(device, wdt)
    t["dy"] = rnd(b, l, h, p).to(device, dtype)
    t["dfinal_states"] = rnd(nseq, h, p, n).to(device, wdt) if dfinal else None
    extras = "".join(f" {k}" for k, on in (("D" + (D or ""), D), ("z", z), ("dt_bias", dt_bias),
                                           ("h0", initial_states), ("dfinal", dfinal)) if on)
    label = (f"b={b} l={l} h={h} p={p} g={g} n={n} Q={chunk} {str(dtype).removeprefix('torch.')}"
             f"{extras}{f' varlen {list(lengths)}' if lengths is not None else ''}"
             f"{' recompute' if recompute_states else ''}")
    return Case(label, t, dict(chunk_size=chunk, dt_softplus=dt_softplus, dt_limit=tuple(dt_limit),
                               recompute_states=recompute_states))


ALL_OPTIONS = dict(D="h", z=True, dt_bias=True, initial_states=True, dfinal=True)

SMALL = {
    "varlen": dict(shape=(1, 41, 4, 8, 2, 8), chunk=16,
                   options=dict(lengths=[5, 0, 16, 1, 19], **ALL_OPTIONS)),
    "all-options": dict(shape=(2, 37, 4, 8, 2, 16), chunk=16, options=ALL_OPTIONS),
    "plain": dict(shape=(2, 37, 4, 8, 2, 16), chunk=16, options={}),
    "D-per-channel": dict(shape=(1, 40, 2, 8, 1, 8), chunk=16, options=dict(D="hp", z=True)),
    "multi-tile": dict(shape=(1, 150, 2, 8, 1, 8), chunk=128, options=dict(D="h", initial_states=True)),
    "odd-dims": dict(shape=(2, 21, 3, 20, 1, 24), chunk=16, options=dict(D="hp", dt_bias=True)),
}
"""The oracle configurations: packed sequences with every option, every option, none, D per
channel, several row tiles per segment (chunk 128), head dim and state not powers of two."""

EDGE = [
    ((1, 1, 1, 1, 1, 1), 16, {}),                                    # one token, every size 1
    ((1, 16, 2, 16, 2, 16), 16, dict(D="h", z=True)),                # exactly one chunk
    ((2, 17, 2, 8, 1, 8), 16, dict(D="hp", initial_states=True, dfinal=True)),  # one token more
    ((1, 33, 4, 8, 2, 8), 16, dict(lengths=[16, 0, 17, 0], **ALL_OPTIONS)),     # empty sequences
    ((1, 64, 4, 16, 4, 16), 32, dict(dt_bias=True, recompute_states=True)),     # g = h, recompute
]

DEMO = {"torch": ((1, 512, 8, 32, 2, 32), 64), "triton": ((1, 40, 2, 16, 1, 16), 16)}
"""The demonstration's shapes on the CPU (the Triton interpreter is slow); on a GPU b=2, l=4096,
h=128, p=64, g=8, n=128, chunk 256 (Nemotron-H)."""
DEMO_GPU = ((2, 4096, 128, 64, 8, 128), 256)


def small(name: str, dtype=torch.float32, *, seed: int = 6, device="cpu", **overrides) -> Case:
    """The SMALL configuration ``name`` (overrides: make()'s keyword arguments)."""
    cfg = SMALL[name]
    options = dict(cfg["options"], chunk=cfg["chunk"], **overrides)
    return make(*cfg["shape"], dtype, seed=seed, device=device, **options)


def tiles(dtype=torch.bfloat16, device="cpu") -> list[Case]:
    """The production tiles (``production()``: p = 64 and 80, n = 128, chunks of 256 and 128)
    on problems small enough for the PTX emulator. The table's tiles are fitted to the chunk
    (64-token row blocks from a chunk of 64 on), p (64-row head-dim tiles from p = 64 on), n
    (the fused forward walk and dB/dC hold the whole state, 128) and the heads (16 per dt
    program from 9 heads on); the sequences are as short as a case allows past that:

    - Nemotron-H's call (no z, no initial states; D per head, dt_bias), chunk 256: the
      backward walk's 64-token steps without the gate; 9 heads in one group (16 heads per dt
      and parameter-reduce program, 7 of them masked); 50 tokens, one ragged row block;
    - every option (z: the gated walk's 16-token steps at a 128-register budget; initial and
      final states), chunk 128: 150 tokens, so the state crosses into a second segment of 22;
    - packed sequences of 150, 0, 37 and 9 tokens with every option, chunk 128, and 14 tokens
      after them that no sequence covers (the stage zeroing them, 64-wide rows of y and
      128-wide rows of dB and dC): an empty sequence, one crossing a segment boundary;
    - p = 80 with D per channel and every option, chunk 128: two head-dim tiles, the second
      masked (the gated walk's 168-register budget); 9 heads; 40 tokens.

    Batch 1, one group of 2 or 9 heads."""
    kw = dict(dtype=dtype, device=device)
    packed = make(1, 210, 2, 64, 1, 128, seed=32, chunk=128, lengths=[150, 0, 37, 23],
                  **ALL_OPTIONS, **kw)
    cu = packed.tensors["cu_seqlens"].clone()
    cu[-1] -= 14                                        # the last 14 tokens uncovered
    packed = Case(packed.label.replace("[150, 0, 37, 23]", "[150, 0, 37, 9] + 14 uncovered"),
                  dict(packed.tensors, cu_seqlens=cu), packed.options)
    return [make(1, 50, 9, 64, 1, 128, seed=30, chunk=256, D="h", dt_bias=True, **kw),
            make(1, 150, 2, 64, 1, 128, seed=31, chunk=128, **ALL_OPTIONS, **kw),
            packed,
            make(1, 40, 9, 80, 1, 128, seed=33, chunk=128, D="hp", z=True, dt_bias=True,
                 initial_states=True, dfinal=True, **kw)]


def cases(kind: str, *, dtype=torch.float32, device="cpu", backend: str = "torch") -> list[Case]:
    """small: the oracle configurations (SMALL); edge: one token, one chunk and one more, empty
    packed sequences, recomputed states; tiles: the production tiles on small problems
    (``tiles``); demo: the demonstration's shape for ``backend`` (D, z, dt_bias, initial
    states)."""
    if kind == "small":
        return [small(name, dtype, device=device) for name in SMALL]
    if kind == "edge":
        return [make(*shape, dtype, seed=13 + i, device=device, chunk=chunk, **options)
                for i, (shape, chunk, options) in enumerate(EDGE)]
    if kind == "tiles":
        return tiles(dtype, device)
    if kind == "demo":
        on_cpu = torch.device(device).type == "cpu"
        shape, chunk = DEMO.get(backend, DEMO["triton"]) if on_cpu else DEMO_GPU
        return [make(*shape, dtype, seed=1, device=device, chunk=chunk, D="h", z=True,
                     dt_bias=True, initial_states=True)]
    raise ValueError(f"kind: expected small, edge, tiles or demo, got {kind!r}")


def production() -> list[tuple[str, list[PlanCall]]]:
    """Nemotron-H shapes (h=128, p=64, n=128, g=8, bf16): as the Nemotron-H 8B mixer calls the
    scan (8K tokens, chunk 256, D and dt_bias, no z: its gate is applied by the gated RMSNorm
    after the scan, no initial states), then with every option (z, initial and final states)
    at chunk 256 and 128, packed sequences (64 of them in 8192 tokens, with a status word) and
    p = 80 with D per channel; forward and backward, as TensorDescs on the CPU."""
    def desc(*shape, dtype=torch.bfloat16):
        return TensorDesc(shape, dtype, device="cpu")

    out = []
    for label, b, p, chunk, nseq, per_channel, every in (
            ("nemotron-h 8K", 1, 64, 256, None, False, False),
            ("h128 p64 n128 Q256", 2, 64, 256, None, False, True),
            ("h128 p64 n128 Q128", 2, 64, 128, None, False, True),
            ("varlen Q256", 1, 64, 256, 64, False, True),
            ("p80 Q128", 2, 80, 128, None, True, True)):
        l, h, g, n = 8192, 128, 8, 128
        seqs = b if nseq is None else nseq
        f32 = torch.float32
        tensors = dict(x=desc(b, l, h, p), dt=desc(b, l, h), A=desc(h, dtype=f32),
                       B=desc(b, l, g, n), C=desc(b, l, g, n),
                       D=desc(h, p, dtype=f32) if per_channel else desc(h, dtype=f32),
                       z=desc(b, l, h, p) if every else None, dt_bias=desc(h, dtype=f32),
                       initial_states=desc(seqs, h, p, n, dtype=f32) if every else None,
                       cu_seqlens=None if nseq is None else desc(nseq + 1, dtype=torch.int32),
                       status=None if nseq is None else desc(1, dtype=STATUS_DTYPE))
        options = dict(chunk_size=chunk, dt_softplus=True)
        final = dict(dfinal_states=desc(seqs, h, p, n, dtype=f32)) if every else {}
        out.append((f"scan {label}", [
            PlanCall(Mamba2ChunkScanForward, tensors, options),
            PlanCall(Mamba2ChunkScanBackward, dict(tensors, dy=desc(b, l, h, p), **final),
                     options)]))
    return out


def _forward_tensors(t) -> dict:
    return {k: t[k] for k in _FORWARD_TENSORS}


def _status(device) -> torch.Tensor:
    return torch.zeros(1, dtype=STATUS_DTYPE, device=device)


def plan_calls(case: Case, backend: str) -> list[PlanCall]:
    """The forward and the backward plan of ``case`` (the backward's saved from the forward),
    each with a status word."""
    t = case.tensors
    device = t["x"].device
    forward = PlanCall(Mamba2ChunkScanForward, dict(_forward_tensors(t), status=_status(device)),
                       case.options)
    plan = forward.build(backend).compile()
    outputs = plan.allocate_outputs()
    plan.execute(**_forward_tensors(t), **outputs, status=_status(device),
                 workspace=plan.allocate_workspace() if plan.workspace_size else None)
    backward = PlanCall(Mamba2ChunkScanBackward,
                        dict(_forward_tensors(t), dy=t["dy"], dfinal_states=t["dfinal_states"],
                             saved=outputs["saved"], status=_status(device)), case.options)
    return [forward, backward]


def run(case: Case, backend: str, *, accumulate: bool = False,
        grads: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Forward then backward through the plans with caller-allocated buffers; returns y,
    final_states and every gradient the backward writes (``grads``: buffers to write or, with
    ``accumulate``, to add dA, dD and ddt_bias into)."""
    t = case.tensors
    fwd = Mamba2ChunkScanForward(**_forward_tensors(t), **case.options, backend=backend).compile()
    outputs = fwd.allocate_outputs()
    fwd.execute(**_forward_tensors(t), **outputs, workspace=fwd.allocate_workspace())
    bwd = Mamba2ChunkScanBackward(**_forward_tensors(t), dy=t["dy"],
                                  dfinal_states=t["dfinal_states"], **case.options,
                                  accumulate=accumulate, backend=backend).compile()
    given = grads or {}
    buffers = dict(bwd.allocate_outputs(exclude=tuple(given)), **given)
    bwd.execute(**_forward_tensors(t), dy=t["dy"], saved=outputs["saved"],
                dfinal_states=t["dfinal_states"], **buffers, workspace=bwd.allocate_workspace())
    return dict(y=outputs["y"], final_states=outputs["final_states"],
                **{k: buffers[k] for k in bwd.gradient_names})


# -- index-data fuzzing ---------------------------------------------------------------------------
FUZZ_SHAPE = (1, 24, 2, 4, 1, 4)          # b, l, h, p, g, n: two chunks of 16, four sequences
FUZZ_KINDS = ("valid", "valid-short", "start-not-0", "negative", "decreasing", "past-tokens",
              "extreme")


def _draw_cu_seqlens(kind: str, gen: torch.Generator, total: int, nseq: int) -> list[int]:
    """nseq + 1 offsets of one ``kind``: valid (an empty sequence, ending at the last token, or
    short of it), not starting at 0, negative, decreasing, past the packed tokens, or extreme
    int32 values."""
    def randint(lo, hi):                            # in [lo, hi), or lo when that is empty
        return int(torch.randint(lo, max(hi, lo + 1), (1,), generator=gen))
    cuts = sorted(randint(0, total + 1) for _ in range(nseq - 1))
    cu = [0, *cuts, total]
    cu[2] = cu[1]                                   # an empty sequence
    if kind == "valid-short":
        cu[-1] = randint(cu[-2], total)             # trailing tokens no sequence covers: valid
    elif kind == "start-not-0":
        cu[0] = randint(1, cu[1] + 1)
    elif kind == "negative":
        cu[randint(0, nseq + 1)] = -randint(1, 1000)
    elif kind == "decreasing":
        i = randint(1, nseq)
        cu[i], cu[i + 1] = cu[i + 1] + randint(1, 8), cu[i]
    elif kind == "past-tokens":
        cu[randint(1, nseq + 1)] = total + randint(1, 1000)
    elif kind == "extreme":
        cu[randint(0, nseq)] = -2**31
        cu[-1] = 2**31 - 1
    return cu


def _expected(cu: list[int], total: int) -> Status:
    bad = cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total
    return Status.CU_SEQLENS if bad else Status.OK


def index_fuzz(seed: int, backend: str, device) -> list:
    """Forward and backward plans over drawn cu_seqlens of every FUZZ_KINDS kind (fp32, D,
    dt_bias, initial and final-state gradients). recompute_states=True and no z: the plans then
    save nothing, so the torch reference takes the same (empty) ``saved`` as the backend under
    test; the kernels and buffers the saved states and y before the gate would use are the same
    as the workspace's."""
    from ..testing.fuzz import FuzzCase
    gen = torch.Generator().manual_seed(seed)
    b, l, h, p, g, n = FUZZ_SHAPE
    cases = []
    for i, kind in enumerate(FUZZ_KINDS):
        case = make(b, l, h, p, g, n, torch.float32, seed=seed + i, device=device, D="h",
                    dt_bias=True, initial_states=True, dfinal=True, lengths=[6, 6, 6, 6],
                    recompute_states=True)
        cu = _draw_cu_seqlens(kind, gen, l, 4)
        tensors = dict(case.tensors, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device))
        case = Case(f"{kind} cu_seqlens={cu}", tensors, case.options)
        forward, backward = plan_calls(case, backend)
        expected = _expected(cu, l)
        cases += [FuzzCase(f"forward {case.label}", forward, expected),
                  FuzzCase(f"backward {case.label}", backward, expected)]
    return cases
