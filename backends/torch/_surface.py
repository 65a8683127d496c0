"""The parts of a backend surface every torch module shares: the reference math serves every
problem, computes with torch's allocator (no caller workspace) and recomputes in its backward
(nothing saved)."""


def unsupported_reason(problem) -> str | None:
    return None


def saved_size(problem) -> int:
    return 0


def forward_workspace_size(problem) -> int:
    return 0


def backward_workspace_size(problem) -> int:
    return 0
