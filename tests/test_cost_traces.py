"""The Triton kernels' traffic models checked against what the kernels touch.

Every Triton kernel of every registry family runs, on the registry's small samples in bf16 (and
the family's ``emulated_cases`` of other kinds, so that every kernel launches: the MoE's split-K
weight gradients), under Triton's CPU interpreter with
``fusedops.testing.traffic_trace.record_traffic`` on, while every machine's L2 in the cost models
is unlimited (``modelled_l2``: every re-read within a launch hits). Each launch's modelled bytes
read and written must then equal its trace's compulsory bytes (unique 32-byte sectors read and
written, times 32) within ``TOLERANCE``.

A launch that differs is classified (``classify``), read and write separately:

* ``sub-sector``: the model lies between the trace's exact unique bytes and its sectors. The
  models count the bytes a kernel loads and stores; a row shorter than a sector, or one that
  straddles a sector boundary, costs whole sectors on a GPU. At the production shapes rows are
  whole sectors; at the small samples' (a D = 8 bf16 row is 16 bytes) they are not.
* ``above`` / ``below``: the model counts more than the sectors moved / less than the exact bytes.

A kernel whose launches differ is listed in ``KNOWN`` with the kinds of difference its model is
known to have and why; its check is ``xfail(strict=True, raises=KnownDifference)``: it must fail,
and only with differences of those kinds (any other is a plain failure).
``test_model_matches_an_exact_lru_where_reuse_is_partial`` replays a few launches through an
exact LRU cache of the model's usable L2 (``lru_traffic``, RESIDENT programs at once) at a size
where re-reads between programs partly hit.

The global scratch a plan's workspace carries for tensor descriptors is excluded from the
traces (tensor-map bytes are not data traffic); the interpreter keeps descriptors in host memory
and never touches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("the traces need Triton's CPU interpreter", allow_module_level=True)

import triton.language as tl                                            # noqa: E402

from fusedops.core.cost import Cost                                     # noqa: E402
from fusedops.core.program import SCRATCH                               # noqa: E402
from fusedops.registry import FAMILIES, family as registry_family       # noqa: E402
from fusedops.testing.traffic_trace import (Access, Launch, lru_traffic,  # noqa: E402
                                            record_traffic)

KIND, DTYPE = "small", torch.bfloat16
UNLIMITED = 2 ** 60
TOLERANCE = 0.02
TRITON_PACKAGE = "fusedops.backends.triton"


class KnownDifference(AssertionError):
    """Every launch of a kernel that differs from its trace does so in a kind ``KNOWN`` lists for
    that kernel."""


@dataclass(frozen=True)
class Known:
    """The kinds of difference (``classify``) a kernel's model has from its trace, and why."""

    kinds: frozenset[str]
    reason: str


SUB_SECTOR = ("the model counts bytes; a row shorter than a 32-byte sector, or one that "
              "straddles a sector boundary, costs whole sectors")
EVERY_ROW_VALID = ("the model counts every row valid (its docstring); the sample whose slots are "
                   "[3, -1, 0] (accepted [2, 1, 7], T = 4) skips the padding row (no state, x, "
                   "dt, B, C read, no state written) and, in the rollback, the row accepting 7")
GATHERED = ("a token's gathered x (d_out) row counts once per expert it selects (at the "
            "production shapes those tiles lie beyond the reuse distance) and the routing is "
            "taken balanced, every expert's weights read; the trace, L2 unlimited, reads a row "
            "once and never reads an idle expert's weights")


def _known(kinds: str, reason: str) -> Known:
    return Known(frozenset(kinds.split()), reason)


