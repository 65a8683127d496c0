"""Index-data fuzzing: run a plan on drawn index tensors (in range and out of range) with every
buffer inside guard bands, and report what a memory-safety test asserts: that no byte outside
the buffers changed, the status word the kernels reported, and the outputs.

Each family's registry entry draws its cases (``OpInfo.index_fuzz(seed, backend, device)``);
``tests/test_index_fuzz.py`` runs them per (family, backend) in a child process, so an access
far outside the buffers (a crash in the Triton interpreter) fails the test instead of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..core.status import STATUS_DTYPE, Status, read_status
from ..opinfo import PlanCall

GUARD_BYTES = 256
CANARY = 0xA5


@dataclass(frozen=True)
class FuzzCase:
    """One draw: the plan call (its tensors include the index tensors, and ``status`` is added
    by the harness) and the status bits a correct run reports (``Status.OK``: valid data).
    ``prepare(backend)``: tensors the call needs that depend on the backend, such as the opaque
    saved buffer a backward reads (run the forward on that backend with the same index data)."""

    label: str
    call: PlanCall
    expected: Status
    prepare: Callable[[str], dict] | None = None


@dataclass
class FuzzResult:
    label: str
    status: Status
    damaged: list[str]                       # buffers whose guard bands changed
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


class Guarded:
    """A tensor placed inside a byte buffer with GUARD_BYTES of canary before and after it."""

    def __init__(self, like: torch.Tensor, fill=None, alignment: int = 16) -> None:
        nbytes = like.numel() * like.element_size()
        buffer = torch.full((alignment + GUARD_BYTES + nbytes + GUARD_BYTES,), CANARY,
                            dtype=torch.uint8, device=like.device)
        skip = -(buffer.data_ptr() + GUARD_BYTES) % alignment    # the body starts aligned
        self.buffer = buffer[skip:skip + GUARD_BYTES + nbytes + GUARD_BYTES]
        body = self.buffer[GUARD_BYTES:GUARD_BYTES + nbytes]
        self.tensor = body.view(like.dtype).view(like.shape) if like.numel() else \
            torch.empty(like.shape, dtype=like.dtype, device=like.device)
        if fill is None:
            self.tensor.copy_(like)
        else:
            body.fill_(fill)

    def intact(self) -> bool:
        head = self.buffer[:GUARD_BYTES]
        tail = self.buffer[self.buffer.numel() - GUARD_BYTES:]
        return bool((head == CANARY).all() and (tail == CANARY).all())


def run_guarded(case: FuzzCase, backend: str) -> FuzzResult:
    """Builds the plan with a status word, places every buffer execute() touches (inputs,
    outputs, updated tensors, workspace, status) in guard bands, poisons the outputs and the
    workspace, executes, and reports the status, the damaged guards and the outputs."""
    device = next(t.device for t in case.call.tensors.values() if isinstance(t, torch.Tensor))
    status = torch.zeros(1, dtype=STATUS_DTYPE, device=device)
    extra = case.prepare(backend) if case.prepare is not None else {}
    call = PlanCall(case.call.plan, {**case.call.tensors, **extra, "status": status},
                    case.call.options)
    plan = call.build(backend).compile()
    guards: dict[str, Guarded] = {}
    for operand in plan.operands:
        value = call.tensors.get(operand.name)
        if operand.role == "out" and operand.name in plan._descs and value is None:
            desc = plan.desc(operand.name)
            guards[operand.name] = Guarded(torch.empty(desc.shape, dtype=desc.dtype, device=device),
                                           fill=0xFF)
        elif isinstance(value, torch.Tensor) and operand.name in plan._descs:
            guards[operand.name] = Guarded(value)
    args = {name: g.tensor for name, g in guards.items()}
    if plan.workspace_size:
        guards["workspace"] = Guarded(torch.empty(plan.workspace_size, dtype=torch.uint8,
                                                  device=device), fill=0xFF,
                                      alignment=plan._workspace_alignment)
        args["workspace"] = guards["workspace"].tensor
    plan.execute(**args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # outputs compared across backends: not the status word, not an opaque saved buffer (its
    # layout is the backend's own)
    written = {o.name for o in plan.operands
               if o.is_written and o.name != "status" and not o.saved_buffer}
    return FuzzResult(case.label, read_status(args["status"]),
                      sorted(name for name, g in guards.items() if not g.intact()),
                      {name: args[name].clone() for name in written if name in args})
