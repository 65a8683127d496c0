"""fusedops.compat: mamba_ssm, flash-attn and cuDNN signatures over the fusedops operators, and
transformers' NemotronH running with them in place of its fallbacks (its kernel hooks and its
attention-function registry)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fusedops
from fusedops import compat
from fusedops.errors import UnsupportedError

from helpers import DEVICE

ROOT = pathlib.Path(__file__).resolve().parents[1]


def rnd(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_mamba_chunk_scan_combined_signature():
    b, l, h, p, g, n = 1, 40, 4, 16, 2, 16
    x, dt, B, C, z = rnd(b, l, h, p, seed=1), rnd(b, l, h, seed=2), rnd(b, l, g, n, seed=3), rnd(b, l, g, n, seed=4), rnd(b, l, h, p, seed=5)
    A, D, bias = -torch.rand(h, device=DEVICE) - 0.5, rnd(h, seed=6), rnd(h, seed=7)
    y, final = compat.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D=D, z=z, dt_bias=bias, dt_softplus=True,
                                                return_final_states=True)
    ref = fusedops.mamba2_chunk_scan_forward(x, dt, A, B, C, 16, D=D, z=z, dt_bias=bias, dt_softplus=True)
    assert torch.equal(y, ref["y"]) and torch.equal(final, ref["final_states"])
    seq_idx = torch.tensor([[0] * 15 + [1] * 25], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    y1, last, states = compat.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D=D, seq_idx=seq_idx,
                                                        cu_seqlens=cu, return_final_states=True,
                                                        return_varlen_states=True)
    ref = fusedops.mamba2_chunk_scan_forward(x, dt, A, B, C, 16, D=D, cu_seqlens=cu)
    torch.testing.assert_close(y1, ref["y"], rtol=1e-5, atol=1e-5)   # seq_idx and cu_seqlens paths
    torch.testing.assert_close(states, ref["final_states"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, ref["final_states"][-1:], rtol=1e-5, atol=1e-5)
    leaf = x.clone().requires_grad_()
    compat.mamba_chunk_scan_combined(leaf, dt, A, B, C, 16).sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


def test_selective_state_update_takes_mamba2_expanded_views():
    b, h, p, g, n = 3, 4, 8, 2, 16
    state = rnd(b, h, p, n, seed=1)
    x, dt, B, C = rnd(b, h, p, seed=2), rnd(b, h, seed=3), rnd(b, g, n, seed=4), rnd(b, g, n, seed=5)
    A, D, bias = -torch.rand(h, device=DEVICE) - 0.5, rnd(h, seed=6), rnd(h, seed=7)
    expected_state = state.clone()
    expected = fusedops.mamba2_state_update(expected_state, x, dt, A, B, C, D=D, dt_bias=bias,
                                            dt_softplus=True)["y"]
    out = compat.selective_state_update(state, x, dt[..., None].expand(b, h, p), A[:, None, None].expand(h, p, n),
                                        B, C, D=D[:, None].expand(h, p), dt_bias=bias[:, None].expand(h, p),
                                        dt_softplus=True)
    assert torch.equal(out, expected) and torch.equal(state, expected_state)
    with pytest.raises(UnsupportedError, match="selective_state_update: dt: expected values tied"):
        compat.selective_state_update(state, x, rnd(b, h, p, seed=8), A, B, C)


def test_flash_attn_functions():
    q, k, v = rnd(2, 33, 4, 32, seed=1), rnd(2, 33, 2, 32, seed=2), rnd(2, 33, 2, 32, seed=3)
    o = compat.flash_attn_func(q, k, v, causal=True)
    ref = fusedops.gqa_attention_forward(q, k, v, causal=True)
    assert torch.equal(o, ref["o"])
    o2, lse, mask = compat.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(lse, ref["lse"]) and mask is None
    cu = torch.tensor([0, 10, 33], dtype=torch.int32, device=DEVICE)
    ov = compat.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 23, 23, causal=True)
    rv = fusedops.gqa_attention_forward(q[0], k[0], v[0], causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        max_seqlen_q=23, max_seqlen_k=23)
    assert torch.equal(ov, rv["o"])
    with pytest.raises(UnsupportedError, match="flash_attn_func: dropout_p: fusedops does not implement it"):
        compat.flash_attn_func(q, k, v, dropout_p=0.1)
    k_cache, v_cache = torch.zeros(2, 64, 2, 32, device=DEVICE), torch.zeros(2, 64, 2, 32, device=DEVICE)
    k_cache[:, :33], v_cache[:, :33] = k, v
    kc, vc = k_cache.clone(), v_cache.clone()
    lengths = torch.tensor([33, 20], dtype=torch.int32, device=DEVICE)
    qn, kn, vn = rnd(2, 1, 4, 32, seed=4), rnd(2, 1, 2, 32, seed=5), rnd(2, 1, 2, 32, seed=6)
    out = compat.flash_attn_with_kvcache(qn, k_cache, v_cache, kn, vn, cache_seqlens=lengths, causal=True)
    ref = fusedops.gqa_attention_decode(qn, kn, vn, kc, vc, lengths)
    assert torch.equal(out, ref["o"]) and torch.equal(k_cache, kc)


def test_cudnn_names_run_the_seed_example():
    n, s, d = 64, 4, 64
    x, kv = rnd(n, s, d, seed=1), rnd(n, (s + 1) * d, seed=2)
    weight, mask, grad_out = 1 + 0.1 * rnd(s, d, seed=3), rnd(n, seed=4) > 0, rnd(n, s, d, seed=5)
    cudnn = compat.cudnn
    forward = cudnn.engram_gate_saved_forward(x, kv, weight, mask, backend="frost")
    backward = cudnn.engram_gate_saved_backward(x, kv, weight, forward["saved"], grad_out, backend="frost")
    f = cudnn.EngramGateSavedForward(x, kv, weight, mask, backend="frost")
    f.compile()
    saved, out = torch.empty_like(forward["saved"]), torch.empty_like(x)
    f.execute(x, kv, weight, mask, out, saved)
    b = cudnn.EngramGateSavedBackward(x, kv, weight, saved, grad_out, backend="frost")
    b.compile()
    dx, dkv, dw = torch.empty_like(x), torch.empty_like(kv), torch.empty_like(weight)
    b.execute(x, kv, weight, saved, grad_out, dx, dkv, dw, b.allocate_workspace())
    assert torch.equal(out, forward["out"]) and torch.equal(dx, backward["grad_x"])
    assert torch.equal(dkv, backward["grad_kv"]) and torch.equal(dw, backward["grad_weight"])


# -- transformers' NemotronH through its kernel hooks ---------------------------------------------
HOOKED_RUN = r'''
import json, sys, types, torch
if sys.argv[1] == "fusedops":
    # what transformers imports when mamba_ssm is installed, served by fusedops.compat
    from fusedops import compat
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        sys.modules[name] = types.ModuleType(name)
    ssd = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    ssd.mamba_chunk_scan_combined = compat.mamba_chunk_scan_combined
    ssu = types.ModuleType("mamba_ssm.ops.triton.selective_state_update")
    ssu.selective_state_update = compat.selective_state_update
    sys.modules[ssd.__name__], sys.modules[ssu.__name__] = ssd, ssu
    sys.modules["mamba_ssm"].ops = sys.modules["mamba_ssm.ops"]
    sys.modules["mamba_ssm.ops"].triton = sys.modules["mamba_ssm.ops.triton"]
    sys.modules["mamba_ssm.ops.triton"].ssd_combined = ssd
    sys.modules["mamba_ssm.ops.triton"].selective_state_update = ssu
import transformers
calls = []
if sys.argv[1] == "fusedops":
    # recent transformers (5.25 here) sends inputs on devices mamba_ssm does not serve (CPU) to its
    # torch path; the stand-in serves every device
    from transformers.integrations import hub_kernels
    getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}).pop("mamba_ssm", None)
    # attention through transformers' attention-function registry, served by flash_attn_func
    def fusedops_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(query.shape[2])
        out = compat.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     softmax_scale=scaling, causal=True)
        return out, None
    transformers.AttentionInterface.register("fusedops", fusedops_attention)
    transformers.AttentionMaskInterface.register("fusedops", transformers.masking_utils.sdpa_mask)

config = transformers.NemotronHConfig(
    vocab_size=97, hidden_size=64, layers_block_type=["linear_attention", "full_attention", "linear_attention"],
    mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64, tie_word_embeddings=False)
if sys.argv[1] == "fusedops":
    config._attn_implementation = "fusedops"
torch.manual_seed(0)
model = transformers.NemotronHForCausalLM(config).eval()
ids = torch.randint(0, 97, (1, 21), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = model(ids, use_cache=False).logits
    generated = model.generate(ids, max_new_tokens=5, do_sample=False)
model.train()
loss = model(ids, labels=ids, use_cache=False).loss
loss.backward()
grad = model.model.layers[0].mixer.in_proj.weight.grad
print(json.dumps(dict(attention=model.config._attn_implementation, attention_calls=calls, logits=logits.flatten()[:200].tolist(), generated=generated[0].tolist(),
                      loss=loss.item(), grad=grad.flatten()[:200].tolist())))
'''


def _hooked(mode):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", HOOKED_RUN, mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_transformers_nemotron_h_runs_on_fusedops_through_its_kernel_hooks():
    pytest.importorskip("transformers")
    ours, log = _hooked("fusedops")
    theirs, reference_log = _hooked("torch")
    assert "falling back to its reference PyTorch implementation" in reference_log
    for name in ("mamba_chunk_scan_combined", "selective_state_update"):
        assert f"`{name}` is falling back" in reference_log and f"`{name}` is falling back" not in log
    assert ours["attention"] == "fusedops" and ours["generated"] == theirs["generated"]
    assert 21 in ours["attention_calls"] and 1 in ours["attention_calls"]   # prefill and decode steps
    for key in ("logits", "grad"):
        a, b = torch.tensor(ours[key]), torch.tensor(theirs[key])
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), key
    assert math.isclose(ours["loss"], theirs["loss"], rel_tol=1e-5)
