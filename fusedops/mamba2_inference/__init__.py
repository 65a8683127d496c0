"""Mamba2 inference: the state update (snapshots, storage policies), rollback and replay:
contract, plans, eager wrappers, samples and oracle. See docs/mamba2_inference.md."""

from .contract import ACTIVATION_DTYPES, ROUNDINGS, STATE_DTYPES, DecodeProblem, RollbackProblem
from .plans import (Mamba2StateRollback, Mamba2StateUpdate, mamba2_replay, mamba2_rollback,
                    mamba2_state_update)

__all__ = ["Mamba2StateRollback", "Mamba2StateUpdate", "mamba2_replay", "mamba2_rollback",
           "mamba2_state_update"]
