"""Backends of fusedops, installed as ``fusedops.backends``.

Each backend package states its own availability, ``unavailable_reason(device)`` (toolchain,
device, interpreter or emulator), without importing its toolchain, and holds one module per
operator family. A family module knows how to compute and never validates user input (the plan
has done that). Its surface, for a family whose plans name programs ``forward``/``backward``:

    unsupported_reason(problem) -> str | None     why this backend cannot serve the problem
    forward_program(problem) -> Program           buffers and stages (fusedops.core.program)
    backward_program(problem) -> Program

A backend imports fusedops.core, the operators' contracts and its own modules; never a plan,
another backend, or a module above the contracts (tests/test_architecture.py).
"""