KNOWN: dict[tuple[str, str], Known] = {
    ("engram_gate", "engram_gate_fwd_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: D = 8 and 40 bf16 rows (16, 80 bytes) and the per-token "
        "fp32 scalars"),
    ("engram_gate", "engram_gate_bwd_held_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: D = 8 bf16 rows (16 bytes)"),
    ("mamba2_scan", "ssd_segment_table_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the varlen sample's cu_seqlens and segment table (48 "
        "bytes each)"),
    ("mamba2_scan", "ssd_dt_cumsum_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: dt [b, l, h] read one head at a time, h = 3 or 4 bf16 "
        "values (6-8 bytes) a token"),
    ("mamba2_scan", "ssd_zero_uncovered_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the varlen sample's 8 bytes of sequence bounds"),
    ("mamba2_scan", "ssd_dt_bwd_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: dt, ddt and dA per head and token (h values a token, "
        "strided)"),
    ("mamba2_scan", "ssd_param_reduce_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the per-head fp32 gradients of A, D and dt_bias (h "
        "words)"),
    ("mamba2_inference", "ssd_state_update_kernel"): _known(
        "above sub-sector", f"above: {EVERY_ROW_VALID}; sub-sector: {SUB_SECTOR} (p = 8 "
        "rows of an fp32 state of n = 8, the dt scalars)"),
    ("mamba2_inference", "ssd_rollback_kernel"): _known("above", f"above: {EVERY_ROW_VALID}"),
    ("gqa_attention", "attn_sanitise_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the packed sample's cu_seqlens (24 bytes)"),
    ("gqa_attention", "decode_append_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: one K and V row a sequence (d = 8 or 16 bf16) and the "
        "int32 positions"),
    ("gqa_attention", "decode_split_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the query rows and the lengths (d = 8 bf16, int32)"),
    ("gqa_attention", "decode_combine_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the output rows (d = 8 bf16)"),
    ("relu2_moe", "moe_router_fwd_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: logits rows of E = 4-12 values, bias, topk rows of k"),
    ("relu2_moe", "moe_count_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: the dispatch's int32 vectors (E or t·k words)"),
    ("relu2_moe", "moe_scan_kernel"): _known("sub-sector", f"{SUB_SECTOR}: as moe_count_kernel"),
    ("relu2_moe", "moe_offsets_kernel"): _known("sub-sector",
                                                f"{SUB_SECTOR}: as moe_count_kernel"),
    ("relu2_moe", "moe_scatter_kernel"): _known("sub-sector",
                                                f"{SUB_SECTOR}: as moe_count_kernel"),
    ("relu2_moe", "moe_gemm_kernel"): _known(
        "above sub-sector", f"above: {GATHERED}; sub-sector: {SUB_SECTOR} (ids, weights, the "
        "<g, a> partials)"),
    ("relu2_moe", "moe_combine_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: each token's k ids (4·k bytes)"),
    ("relu2_moe", "moe_weight_grad_reduce_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: fp32 partials and ids of t·k assignments"),
    ("relu2_moe", "moe_wgrad_split_kernel"): _known(
        "sub-sector", f"{SUB_SECTOR}: counts and offsets (E words)"),
    ("relu2_moe", "moe_wgrad_kernel"): _known(
        "above below sub-sector", f"above: {GATHERED}; below: the split-K launches (SPLIT 2 "
        "and 3) of the hot-expert case read each program's 28-byte row of the work table "
        "(224 bytes), the model counts the 4·(2E + 1) index words (52), having no work under "
        "the balanced routing; sub-sector: {SUB_SECTOR}"),
    ("relu2_moe", "moe_router_bwd_kernel"): _known(
        "sub-sector", "the model counts a sector per gathered logit (its docstring), the trace "
        "fewer where two of a token's k logits share a sector and more where a row straddles "
        "one"),
}


# -- running the samples under the recorder ----------------------------------------------------
def _triton_families():
    return [info for info in FAMILIES if "triton" in info.backends]


def _cost_caches():
    """Every cache of the Triton backend's modules (the cost models' ``per_arch`` and
    ``lru_cache`` functions): cleared whenever the machine table changes."""
    for name, module in list(sys.modules.items()):
        if name.startswith(TRITON_PACKAGE + ".") and module is not None:
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    yield value


