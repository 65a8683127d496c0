"""The plan contract, once for every (plan, backend) of the registry: validation messages,
refused executes that touch nothing, execute dispatching no torch op, the eager plan cache, the
repr, TensorDesc construction, and CUDA Graph capture (GPU). Per-family files keep the math."""

from __future__ import annotations

import inspect

import pytest
import torch

from fusedops import TensorDesc
from fusedops.errors import PlanStateError, ValidationError
from fusedops.plan import EAGER_PLANS
from fusedops.opinfo import TILES
from fusedops.registry import FAMILIES
from fusedops.testing import NoTorchOps

from helpers import BACKENDS, DEVICE, GPU_BACKENDS, requires_cuda

PLANS = [(info, index, plan) for info in FAMILIES for index, plan in enumerate(info.plans)]


def _params(backends):
    return [pytest.param(info, index, backend, id=f"{plan.__name__}-{backend}")
            for info, index, plan in PLANS for backend in backends if backend in plan.backends]


def _call(info, index, backend):
    """The PlanCall of plan ``index`` for the family's first small case, on ``backend``."""
    case = info.cases("small", dtype=torch.float32, device=DEVICE, backend=backend)[0]
    return info.plan_calls(case, backend)[index]


def _ready(info, index, backend):
    """(plan compiled, every execute() argument by name)."""
    call = _call(info, index, backend)
    plan = call.build(backend).compile()
    args = {o.name: call.tensors.get(o.name) for o in plan.operands if o.is_read}
    args.update(plan.allocate_outputs())
    args.update({o.name: call.tensors[o.name] for o in plan.operands if o.role == "inout"})
    args["workspace"] = plan.allocate_workspace() if plan.workspace_size else None
    return plan, args


def _snapshot(args):
    return {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}


def _unchanged(args, snapshot) -> list[str]:
    return [k for k, v in snapshot.items()
            if not torch.equal(args[k].view(torch.uint8) if args[k].numel() else args[k],
                               v.view(torch.uint8) if v.numel() else v)]


def signature_problems(plan_cls) -> list[str]:
    """Where a plan's constructor or execute() disagrees with its declarations (``operands``,
    ``options``), which are written once: execute() takes every operand in declared order (the
    workspace among them or after them), then the stream; the constructor takes its tensors in
    declared order and every option, keyword-only, with the declared default (none for a
    required option, declared None)."""
    name, problems = plan_cls.__name__, []
    declared = [o.name for o in plan_cls.operands]
    execute = [p for p in inspect.signature(plan_cls.execute).parameters if p != "self"]
    if [p for p in execute if p != "workspace"] != declared + ["current_stream"] or \
            "workspace" not in execute:
        problems.append(f"{name}.execute{tuple(execute)}: expected the operands in declared order "
                        f"(and workspace), then current_stream: {tuple(declared)}")
    init = inspect.signature(plan_cls.__init__).parameters
    tensors = [p for p in init if p in declared]
    if tensors != [o for o in declared if o in tensors]:
        problems.append(f"{name}.__init__ takes {tensors}: not in the declared order {declared}")
    for option in plan_cls.options:
        param = init.get(option.name)
        if param is None or param.kind is not inspect.Parameter.KEYWORD_ONLY:
            problems.append(f"{name}.__init__: option {option.name!r} is not keyword-only")
        elif param.default is inspect.Parameter.empty and option.default is None:
            continue
        elif param.default != option.default:
            problems.append(f"{name}.__init__: {option.name}={param.default!r}, declared default "
                            f"{option.default!r}")
    return problems


@pytest.mark.parametrize("info,index,backend", _params(BACKENDS))
def test_signatures_follow_the_declarations(info, index, backend):
    assert signature_problems(info.plans[index]) == []


def test_the_signature_check_sees_drift():
    from fusedops.engram_gate import EngramGateSavedForward

    class Drifted(EngramGateSavedForward):
        def __init__(self, kv, x, weight, mask=None, eps: float = 1e-6, *, backend="auto"):
            pass

        def execute(self, x, kv, weight, out, mask, saved, *, workspace=None,
                    current_stream=None):
            pass

    assert signature_problems(Drifted) == [
        "Drifted.execute('x', 'kv', 'weight', 'out', 'mask', 'saved', 'workspace', "
        "'current_stream'): expected the operands in declared order (and workspace), then "
        "current_stream: ('x', 'kv', 'weight', 'mask', 'out', 'saved')",
        "Drifted.__init__ takes ['kv', 'x', 'weight', 'mask']: not in the declared order "
        "['x', 'kv', 'weight', 'mask', 'out', 'saved']",
        "Drifted.__init__: option 'eps' is not keyword-only"]


