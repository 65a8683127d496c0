"""fusedops.ops: the operators as torch custom ops — torch.library.opcheck of every forward and
backward op, autograd against the plans' backward, torch.compile(fullgraph=True), and activation
checkpointing."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fusedops
from fusedops import ops

from helpers import DEVICE, runnable_backends

BACKENDS = [b for b in runnable_backends() if b != "cute"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def gate_case(dtype=torch.float32, seed=0):
    g = _gen(seed)
    n, s, d = 6, 2, 32
    return dict(x=torch.randn(n, s, d, generator=g), kv=torch.randn(n, (s + 1) * d, generator=g),
                weight=1 + 0.1 * torch.randn(s, d, generator=g), mask=torch.rand(n, generator=g) > 0.3)


def scan_case(seed=0):
    g = _gen(seed)
    b, l, h, p, gr, n = 1, 24, 2, 16, 1, 16
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h), A=-0.5 - torch.rand(h, generator=g), B=r(b, l, gr, n),
                C=r(b, l, gr, n), D=r(h), z=r(b, l, h, p), dt_bias=r(h), initial_states=r(b, h, p, n))


def attention_case(seed=0):
    g = _gen(seed)
    return dict(q=torch.randn(2, 20, 4, 32, generator=g), k=torch.randn(2, 20, 2, 32, generator=g),
                v=torch.randn(2, 20, 2, 32, generator=g))


def moe_case(seed=0):
    g = _gen(seed)
    t, H, E, I, k = 12, 32, 5, 48, 2
    return dict(x=torch.randn(t, H, generator=g), w_up=torch.randn(E, I, H, generator=g) / H ** 0.5,
                w_down=torch.randn(E, H, I, generator=g) / I ** 0.5,
                logits=torch.randn(t, E, generator=g), shared_w_up=torch.randn(16, H, generator=g) / H ** 0.5,
                shared_w_down=torch.randn(H, 16, generator=g) / 4)


def on_device(case):
    return {k: v.to(DEVICE) for k, v in case.items()}


def leaves(case, names):
    return {k: (v.clone().requires_grad_() if k in names else v) for k, v in case.items()}


# -- opcheck -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_every_op(backend):
    checks = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    gate = on_device(gate_case())
    out, saved = torch.ops.fusedops.engram_gate_fwd(gate["x"], gate["kv"], gate["weight"], gate["mask"], 1e-20, backend)
    samples = [
        (torch.ops.fusedops.engram_gate_fwd, (gate["x"], gate["kv"], gate["weight"], gate["mask"], 1e-20, backend)),
        (torch.ops.fusedops.engram_gate_bwd, (gate["x"], gate["kv"], gate["weight"], saved, torch.ones_like(out), backend)),
    ]
    s = on_device(scan_case())
    core = [s[k] for k in ("x", "dt", "A", "B", "C")]
    opt = [s[k] for k in ("D", "z", "dt_bias", "initial_states")]
    y, final, ssaved = torch.ops.fusedops.mamba2_chunk_scan_fwd(*core, *opt, None, None, 16, True,
                                                                [0.0, math.inf], backend)
    samples += [
        (torch.ops.fusedops.mamba2_chunk_scan_fwd, (*core, *opt, None, None, 16, True, [0.0, math.inf],
                                                    backend)),
        (torch.ops.fusedops.mamba2_chunk_scan_bwd, (*core, torch.ones_like(y), ssaved, *opt, None, None,
                                                    torch.ones_like(final), 16, True, [0.0, math.inf], backend)),
    ]
    a = on_device(attention_case())
    attn_opts = (None, None, None, None, True, None, [-1, -1], backend)
    o, lse = torch.ops.fusedops.gqa_attention_fwd(a["q"], a["k"], a["v"], *attn_opts)
    samples += [
        (torch.ops.fusedops.gqa_attention_fwd, (a["q"], a["k"], a["v"], *attn_opts)),
        (torch.ops.fusedops.gqa_attention_bwd, (a["q"], a["k"], a["v"], o, lse, torch.ones_like(o), *attn_opts)),
    ]
    m = on_device(moe_case())
    router_opts = (None, 2, 1, 1, True, 2.5, backend)
    w, ids = torch.ops.fusedops.moe_router_fwd(m["logits"], *router_opts)
    moe_args = (m["x"], m["w_up"], m["w_down"], ids, w, m["shared_w_up"], m["shared_w_down"], backend)
    out, msaved = torch.ops.fusedops.relu2_moe_fwd(*moe_args)
    samples += [
        (torch.ops.fusedops.moe_router_fwd, (m["logits"], *router_opts)),
        (torch.ops.fusedops.moe_router_bwd, (m["logits"], ids, torch.ones_like(w), True, 2.5, backend)),
        (torch.ops.fusedops.relu2_moe_bwd, (*moe_args[:5], torch.ones_like(out), msaved, *moe_args[5:])),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args, test_utils=checks)
    # the kernels' saved buffer has bytes nothing writes (row padding, alignment gaps), so two runs
    # of the forward differ there; test_torch_compile_fullgraph_and_checkpointing compares out
    moe_checks = checks if backend == "torch" else checks[:-1]
    torch.library.opcheck(torch.ops.fusedops.relu2_moe_fwd, moe_args, test_utils=moe_checks)


# -- autograd --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_autograd_equals_the_backward_plans(backend):
    a = on_device(attention_case(1))
    la = leaves(a, ("q", "k", "v"))
    o = ops.gqa_attention(la["q"], la["k"], la["v"], causal=True, backend=backend)
    do = torch.randn_like(o)
    o.backward(do)
    f = fusedops.gqa_attention_forward(a["q"], a["k"], a["v"], causal=True, backend=backend)
    g = fusedops.gqa_attention_backward(a["q"], a["k"], a["v"], f["o"], f["lse"], do, causal=True, backend=backend)
    assert torch.equal(o, f["o"])
    for name, grad in zip(("q", "k", "v"), g.values()):
        assert torch.equal(la[name].grad, grad), name

    m = on_device(moe_case(2))
    lm = leaves(m, ("x", "w_up", "w_down", "logits", "shared_w_up", "shared_w_down"))
    w, ids = ops.moe_router(lm["logits"], 2, routed_scaling_factor=2.5, backend=backend)
    out = ops.relu2_moe(lm["x"], lm["w_up"], lm["w_down"], ids, w, shared_w_up=lm["shared_w_up"],
                        shared_w_down=lm["shared_w_down"], backend=backend)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    w2, ids2 = fusedops.moe_router(m["logits"], 2, routed_scaling_factor=2.5, backend=backend)
    shared = dict(shared_w_up=m["shared_w_up"], shared_w_down=m["shared_w_down"])
    out2, saved = fusedops.relu2_moe_forward(m["x"], m["w_up"], m["w_down"], ids2, w2, **shared, backend=backend)
    g = fusedops.relu2_moe_backward(m["x"], m["w_up"], m["w_down"], ids2, w2, d_out, saved, **shared,
                                    backend=backend)
    d_logits = fusedops.moe_router_backward(m["logits"], ids2, g["d_topk_weights"],
                                            routed_scaling_factor=2.5, backend=backend)["d_logits"]
    assert torch.equal(ids, ids2) and torch.equal(out, out2)
    expected = dict(x=g["d_x"], w_up=g["d_w_up"], w_down=g["d_w_down"], logits=d_logits,
                    shared_w_up=g["d_shared_w_up"], shared_w_down=g["d_shared_w_down"])
    for name, grad in expected.items():
        assert torch.allclose(lm[name].grad, grad.to(lm[name].dtype), rtol=1e-6, atol=1e-7), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_scan_and_gate_gradients_match_the_plans(backend):
    s = on_device(scan_case(3))
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    ls = leaves(s, names)
    y, final = ops.mamba2_chunk_scan(*(ls[k] for k in ("x", "dt", "A", "B", "C")), 16, dt_softplus=True,
                                     **{k: ls[k] for k in names[5:]}, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)     # final_states unused: its gradient is zero
    opts = dict(dt_softplus=True, backend=backend, **{k: s[k] for k in names[5:]})
    f = fusedops.mamba2_chunk_scan_forward(*(s[k] for k in names[:5]), 16, **opts)
    g = fusedops.mamba2_chunk_scan_backward(*(s[k] for k in names[:5]), dy, f["saved"], 16,
                                            dfinal_states=torch.zeros_like(final), **opts)
    assert torch.equal(y, f["y"])
    for name, grad in zip(names, g.values()):
        assert torch.allclose(ls[name].grad, grad, rtol=1e-6, atol=1e-6), name

    gt = on_device(gate_case(seed=4))
    lg = leaves(gt, ("x", "kv", "weight"))
    out = ops.engram_gate(lg["x"], lg["kv"], lg["weight"], gt["mask"], backend=backend)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    f = fusedops.engram_gate_saved_forward(gt["x"], gt["kv"], gt["weight"], gt["mask"], backend=backend)
    g = fusedops.engram_gate_saved_backward(gt["x"], gt["kv"], gt["weight"], f["saved"], grad_out,
                                            backend=backend)
    for name, grad in zip(("x", "kv", "weight"), g.values()):
        assert torch.equal(lg[name].grad, grad), name


# -- torch.compile and checkpointing -----------------------------------------------------------------
def _block(q, k, v, x, w_up, w_down, logits, backend):
    """attention, then router + experts on its output rows: every op in one graph."""
    o = ops.gqa_attention(q, k, v, causal=True, backend=backend)
    h = o.reshape(-1, o.shape[-2] * o.shape[-1])[: x.shape[0], : x.shape[1]] + x
    w, ids = ops.moe_router(logits, 2, routed_scaling_factor=2.5, backend=backend)
    return ops.relu2_moe(h, w_up, w_down, ids, w, backend=backend)


def _grads_of(fn, case, names):
    lc = leaves(case, names)
    out = fn(*(lc[n] for n in ("q", "k", "v", "x", "w_up", "w_down", "logits")))
    out.backward(torch.ones_like(out))
    return out.detach(), [lc[n].grad for n in names]


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_and_checkpointing(backend):
    case = {**on_device(attention_case(5)), **on_device(moe_case(6))}
    case["x"] = case["x"][:, :32].contiguous()
    names = ("q", "k", "v", "x", "w_up", "w_down", "logits")
    eager = lambda *a: _block(*a, backend)  # noqa: E731
    ref_out, ref_grads = _grads_of(eager, case, names)
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    out, grads = _grads_of(compiled, case, names)
    assert torch.equal(out, ref_out)
    for name, a, b in zip(names, grads, ref_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name
    checkpointed = lambda *a: checkpoint(eager, *a, use_reentrant=False)  # noqa: E731
    out, grads = _grads_of(checkpointed, case, names)
    assert torch.equal(out, ref_out)
    for name, a, b in zip(names, grads, ref_grads):
        assert torch.equal(a, b), name