@contextlib.contextmanager
def modelled_l2(l2_bytes: float):
    """Within the block every machine of ``fusedops.core.machines.MACHINES`` has ``l2_bytes``
    of L2 and the cost models' caches start empty; both restored (caches emptied again) on
    exit."""
    from fusedops.core import machines
    saved = dict(machines.MACHINES)
    try:
        for arch, box in saved.items():
            machines.MACHINES[arch] = dataclasses.replace(box, l2_bytes=l2_bytes)
        for cached in _cost_caches():
            cached.cache_clear()
        yield
    finally:
        machines.MACHINES.clear()
        machines.MACHINES.update(saved)
        for cached in _cost_caches():
            cached.cache_clear()


@dataclass(frozen=True)
class Row:
    """One kernel launch of a plan on a sample: its model and its trace."""

    family: str
    case: str
    plan: str
    call: int           # index of the plan's PlanCall in ``traced(family)[1]``
    stage: int
    kernel: str
    grid: tuple[int, int, int]
    model: Cost
    launch: Launch

    def __repr__(self) -> str:
        return f"Row({self.where()})"

    def where(self) -> str:
        return (f"{self.family} {self.kernel} (stage {self.stage} of {self.plan}, grid "
                f"{self.grid}) at {self.case}")


def _execute_args(plan, call) -> dict:
    """Every execute() argument of compiled ``plan`` for ``call``: its inputs, fresh outputs and
    workspace."""
    args = {o.name: call.tensors.get(o.name) for o in plan.operands if o.is_read}
    args.update(plan.allocate_outputs())
    args.update({o.name: call.tensors[o.name] for o in plan.operands if o.role == "inout"})
    args["workspace"] = plan.allocate_workspace() if plan.workspace_size else None
    return args


def _scratch(plan, workspace) -> list[tuple[int, int]]:
    """The byte range of the workspace's global scratch (tensor descriptors), if it has one."""
    layout = plan.program.workspace
    if workspace is None or SCRATCH.name not in layout:
        return []
    region = layout.carve(workspace, SCRATCH.name)
    return [(region.address(), region.address() + region.numel)]


def samples(info):
    """(label, case) of the family's samples here: every small sample, and the registry's
    ``emulated_cases`` of other kinds (the cases that together launch every kernel: the MoE's
    split-K weight gradients need its hot-expert edge case), bf16."""
    out = [(f"{KIND}:{i} {c.label}", c)
           for i, c in enumerate(info.cases(KIND, dtype=DTYPE, backend="triton"))]
    for name in info.emulated_cases:
        kind, index = name.split(":")
        if kind != KIND:
            case = info.cases(kind, dtype=DTYPE, backend="triton")[int(index)]
            out.append((f"{name} {case.label}", case))
    return out


@functools.lru_cache(maxsize=None)
def traced(family: str) -> tuple[tuple[Row, ...], tuple]:
    """(every Triton launch of the family's ``samples`` with its model under an unlimited L2 and
    its trace, the PlanCalls the launches' plans were built from)."""
    info = registry_family(family)
    rows, calls = [], []
    with modelled_l2(UNLIMITED):
        for label, case in samples(info):
            for call in info.plan_calls(case, "triton"):
                if "triton" not in call.plan.backends:
                    continue
                plan = call.build("triton").compile()
                args = _execute_args(plan, call)
                with record_traffic(_scratch(plan, args["workspace"])) as trace:
                    plan.execute(**args)
                kernels = plan.program.kernels
                assert [k.name for k in kernels] == [t.kernel for t in trace.launches], \
                    f"{call.plan.__name__} at {label}: launches differ from its stages"
                rows += [Row(family, label, call.plan.__name__, len(calls), i, k.name, k.grid,
                             k.cost, t) for i, (k, t) in enumerate(zip(kernels, trace.launches))]
                calls.append(call)
    return tuple(rows), tuple(calls)


# -- the comparison ----------------------------------------------------------------------------
def classify(model: float, exact: int, sectors: int) -> str:
    """``equal`` (within TOLERANCE of the sectors), ``sub-sector`` (between the exact bytes and
    the sectors), ``above`` (over the sectors) or ``below`` (under the exact bytes)."""
    if abs(model - sectors) <= TOLERANCE * sectors:
        return "equal"
    if model > sectors:
        return "above"
    return "sub-sector" if model >= (1 - TOLERANCE) * exact else "below"


