"""Host overhead at the launch floor: what every registry plan's execute(), every eager wrapper
and every torch op costs on the host when the launch itself is free. Each plan is compiled on
the CPU at its family's first "small" sample, its launcher replaced by a no-op, and called with
the same buffers; the eager wrappers and torch ops run once for real (building their cached
plans), then with the cached plans' launchers stubbed the same way. µs per call is the median
over repetitions of time.perf_counter_ns around a batch of calls. Torch's own op-call floor is
measured in the same run: a torch.add of two 1-element tensors and an empty torch.library
custom op; "x op floor" sets each row against the custom op's time.

    python bench/host_overhead.py [--reps 200] [--quick] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import inspect
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import harness  # noqa: E402

from fusedops.plan import EAGER_PLANS  # noqa: E402
from fusedops.registry import FAMILIES  # noqa: E402

DEVICE = torch.device("cpu")
BACKEND = "torch"
BATCH = 20              # calls per timed batch (one perf_counter_ns pair per batch)
ALIASES = {"checkpoint": "state"}   # an eager wrapper's parameter named after a plan operand


@torch.library.custom_op("fusedops_bench::empty", mutates_args=())
def _empty_op(x: torch.Tensor) -> None:
    """The floor of a torch.library custom op: dispatch and nothing else."""


def time_us(fn, reps: int) -> float:
    """Median µs per call of ``fn()``: ``reps`` batches of BATCH calls, after a warm-up batch."""
    for _ in range(BATCH):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        samples.append((time.perf_counter_ns() - start) / BATCH / 1e3)
    return statistics.median(samples)


def stub_launch(plan) -> None:
    """Replaces a compiled plan's launcher by a no-op: execute() then costs its host work only."""
    plan._launch = lambda binding, stream: None


def ready(call):
    """(compiled plan with the launch stubbed, every execute() argument by name)."""
    plan = call.build(BACKEND).compile()
    args = {o.name: call.tensors.get(o.name) for o in plan.operands if o.is_read}
    args.update(plan.allocate_outputs())
    args.update({o.name: call.tensors[o.name] for o in plan.operands if o.role == "inout"})
    args["workspace"] = plan.allocate_workspace() if plan.workspace_size else None
    stub_launch(plan)
    return plan, args


def bind(fn, calls):
    """Keyword arguments of ``fn`` (an eager wrapper or torch op) from the first plan call that
    supplies every required parameter: tensors and options by name (``ALIASES`` renamed); a
    ``**options`` parameter gets the call's options and its other read operands."""
    params = inspect.signature(fn).parameters
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for call in calls:
        given = {**call.tensors, **call.options}
        if all(ALIASES.get(n, n) in given for n in required):
            kwargs = {n: given[ALIASES.get(n, n)] for n in params if ALIASES.get(n, n) in given}
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                kwargs.update(call.options)
                kwargs.update({o.name: call.tensors[o.name] for o in call.plan.operands
                               if o.is_read and call.tensors.get(o.name) is not None
                               and o.name not in kwargs and o.name not in ALIASES.values()})
            if "backend" in params:
                kwargs["backend"] = BACKEND
            return kwargs
    raise ValueError(f"{fn.__name__}: no plan call of the sample supplies {required}")


def stubbed_eager(fn, kwargs):
    """``fn(**kwargs)`` as a thunk, after one real call built its cached plans, whose launchers
    are then stubbed."""
    fn(**kwargs)
    for plan in EAGER_PLANS.plans():
        stub_launch(plan)
    return lambda: fn(**kwargs)


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--reps", type=int, default=200, help="timed batches per row")
    args = p.parse_args(argv)
    reps = 5 if args.quick else args.reps
    torch.set_num_threads(1)
    a, b = torch.ones(1), torch.ones(1)
    floors = {"torch.add (1 element)": time_us(lambda: torch.add(a, b), reps),
              "empty custom op": time_us(lambda: _empty_op(a), reps)}
    report = harness.Report("Host overhead at the launch floor", harness.device_name(DEVICE),
                            {f"{k} µs": v for k, v in floors.items()},
                            versions=harness.versions())
    unit = floors["empty custom op"]
    for name, us in floors.items():
        report.add(kind="floor", family="torch", case=name, impl="torch", us=us,
                   **{"x op floor": us / unit})
    for info in FAMILIES:
        case = info.cases("small", dtype=torch.float32, device=DEVICE, backend=BACKEND)[0]
        calls = info.plan_calls(case, BACKEND)
        for call in calls:
            plan, kwargs = ready(call)
            us = time_us(lambda: plan.execute(**kwargs), reps)
            report.add(kind="execute", family=info.name, case=f"{call.plan.__name__}.execute",
                       impl="fusedops", us=us, **{"x op floor": us / unit})
        for kind, fns in (("eager", info.eager), ("torch op", info.torch_ops)):
            for fn in fns:
                us = time_us(stubbed_eager(fn, bind(fn, calls)), reps)
                report.add(kind=kind, family=info.name, case=fn.__name__, impl="fusedops",
                           us=us, **{"x op floor": us / unit})
    report.finish(args, "us", label=lambda r: r["case"])


if __name__ == "__main__":
    main()
