"""The Engram saved-state gate under cuDNN frontend's names: ``backend="frost"``
(cuDNN's engine name) selects fusedops' automatic choice; every other argument is the same."""

from __future__ import annotations

from fusedops import engram_gate as engram

__all__ = ["EngramGateSavedBackward", "EngramGateSavedForward", "TensorDesc",
           "engram_gate_saved_backward", "engram_gate_saved_forward"]

from fusedops import TensorDesc  # noqa: E402


def _backend(backend: str) -> str:
    return "auto" if backend == "frost" else backend


class EngramGateSavedForward(engram.EngramGateSavedForward):
    __doc__ = engram.EngramGateSavedForward.__doc__

    def __init__(self, *args, backend: str = "frost", **kwargs) -> None:
        super().__init__(*args, backend=_backend(backend), **kwargs)


class EngramGateSavedBackward(engram.EngramGateSavedBackward):
    __doc__ = engram.EngramGateSavedBackward.__doc__

    def __init__(self, *args, backend: str = "frost", **kwargs) -> None:
        super().__init__(*args, backend=_backend(backend), **kwargs)


def engram_gate_saved_forward(*args, backend: str = "frost", **kwargs):
    """cudnn.engram_gate_saved_forward: TupleDict(out, saved)."""
    return engram.engram_gate_saved_forward(*args, backend=_backend(backend), **kwargs)


def engram_gate_saved_backward(*args, backend: str = "frost", **kwargs):
    """cudnn.engram_gate_saved_backward: TupleDict(grad_x, grad_kv, grad_weight)."""
    return engram.engram_gate_saved_backward(*args, backend=_backend(backend), **kwargs)