def differences(row: Row, model: Cost | None = None) -> list[tuple[str, str]]:
    """(kind, description) of each of the launch's two figures that is not ``equal``."""
    model = row.model if model is None else model
    out = []
    for what, modelled, exact, sectors in (
            ("read", model.bytes_read, row.launch.exact_read_bytes, row.launch.read_bytes),
            ("written", model.bytes_written, row.launch.exact_written_bytes,
             row.launch.written_bytes)):
        kind = classify(modelled, exact, sectors)
        if kind != "equal":
            out.append((kind, f"{row.where()}: bytes {what} modelled {modelled:.0f}, trace "
                              f"{sectors} ({sectors // 32} sectors, {exact} exact bytes): {kind}"))
    return out


def check(rows, known: Known | None, models=None) -> None:
    """Fails unless every launch of ``rows`` equals its trace; differences of the kinds ``known``
    lists raise ``KnownDifference`` (naming each), any other an AssertionError."""
    found = [d for i, row in enumerate(rows)
             for d in differences(row, None if models is None else models[i])]
    allowed = known.kinds if known else frozenset()
    unexplained = [text for kind, text in found if kind not in allowed]
    if unexplained:
        raise AssertionError("modelled traffic differs from the trace:\n" + "\n".join(unexplained))
    if found:
        raise KnownDifference(f"known ({known.reason}):\n" + "\n".join(t for _, t in found))


# -- the tests ---------------------------------------------------------------------------------
def _kernel_params():
    """(family, kernel name) of every Triton kernel the family's small samples launch, with its
    ``KNOWN`` entry as a strict xfail (read from the plans' programs: nothing runs)."""
    params = []
    for info in _triton_families():
        names: list[str] = []
        for _, case in samples(info):
            for call in info.plan_calls(case, "torch"):
                if "triton" in call.plan.backends:
                    for k in call.build("torch").kernel_program("triton").kernels:
                        names += [k.name] if k.name not in names else []
        for name in names:
            known = KNOWN.get((info.name, name))
            marks = [pytest.mark.xfail(strict=True, raises=KnownDifference,
                                       reason=known.reason)] if known else []
            params.append(pytest.param(info.name, name, marks=marks, id=f"{info.name}-{name}"))
    return params


@pytest.mark.parametrize("family,kernel", _kernel_params())
def test_modelled_traffic_equals_the_trace(family, kernel):
    """Each launch of ``kernel`` on the family's ``samples``: modelled bytes read and written
    (L2 unlimited) within TOLERANCE of the trace's unique sectors (``check``)."""
    rows = [r for r in traced(family)[0] if r.kernel == kernel]
    assert rows, f"{family}: no launch of {kernel} on its samples"
    check(rows, KNOWN.get((family, kernel)))


def test_every_known_difference_names_a_launched_kernel():
    """A ``KNOWN`` entry whose kernel the samples no longer launch is stale."""
    launched = {tuple(p.values) for p in _kernel_params()}
    assert not set(KNOWN) - launched, sorted(set(KNOWN) - launched)


def test_a_wrong_model_is_caught():
    """The check fails, as an unexplained difference naming the kernel, family, sample and both
    figures, when a model is off: bytes doubled or halved, on a kernel that matches its trace
    and on one with known sub-sector differences (doubled is above the sectors, halved below
    the exact bytes: neither is explained)."""
    for family, kernel in (("gqa_attention", "attn_fwd_kernel"),
                           ("engram_gate", "engram_gate_fwd_kernel")):
        rows = [r for r in traced(family)[0] if r.kernel == kernel]
        known = KNOWN.get((family, kernel))
        for factor in (2.0, 0.5):
            wrong = [Cost(r.model.flops, factor * r.model.bytes_read,
                          factor * r.model.bytes_written) for r in rows]
            with pytest.raises(AssertionError) as failure:
                check(rows, known, wrong)
            assert not isinstance(failure.value, KnownDifference), failure.value
            text = str(failure.value)
            first = rows[0]
            assert f"{family} {kernel}" in text and first.case in text, text
            assert (f"modelled {factor * first.model.bytes_read:.0f}, trace "
                    f"{first.launch.read_bytes}") in text, text