@pytest.mark.parametrize("info,index,backend", _params(BACKENDS))
def test_execute_returns_declared_results_and_dispatches_no_torch_op(info, index, backend):
    """execute() only checks host facts and calls the launcher: with the launcher replaced by a
    recorder, it dispatches no torch operator (no allocation, conversion or device read)."""
    plan, args = _ready(info, index, backend)
    assert plan.selected_backend == backend
    result = plan.execute(**args)
    expected = [n for n in plan.returns if plan._descs.get(n) is not None]
    if hasattr(result, "keys"):
        assert list(result.keys())[:len(expected)] == expected
    calls = []
    plan._launch = lambda binding, stream: calls.append(sorted(binding))
    with NoTorchOps():
        plan.execute(**args)
    assert len(calls) == 1 and "workspace" in calls[0]


@pytest.mark.parametrize("info,index,backend", _params(BACKENDS))
def test_refused_execute_touches_nothing(info, index, backend):
    """A wrong dtype, a wrong shape, an output overlapping an input, a short workspace: each
    refused with a ValidationError naming the argument, before anything is written."""
    plan, args = _ready(info, index, backend)
    written = [o.name for o in plan.operands if o.is_written and args.get(o.name) is not None]
    read = [o.name for o in plan.operands if o.role == "in" and args.get(o.name) is not None]
    snapshot = _snapshot(args)
    target = written[0]
    bad = args[target]
    variants = [(bad.to(torch.float64 if bad.dtype != torch.float64 else torch.float32),
                 rf"{target}: expected dtype"),
                (torch.empty(bad.numel() + 1, dtype=bad.dtype, device=bad.device),
                 rf"{target}: expected shape")]
    floating_input = next((n for n in read if args[n].dtype == bad.dtype and
                           args[n].numel() * args[n].element_size() >= bad.numel() * bad.element_size()), None)
    if floating_input is not None and bad.numel():
        alias = args[floating_input].reshape(-1).view(torch.uint8)[:bad.numel() * bad.element_size()]
        variants.append((alias.view(bad.dtype).view(bad.shape), rf"{target}: must not overlap"))
    for value, match in variants:
        with pytest.raises(ValidationError, match=match):
            plan.execute(**{**args, target: value})
    if plan.workspace_size:
        with pytest.raises(ValidationError, match=r"workspace: expected a contiguous uint8 tensor"):
            plan.execute(**{**args, "workspace": args["workspace"][:-1]})
    assert _unchanged(args, snapshot) == []


