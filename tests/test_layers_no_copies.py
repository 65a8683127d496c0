"""The layers hand their activations to the fusedops plans as views, without copies.

A small Nemotron-H-style stack (Mamba2, attention, Mamba2 mixers with residuals) runs forward +
backward, then a prefill and a decode step, through fusedops.layers under the torch profiler
(CPU, with shapes recorded). Outside the plans' own runs (``Plan._run``, marked in the profile:
there a backend computes and writes its outputs), no ``aten::contiguous`` / ``aten::clone`` /
``aten::copy_`` may copy a tensor of the shape of an activation the layers hand to a plan: the
scan's x, dt, B, C (and their [b, l, width] forms before the head split, the conv output they
are slices of, and the gradient dy), the state update's one-token x, dt, B, C, and attention's
q, k, v. That covers the layers, the fusedops.ops wrappers and the autograd glue between them.
The shapes are chosen so that no other tensor of the stack (states, caches, weights, the
projections, the hidden states) shares them. Adding a ``.contiguous()`` (or a reshape that
copies) on any of those activations turns this test red (shown by the last test).

One copy is not an activation's and is left out by name: autograd's ``aten::slice_backward``
writes the gradient of the causal conv's first l outputs into the conv's padded gradient
(conv1d's ``[..., :l]`` did the same).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from fusedops import layers
from fusedops.layers import modules as layer_modules
from fusedops.plan import Plan

from helpers import BACKENDS, DEVICE

LAYER_BACKENDS = [b for b in BACKENDS if b in ("torch", "triton")]
COPIES = ("aten::contiguous", "aten::clone", "aten::copy_")

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE = 48, 4, 16, 2, 8          # Mamba2: p = 16, n = 8
Q_HEADS, KV_HEADS, ATT_DIM = 4, 2, 8                                 # attention
BATCH, TOKENS = 2, 20


class Stack(nn.Module):
    """Mamba2 -> attention -> Mamba2, each as h + mixer(rmsnorm(h))."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.mixers = nn.ModuleList([
            layers.Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, chunk_size=16, backend=backend),
            layers.GQAAttention(HIDDEN, Q_HEADS, KV_HEADS, ATT_DIM, backend=backend),
            layers.Mamba2Mixer(HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, chunk_size=16, backend=backend)])
        self.norms = nn.ModuleList([nn.RMSNorm(HIDDEN) for _ in self.mixers])

    def forward(self, h, states=None):
        for i, (norm, mixer) in enumerate(zip(self.norms, self.mixers)):
            kwargs = {} if states is None else dict(state=states[i])
            out = mixer(norm(h), **kwargs)
            h = h + (out[0] if isinstance(mixer, layers.GQAAttention) else out)
        return h

    def allocate_states(self, batch: int, capacity: int):
        return [m.allocate_state(batch, capacity) if isinstance(m, layers.GQAAttention)
                else m.allocate_state(batch) for m in self.mixers]


def activation_shapes(b: int, l: int) -> set[tuple[int, ...]]:
    """Every shape an activation handed to a plan (or its [b, l, width] form) has."""
    inter, gn = HEADS * HEAD_DIM, GROUPS * STATE
    return {(b, l, HEADS, HEAD_DIM), (b, l, inter), (b, l, HEADS), (b, l, GROUPS, STATE),
            (b, l, gn), (b, l, inter + 2 * gn), (b, l, Q_HEADS, ATT_DIM), (b, l, KV_HEADS, ATT_DIM),
            (b, l, Q_HEADS * ATT_DIM), (b, l, KV_HEADS * ATT_DIM)}


PLAN_RUN = "fusedops plan run"
EXEMPT = (PLAN_RUN, "aten::slice_backward")


def _inside(event, names) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def activation_copies(prof, shapes) -> list[str]:
    """The copy ops of the profile, outside plan runs and slice_backward, whose source has an
    activation's shape."""
    found = []
    for event in prof.events():
        if event.name not in COPIES or not event.input_shapes or _inside(event, EXEMPT):
            continue
        source = event.input_shapes[1 if event.name == "aten::copy_" else 0]
        if tuple(source) in shapes:
            found.append(f"{event.name}{list(source)}")
    return found


def run_stack(backend: str, monkeypatch):
    """(profile of a training step, profile of a prefill + decode step) of the stack, every
    plan run marked ``PLAN_RUN``."""
    run = Plan._run

    def marked(self, binding, stream):
        with record_function(PLAN_RUN):
            return run(self, binding, stream)
    monkeypatch.setattr(Plan, "_run", marked)
    torch.manual_seed(0)
    stack = Stack(backend).to(DEVICE)
    h = torch.randn(BATCH, TOKENS, HIDDEN, device=DEVICE, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as training:
        stack(h).square().sum().backward()
    states = stack.allocate_states(BATCH, TOKENS + 1)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as decode:
        stack(h.detach(), states)
        stack(torch.randn(BATCH, 1, HIDDEN, device=DEVICE), states)
    assert all(p.grad is not None for p in stack.parameters())
    return training, decode


@pytest.mark.parametrize("backend", LAYER_BACKENDS)
def test_forward_backward_and_decode_copy_no_activation(backend, monkeypatch):
    training, decode = run_stack(backend, monkeypatch)
    assert activation_copies(training, activation_shapes(BATCH, TOKENS)) == []
    assert activation_copies(decode, activation_shapes(BATCH, TOKENS) | activation_shapes(BATCH, 1)) == []
    names = {e.name for e in training.events()}
    assert "fusedops::mamba2_chunk_scan_fwd" in names and "fusedops::mamba2_chunk_scan_bwd" in names
    assert PLAN_RUN in names and PLAN_RUN in {e.name for e in decode.events()}


@pytest.mark.parametrize("where", ["scan-inputs", "conv-layout"])
def test_the_check_sees_a_copy_added_back(monkeypatch, where):
    """The check is live: ``.contiguous()`` put back on x, B and C before the scan, or the conv
    output laid out channels-first again (what the layer did before: x, B and C then need a
    copy each to reach the plans), is caught."""
    if where == "scan-inputs":
        scan = layer_modules.ops.mamba2_chunk_scan

        def copying(x, dt, A, B, C, *args, **kwargs):
            return scan(x.contiguous(), dt, A, B.contiguous(), C.contiguous(), *args, **kwargs)
        monkeypatch.setattr(layer_modules.ops, "mamba2_chunk_scan", copying)
    else:
        conv = layers.Mamba2Mixer._conv_channels_last

        def channels_first(self, xbc, padding):
            return conv(self, xbc, padding).transpose(1, 2).contiguous().transpose(1, 2)
        monkeypatch.setattr(layers.Mamba2Mixer, "_conv_channels_last", channels_first)
    training, _ = run_stack("torch", monkeypatch)
    found = activation_copies(training, activation_shapes(BATCH, TOKENS))
    assert any(name.endswith(f"[{BATCH}, {TOKENS}, {HEADS}, {HEAD_DIM}]") for name in found), found