# -- the recorder on kernels of known traffic --------------------------------------------------

@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _grid_kernel(out, GX: tl.constexpr):
    pid = tl.program_id(0) + GX * tl.program_id(1)
    tl.store(out + pid * 8 + tl.arange(0, 8), tl.zeros([8], tl.float32) + pid)


@triton.jit
def _descriptor_kernel(src, dst, rows, ROW0: tl.constexpr):
    desc = tl.make_tensor_descriptor(src, [rows, 8], [8, 1], [4, 8])
    out = tl.make_tensor_descriptor(dst, [rows, 8], [8, 1], [4, 8])
    out.store([ROW0, 0], desc.load([ROW0, 0]) + 1.0)


@triton.jit
def _atomic_kernel(counter, value):
    tl.atomic_add(counter, value)


def _sectors(tensor: torch.Tensor, first: int, count: int) -> set[int]:
    """The sectors of elements [first, first + count) of contiguous ``tensor``."""
    start = tensor.data_ptr() + first * tensor.element_size()
    return set(range(start // 32, (start + count * tensor.element_size() - 1) // 32 + 1))


def test_recorder_counts_masked_pointer_accesses_and_restores_the_hooks():
    from triton.runtime import interpreter
    hooks = dict(vars(interpreter.InterpreterBuilder))
    src, dst = torch.arange(100, dtype=torch.float32), torch.zeros(100)
    with record_traffic() as trace:
        _copy_kernel[(2,)](src, dst, 100, BLOCK=64)
    assert torch.equal(src, dst)
    assert dict(vars(interpreter.InterpreterBuilder)) == hooks      # restored
    (launch,) = trace.launches
    assert launch.kernel == "_copy_kernel" and launch.grid == (2, 1, 1)
    assert set(launch.read_sectors().tolist()) == _sectors(src, 0, 100)
    assert set(launch.written_sectors().tolist()) == _sectors(dst, 0, 100)
    assert (launch.exact_read_bytes, launch.exact_written_bytes) == (400, 400)
    assert launch.read_bytes == 32 * len(_sectors(src, 0, 100))
    second = {int(s) for a in launch.accesses if a.program == 1 and a.read for s in a.sectors}
    assert second == _sectors(src, 64, 36)


def test_recorder_numbers_programs_in_launch_order():
    """Program ids are x + gx·y (the first grid dimension fastest, as a GPU starts them)."""
    out = torch.zeros(6 * 8)
    with record_traffic() as trace:
        _grid_kernel[(2, 3)](out, GX=2)
    (launch,) = trace.launches
    assert launch.grid == (2, 3, 1) and launch.programs == 6
    for access in launch.accesses:
        assert set(access.sectors.tolist()) == _sectors(out, 8 * access.program, 8)
    assert [len(s) for s in launch.streams()] == [1] * 6


def test_recorder_clips_tensor_descriptor_boxes():
    """A [4, 8] box at row 4 of a [5, 8] tensor moves row 4 alone (the box is clipped to the
    tensor's bounds)."""
    src, dst = torch.randn(5, 8), torch.zeros(5, 8)
    with record_traffic() as trace:
        _descriptor_kernel[(1,)](src, dst, 5, ROW0=4)
    assert torch.equal(dst[4], src[4] + 1) and not dst[:4].any()
    (launch,) = trace.launches
    assert set(launch.read_sectors().tolist()) == _sectors(src, 32, 8)
    assert set(launch.written_sectors().tolist()) == _sectors(dst, 32, 8)
    assert (launch.exact_read_bytes, launch.exact_written_bytes) == (32, 32)


def test_recorder_counts_atomics_both_ways_and_leaves_out_excluded_ranges():
    counter = torch.zeros(8, dtype=torch.int32)
    with record_traffic() as trace:
        _atomic_kernel[(3,)](counter, 2)
    assert int(counter[0]) == 6
    (launch,) = trace.launches
    assert launch.read_bytes == launch.written_bytes == 32
    assert (launch.exact_read_bytes, launch.exact_written_bytes) == (4, 4)
    src, dst = torch.arange(100, dtype=torch.float32), torch.zeros(100)
    start = dst.data_ptr()
    with record_traffic(exclude=[(start, start + 400)]) as trace:
        _copy_kernel[(2,)](src, dst, 100, BLOCK=64)
    assert trace.launches[0].written_bytes == 0 and trace.launches[0].exact_read_bytes == 400


def test_lru_replays_streams_with_resident_programs():
    """Two programs reading sectors 0 and 1: with both resident and room for two sectors the
    second's reads hit; with one program at a time and room for one, every read misses. Writes
    allocate without reading and count when evicted or at the end."""
    def access(program, sector, read=True, write=False):
        s = np.array([sector], dtype=np.uint64)
        return Access(program, s, s * 32, read, write)

    launch = Launch("k", (2, 1, 1), [access(0, 0), access(0, 1), access(1, 0), access(1, 1)])
    assert lru_traffic(launch, 64, 2) == (64, 0)
    assert lru_traffic(launch, 32, 1) == (128, 0)
    writes = Launch("k", (1, 1, 1), [access(0, 5, False, True), access(0, 5),
                                     access(0, 6, False, True)])
    assert lru_traffic(writes, 32, 1) == (0, 64)         # 5 hit after its write, evicted by 6


# -- partial L2 hits against an exact LRU --------------------------------------------------------
RESIDENT = 4
"""Programs resident at once in the simulation (SMs × CTAs per SM on a GPU; a few at the small
samples' grids of 8-20 programs)."""

PARTIAL_L2 = [
    # family, kernel, plan, sample label prefix, G: the model's usable L2 over the mean bytes a
    # program of the launch moves in the trace (re-reads between programs partly hit)
    ("mamba2_scan", "ssd_chunk_states_bwd_kernel", "Mamba2ChunkScanBackward", "small:0", 0.5),
    ("gqa_attention", "attn_bwd_dq_kernel", "GQAAttentionBackward", "small:3", 1.0),
    ("relu2_moe", "moe_gemm_kernel", "ReLU2MoEBackward", "small:2", 1.0),
]


def _no_reuse_read(launch: Launch) -> int:
    """Bytes read when no program hits on another's loads: each program's own unique sectors."""
    per: dict[int, set] = {}
    for a in launch.accesses:
        if a.read:
            per.setdefault(a.program, set()).update(a.sectors.tolist())
    return 32 * sum(len(s) for s in per.values())


@pytest.mark.parametrize("family,kernel,plan,label,g", PARTIAL_L2,
                         ids=[f"{f}-{k}" for f, k, *_ in PARTIAL_L2])
def test_model_matches_an_exact_lru_where_reuse_is_partial(family, kernel, plan, label, g):
    """At an L2 where re-reads between programs partly hit (the simulated bytes read strictly
    between the compulsory and the no-reuse bytes), the model's bytes read with every machine's
    L2 at that size are within 15% of an exact LRU of the model's usable part of it
    (``L2_SHARE``) with RESIDENT programs at once."""
    from fusedops.backends.triton.l2_reuse import L2_SHARE
    rows, calls = traced(family)
    row = next(r for r in rows if r.kernel == kernel and r.plan == plan
               and r.case.startswith(label + " "))          # the plan's first launch of it
    launch = row.launch
    streamed = _no_reuse_read(launch) + launch.written_bytes
    l2 = g * streamed / launch.programs / L2_SHARE
    with modelled_l2(l2):
        model = calls[row.call].build("triton").program.kernels[row.stage].cost
    simulated, _ = lru_traffic(launch, L2_SHARE * l2, RESIDENT)
    assert launch.read_bytes < simulated < _no_reuse_read(launch), \
        f"{row.where()}: an L2 of {l2:.0f} bytes is not partial ({simulated} simulated)"
    assert abs(model.bytes_read - simulated) <= 0.15 * simulated, \
        (f"{row.where()}: L2 {l2:.0f} bytes: modelled {model.bytes_read:.0f} bytes read, "
         f"exact LRU ({RESIDENT} programs resident) {simulated}")
