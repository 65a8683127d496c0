"""Declarations of a plan's tensors: what execute() takes, reads and writes."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.checks import ALIGNMENT

ROLES = ("in", "out", "inout")


@dataclass(frozen=True)
class Operand:
    """One tensor parameter of a plan.

    ``role``: "in" (read), "out" (written) or "inout" (read and written in place, e.g. a KV
    cache). ``optional``: may be absent (None at construction; execute then takes None).
    ``alignment``: bytes the data pointer must be aligned to (16 where kernels vectorise, the
    element size for index tensors). ``saved_buffer``: an opaque byte buffer whose size the
    selected backend's program decides (``Program.saved``), declared by the plan, not given
    at construction. ``strided``: execute() takes any view whose last dimension is contiguous
    and whose other strides are multiples of 16 bytes (its kernels read the strides of the
    tensor they are handed); otherwise the strides must be the planned ones.
    """

    name: str
    role: str
    optional: bool = False
    alignment: int = ALIGNMENT
    saved_buffer: bool = False
    strided: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Operand {self.name}: role must be one of {ROLES}, got {self.role!r}")

    @property
    def is_read(self) -> bool:
        return self.role in ("in", "inout")

    @property
    def is_written(self) -> bool:
        return self.role in ("out", "inout")


def inputs(*names: str, optional: bool = False, alignment: int = ALIGNMENT,
           strided: bool = False) -> tuple[Operand, ...]:
    """Read-only operands."""
    return tuple(Operand(n, "in", optional, alignment, strided=strided) for n in names)


def outputs(*names: str, optional: bool = False, alignment: int = ALIGNMENT,
            strided: bool = False) -> tuple[Operand, ...]:
    """Written operands."""
    return tuple(Operand(n, "out", optional, alignment, strided=strided) for n in names)


def updated(*names: str, optional: bool = False, alignment: int = ALIGNMENT,
            strided: bool = False) -> tuple[Operand, ...]:
    """Operands read and written in place."""
    return tuple(Operand(n, "inout", optional, alignment, strided=strided) for n in names)


def indices(*names: str, optional: bool = False, alignment: int = 4) -> tuple[Operand, ...]:
    """Read-only index tensors (int32: 4-byte alignment)."""
    return inputs(*names, optional=optional, alignment=alignment)


def saved_buffer(role: str, *, optional: bool = False) -> tuple[Operand, ...]:
    """The opaque ``saved`` byte buffer: written by a forward ("out"), read by its backward
    ("in")."""
    return (Operand("saved", role, optional, ALIGNMENT, saved_buffer=True),)


def status_word() -> tuple[Operand, ...]:
    """The optional int32 [1] status word the kernels OR violation bits into
    (``fusedops.core.status``): given at construction to compile the reporting in."""
    return (Operand("status", "inout", optional=True, alignment=4),)
