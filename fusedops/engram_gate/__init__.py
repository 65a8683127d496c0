"""Engram saved-state gate: contract, plans, eager wrappers, torch op, samples and oracle.
See docs/engram_gate.md."""

from .contract import ACTIVATION_DTYPES, DEFAULT_EPS, DOT_CLAMP, GateProblem
from .plans import (EngramGateSavedBackward, EngramGateSavedForward, engram_gate_saved_backward,
                    engram_gate_saved_forward)

__all__ = ["EngramGateSavedBackward", "EngramGateSavedForward", "engram_gate_saved_backward",
           "engram_gate_saved_forward"]