def _relocated(t: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """A fresh tensor of ``t``'s dtype, shape and strides, ``offset`` elements into a new
    buffer."""
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(extent + offset, dtype=t.dtype, device=t.device)
    return torch.as_strided(base, t.shape, t.stride(), offset)


def _alias(plan, args) -> tuple[str, torch.Tensor] | None:
    """(operand, a view of the same dtype, shape and strides into another operand's buffer,
    one of them written): the first such pair of non-empty tensors that fits, or None."""
    planned = [o for o in plan.operands if args.get(o.name) is not None and args[o.name].numel()]
    for written in (o for o in planned if o.is_written):
        for other in (o for o in planned if o.role == "in"):
            for guest, host in ((written, other), (other, written)):
                g, h = args[guest.name], args[host.name]
                extent = 1 + sum((n - 1) * s for n, s in zip(g.shape, g.stride()))
                if (g.dtype == h.dtype and h.data_ptr() % guest.alignment == 0
                        and h.untyped_storage().nbytes()
                        >= (h.storage_offset() + extent) * g.element_size()):
                    return guest.name, torch.as_strided(h, g.shape, g.stride(),
                                                        h.storage_offset())
    return None


def _single_changes(plan, args) -> list[tuple[str, str, object]]:
    """(what the error says, argument, value): execute()'s arguments changed in one thing each,
    every one refused: dtype, shape, device, strides, alignment, overlap, None for a planned
    tensor and a tensor for one the plan was built without; the workspace's size, dtype,
    alignment and absence where the plan needs one."""
    planned = [o for o in plan.operands if args.get(o.name) is not None]
    target = next(o for o in planned if o.is_written)
    bad = args[target.name]
    other = torch.float64 if bad.dtype != torch.float64 else torch.float32
    changes = [
        (rf"^{target.name}: expected dtype", target.name, bad.to(other)),
        (rf"^{target.name}: expected shape", target.name,
         torch.empty(bad.numel() + 1, dtype=bad.dtype, device=bad.device)),
        (rf"^{target.name}: expected device", target.name,
         torch.empty(bad.shape, dtype=bad.dtype, device="meta")),
        (rf"^{target.name}: expected a torch.Tensor, got NoneType", target.name, None)]
    wide = next((o.name for o in planned if args[o.name].ndim and args[o.name].shape[-1] > 1),
                None)
    if wide is not None:
        t = args[wide]
        view = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        changes.append((rf"^{wide}: expected (a contiguous|the last dimension|strides)", wide,
                        view[..., ::2]))
    loose = next((o for o in planned if o.alignment > args[o.name].element_size()
                  and args[o.name].numel()), None)
    if loose is not None:
        changes.append((rf"^{loose.name}: expected a data pointer aligned to {loose.alignment}",
                        loose.name, _relocated(args[loose.name], 1)))
    alias = _alias(plan, args)
    if alias is not None:
        changes.append((r"must not overlap", *alias))
    absent = next((o.name for o in plan.operands if o.name not in plan._descs), None)
    if absent is not None:
        changes.append((rf"^{absent}: this plan was built without {absent}", absent, bad))
    if plan.workspace_size:
        ws = args["workspace"]
        changes += [
            (r"^workspace: expected a contiguous uint8 tensor", "workspace", ws[:-1]),
            (r"^workspace: expected a contiguous uint8 tensor", "workspace",
             torch.empty(ws.numel(), dtype=torch.int8, device=ws.device)),
            (r"^workspace: expected a data pointer aligned", "workspace",
             torch.empty(ws.numel() + 1, dtype=torch.uint8, device=ws.device)[1:]),
            (r"^workspace: expected a uint8 tensor of at least", "workspace", None)]
    return changes


@pytest.mark.parametrize("info,index,backend", _params(BACKENDS))
def test_repeated_execute_refuses_each_single_change(info, index, backend, monkeypatch):
    """execute() decides its per-tensor checks once per argument signature: after a successful
    call, a call that changes one thing is refused with the message a first call with that
    change gets, before anything is launched or written; fresh tensors of the signature that
    passed skip the per-tensor checks; the passing arguments still pass afterwards; neither the
    full checks nor the remembered path dispatch a torch op."""
    import fusedops.core.checks as checks
    call = _call(info, index, backend)
    plan, args = _ready(info, index, backend)
    first = call.build(backend).compile()                # never executed successfully
    launched = []
    for p in (plan, first):
        p._launch = lambda binding, stream: launched.append(sorted(binding))
    plan.execute(**args)
    assert len(launched) == 1
    snapshot = _snapshot(args)
    for match, name, value in _single_changes(plan, args):
        changed = {**args, name: value}
        with pytest.raises(ValidationError, match=match) as expected:
            first.execute(**changed)
        with pytest.raises(ValidationError) as repeated:
            plan.execute(**changed)
        assert str(repeated.value) == str(expected.value), name
    assert len(launched) == 1 and _unchanged(args, snapshot) == []
    fresh = {k: _relocated(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    if plan.workspace_size:
        fresh["workspace"] = plan.allocate_workspace()

    def refuse(*_args, **_kwargs):
        raise AssertionError("the per-tensor checks ran again for a signature that passed")
    with monkeypatch.context() as patched, NoTorchOps():
        patched.setattr(checks, "check_execute_tensor", refuse)
        patched.setattr(checks, "check_workspace", refuse)
        plan.execute(**fresh)
    with NoTorchOps():
        plan.execute(**args)
        first.execute(**args)                           # the full checks dispatch no op either
    assert len(launched) == 4


@pytest.mark.parametrize("info,index,backend", _params(["torch"]))
def test_construction_errors_name_the_argument(info, index, backend):
    call = _call(info, index, backend)
    plan_cls = call.plan
    tensors = {k: v for k, v in call.tensors.items() if k in plan_cls._constructor_tensors}
    first = next(o.name for o in plan_cls.operands if tensors.get(o.name) is not None)
    with pytest.raises(ValidationError, match=rf"^{first}: expected a torch.Tensor or fusedops.TensorDesc, got list"):
        plan_cls(**{**tensors, first: [1, 2]}, **call.options)
    wrong = tensors[first].to(torch.int16)
    with pytest.raises(ValidationError, match=rf"^{first}: expected"):
        plan_cls(**{**tensors, first: wrong}, **call.options)
    with pytest.raises(ValidationError, match=r"^backend: expected one of auto, torch, triton, cute, got 'cudnn'"):
        plan_cls(**tensors, **call.options, backend="cudnn")
    for option in plan_cls.options:
        with pytest.raises(ValidationError, match=rf"^{option.name}: expected"):
            plan_cls(**tensors, **{**call.options, option.name: object()})


@pytest.mark.parametrize("info,index,backend", _params(["torch"]))
def test_execute_before_compile(info, index, backend):
    call = _call(info, index, backend)
    plan = call.build(backend)
    with pytest.raises(PlanStateError, match=rf"{type(plan).__name__}.execute\(\) called before compile\(\)"):
        plan._execute({})


@pytest.mark.parametrize("info,index,backend", _params(BACKENDS))
def test_eager_plan_cache_keys_on_normalised_options(info, index, backend):
    """Equal tensors and options hit one cached plan; a refused option never reaches the cache
    (a later valid call still works)."""
    call = _call(info, index, backend)
    plan_cls = call.plan
    first = plan_cls.cached(call.tensors, backend=backend, **call.options)
    assert plan_cls.cached(call.tensors, backend=backend, **call.options) is first
    size = len(EAGER_PLANS)
    for option in plan_cls.options:
        with pytest.raises(ValidationError, match=rf"^{option.name}:"):
            plan_cls.cached(call.tensors, backend=backend, **{**call.options, option.name: object()})
    assert len(EAGER_PLANS) == size
    assert plan_cls.cached(call.tensors, backend=backend, **call.options) is first


@pytest.mark.parametrize("info,index,backend", _params(BACKENDS))
def test_repr_and_construction_from_descs(info, index, backend):
    call = _call(info, index, backend)
    plan = call.build(backend)
    text = repr(plan)
    assert text.startswith(type(plan).__name__ + "(") and f"backend={backend}" in text
    assert "not compiled" in text and "not compiled" not in repr(plan.compile())
    descs = {k: (TensorDesc.from_tensor(v) if isinstance(v, torch.Tensor) else v)
             for k, v in call.tensors.items()}
    from_descs = type(plan)(**{k: v for k, v in descs.items() if k in plan._constructor_tensors},
                            **call.options, backend=backend)
    assert from_descs.workspace_size == plan.workspace_size
    assert from_descs.saved_size == plan.saved_size
    assert {k: d for k, d in from_descs._descs.items()} == plan._descs


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("info,index,backend", _params(GPU_BACKENDS))
def test_gpu_graph_replay_with_changed_inputs_and_poisoned_outputs(info, index, backend):
    """Captured once, replayed after new data is copied into the same input buffers and the
    outputs and workspace are poisoned: equal to an execute outside the graph."""
    plan, args = _ready(info, index, backend)
    read = [o.name for o in plan.operands if o.role == "in" and args.get(o.name) is not None
            and args[o.name].is_floating_point()]
    written = [o.name for o in plan.operands if o.is_written and args.get(o.name) is not None]
    inout = {o.name: args[o.name].clone() for o in plan.operands if o.role == "inout"}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        plan.execute(**args)
        with torch.cuda.graph(graph, stream=stream):
            plan.execute(**args)
    torch.cuda.synchronize()
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    for name in read:
        args[name].copy_(torch.randn(args[name].shape, generator=gen, device=DEVICE))
    for name, value in inout.items():
        args[name].copy_(value)
    for name in written:
        if args[name].is_floating_point() and name not in inout:
            args[name].fill_(float("nan"))
    if args["workspace"] is not None:
        args["workspace"].fill_(0xFF)
    graph.replay()
    torch.cuda.synchronize()
    replayed = {n: args[n].clone() for n in written}
    for name, value in inout.items():
        args[name].copy_(value)
    plan.execute(**args)
    torch.cuda.synchronize()
    for name in written:
        assert torch.equal(replayed[name], args[name]), name


@pytest.mark.parametrize("info", FAMILIES, ids=lambda info: info.name)
def test_sample_kinds_are_every_kind_of_cases_but_tiles_and_demo(info):
    """``OpInfo.sample_kinds`` (what the oracle tests and ``fusedops kernels --samples`` run)
    is every kind ``cases`` takes but "tiles" (the emulator's production tile configurations)
    and "demo", each giving samples in every ``sample_dtypes``: the kinds ``cases`` names when
    it refuses one."""
    with pytest.raises(ValueError, match="kind: expected") as refused:
        info.cases("no such kind")
    listed = str(refused.value).split("expected ", 1)[1].split(", got", 1)[0]
    kinds = [k for part in listed.split(", ") for k in part.split(" or ")]
    triton = "triton" in info.backends
    assert sorted(kinds) == sorted([*info.sample_kinds, *([TILES] if triton else []), "demo"])
    for dtype in info.sample_dtypes:
        for kind in info.sample_kinds:
            assert info.cases(kind, dtype=dtype), (kind, dtype)
