"""fusedops.layers in a real client: a tiny transformers NemotronH model (Mamba2, attention and
MoE layers, random weights) with its mixers swapped for fusedops layers gives the same logits and
parameter gradients as the unmodified model, and the same loss curve over optimizer steps with
gradient accumulation."""

from __future__ import annotations

import copy

import pytest
import torch

from fusedops import layers
from fusedops.errors import UnsupportedError

from helpers import DEVICE, runnable_backends

transformers = pytest.importorskip("transformers")
BACKENDS = [b for b in runnable_backends() if b != "cute"]
PATTERN = ["linear_attention", "moe", "full_attention", "linear_attention", "moe"]


def tiny_nemotron_h(seed=0):
    config = transformers.NemotronHConfig(
        vocab_size=97, hidden_size=64, layers_block_type=PATTERN, mamba_num_heads=4, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=6, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, num_experts_per_tok=2, routed_scaling_factor=2.5,
        mlp_hidden_act="relu2", intermediate_size=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config)
    with torch.no_grad():    # move every parameter off its neutral initial value
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D", "norm.weight", "norm_f.weight")):
                p.add_(0.1 * torch.randn_like(p))
        for block in model.model.layers:
            if block.block_type == "moe":
                block.mixer.gate.weight.normal_(std=0.5)
                block.mixer.gate.e_score_correction_bias.normal_(std=0.05)
    return model.to(DEVICE)


def with_fusedops_layers(model, backend):
    """A copy of ``model`` whose Mamba2, attention and MoE mixers are fusedops layers holding the
    same weights."""
    ours = copy.deepcopy(model)
    kinds = {"linear_attention": layers.Mamba2Mixer, "full_attention": layers.GQAAttention,
             "moe": layers.ReLU2MoE}
    for block in ours.model.layers:
        layer = kinds[block.block_type].from_config(model.config, backend=backend).to(DEVICE)
        layer.load_state_dict(block.mixer.state_dict(), strict=True)
        block.mixer = layer
    return ours


def batch(seed, b=2, s=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (b, s), generator=g).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_every_parameter_gradient_match_transformers(backend):
    model = tiny_nemotron_h()
    ours = with_fusedops_layers(model, backend)
    ids = batch(1)
    expected = model(ids, labels=ids, use_cache=False)
    got = ours(ids, labels=ids, use_cache=False)
    assert torch.allclose(got.logits, expected.logits, rtol=1e-4, atol=1e-5)
    expected.loss.backward()
    got.loss.backward()
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        ref = theirs[name].grad
        assert p.grad is not None and ref is not None, name
        scale = ref.abs().max().clamp_min(1e-6)
        assert (p.grad - ref).abs().max() / scale < 1e-4, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_steps_with_gradient_accumulation_follow_the_same_loss_curve(backend):
    model = tiny_nemotron_h(seed=2)
    ours = with_fusedops_layers(model, backend)
    curves = []
    for net in (model, ours):
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
        losses = []
        for step in range(3):
            total = 0.0
            for micro in range(2):
                ids = batch(10 * step + micro)
                loss = net(ids, labels=ids, use_cache=False).loss / 2
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]
    assert torch.allclose(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-4), curves


def greedy_decode(model, ids, new_tokens):
    """Greedy generation through the model's blocks with the fusedops layers' own decode state:
    a prefill of the prompt, then one token per step. Returns (tokens, logits of every step)."""
    backbone = model.model
    b = ids.shape[0]
    states = [block.mixer.allocate_state(b) if block.block_type == "linear_attention" else
              block.mixer.allocate_state(b, ids.shape[1] + new_tokens)
              if block.block_type == "full_attention" else None for block in backbone.layers]
    tokens, step, logits = ids, ids, []
    for _ in range(new_tokens):
        h = backbone.embeddings(step)
        for block, state in zip(backbone.layers, states):
            x = block.norm(h.to(block.norm.weight.dtype))
            if block.block_type == "full_attention":
                x = block.mixer(x, state=state)[0]
            elif block.block_type == "linear_attention":
                x = block.mixer(x, state=state)
            else:
                x = block.mixer(x)
            h = h + x
        step_logits = model.lm_head(backbone.norm_f(h))
        logits.append(step_logits[:, -1])
        step = step_logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, step], dim=1)
    return tokens, torch.stack(logits, 1)


@pytest.mark.parametrize("backend", BACKENDS)
@torch.no_grad()
def test_decoding_with_the_state_update_and_kv_cache_matches_transformers_generate(backend):
    model = tiny_nemotron_h(seed=3).eval()
    ours = with_fusedops_layers(model, backend).eval()
    ids = batch(7, b=2, s=21)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    tokens, step_logits = greedy_decode(ours, ids, 6)
    assert torch.equal(tokens, expected)
    # every decode step's logits equal a full forward over the sequence so far
    full = model(tokens[:, :-1], use_cache=False).logits[:, ids.shape[1] - 1:]
    assert torch.allclose(step_logits, full, rtol=1e-4, atol=1e-4)


def test_layers_reject_a_decode_cache_and_masks_they_do_not_apply():
    attention = layers.GQAAttention(32, 4, 2, 8)
    with pytest.raises(UnsupportedError, match="GQAAttention: attention_mask: expected None"):
        attention(torch.randn(1, 5, 32), attention_mask=torch.ones(1, 1, 5, 5))
    mixer = layers.Mamba2Mixer(32, 4, 8, 2, 16, chunk_size=16)
    with pytest.raises(UnsupportedError, match="Mamba2Mixer: cache: expected None \\(a transformers cache\\)"):
        mixer(torch.randn(1, 5, 32), cache=object())
    assert "heads=4" in repr(mixer) and "kv_heads=2" in repr(attention)
