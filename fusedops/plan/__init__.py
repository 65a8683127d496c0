"""Plan machinery: the declarative ``Plan`` base class, operand declarations, backend selection
and the eager plan cache. Operator packages build their plans on it."""

from .base import Plan
from .cache import EAGER_PLANS, PlanCache
from .operands import Operand, indices, inputs, outputs, saved_buffer, status_word, updated
from .selection import BACKENDS, backend_unavailable_reason, select_backend

__all__ = ["BACKENDS", "EAGER_PLANS", "Operand", "Plan", "PlanCache", "backend_unavailable_reason",
           "indices", "inputs", "outputs", "saved_buffer", "select_backend", "status_word",
           "updated"]
