"""Autograd for the torch backends whose backward differentiates their forward.

fusedops.ops runs the backward plans inside torch.library custom ops, whose implementations run
with the autograd dispatch keys excluded (they are below autograd), so torch.autograd would
record nothing there. ``autograd_recording()`` lifts that exclusion for its block, the way
torch's own higher-order ops re-enter autograd, and enables grad mode.
"""

from __future__ import annotations

import contextlib

import torch

_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")


@contextlib.contextmanager
def autograd_recording():
    """Grad mode with autograd dispatch restored, inside or outside a custom op."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _AUTOGRAD_KEYS:
        exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield
