"""Exceptions raised by fusedops.

Every error that comes from a caller's input names the argument, what was expected and what was
given. Catch ``FusedOpsError`` for all of them, or the narrower types below.
"""

__all__ = ["FusedOpsError", "PlanStateError", "UnsupportedError", "ValidationError"]


class FusedOpsError(Exception):
    """Base class of every fusedops exception."""


class ValidationError(FusedOpsError, ValueError):
    """An argument violates the operator's contract (dtype, shape, stride, device, range...)."""


class UnsupportedError(ValidationError):
    """A valid request that the selected backend, device or installed toolchain cannot serve."""


class PlanStateError(FusedOpsError, RuntimeError):
    """A plan method was called out of order (for example execute() before compile())."""
