"""Single-process torch.nn layers built on fusedops.ops: drop-in mixers of a Nemotron-H / Nemotron 3 model.

Parameter names and shapes follow transformers' NemotronH modules, so ``layer.load_state_dict(
hf_module.state_dict())`` moves weights either way, and each mixer's ``forward`` takes what
transformers' ``NemotronHBlock`` passes it. The operators run through differentiable custom ops
(autograd, torch.compile, checkpointing); their plans are cached per shape.

Incremental decoding uses fusedops' own per-layer state (``layer.allocate_state(...)``, passed
as ``state=``): the Mamba2 mixer keeps its convolution tail and fp32 SSM state and steps with the
Mamba2 state update; attention keeps a KV cache and steps with the KV-cache decode. A
transformers ``cache`` object is rejected with a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..core.dtypes import accumulator_dtype
from ..engram_gate import DEFAULT_EPS
from ..errors import UnsupportedError, ValidationError
from ..mamba2_scan import CHUNK_SIZES


def _no_cache(layer: str, cache) -> None:
    if cache is not None:
        raise UnsupportedError(
            f"{layer}: cache: expected None (a transformers cache); decode with the layer's own "
            "state: layer.allocate_state(...) passed as state=")


@dataclass
class Mamba2State:
    """A Mamba2 mixer's decode state: conv [b, conv_dim, kernel - 1] (the last inputs of the
    depthwise convolution, in the activation dtype) and ssm [b, h, p, n] fp32; ``tokens`` seen."""

    conv: torch.Tensor
    ssm: torch.Tensor
    tokens: int = 0


@dataclass
class KVState:
    """An attention layer's KV cache: k, v [b, capacity, h_kv, d] and lengths [b] int32."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor


def _padding_mask(states: torch.Tensor, attention_mask) -> torch.Tensor:
    """Zeroes padded positions given a [b, l] 0/1 mask (what transformers' Mamba mixers do)."""
    if attention_mask is not None and attention_mask.dim() == 2 and states.shape[0] > 1 and states.shape[1] > 1:
        return (states * attention_mask[:, :, None]).to(states.dtype)
    return states


class EngramGate(nn.Module):
    """The Engram saved-state gate (docs/engram_gate.md) with its weight [S, D] (the product of
    the source q/k RMSNorm weights; initialised to ones). forward(x [N, S, D], kv [N, (S+1)·D],
    mask [N] bool or None) -> out [N, S, D]."""

    def __init__(self, streams: int, dim: int, *, eps: float = DEFAULT_EPS, backend: str = "auto") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(streams, dim, dtype=torch.float32))
        self.eps, self.backend = eps, backend

    def forward(self, x, kv, mask=None):
        return ops.engram_gate(x, kv, self.weight, mask, eps=self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"streams={self.weight.shape[0]}, dim={self.weight.shape[1]}, eps={self.eps:g}"


class GatedRMSNorm(nn.Module):
    """y = weight · rmsnorm_g(x · silu(gate)) over groups of ``group_size`` channels (Mamba2's
    norm before out_proj; transformers' NemotronHRMSNormGated)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size, self.variance_epsilon = group_size, eps

    def forward(self, x, gate):
        dtype, compute = x.dtype, accumulator_dtype(x.dtype)
        h = x.to(compute) * F.silu(gate.to(compute))
        g = h.unflatten(-1, (h.shape[-1] // self.group_size, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    """Mamba2 mixer: in_proj -> causal depthwise conv + silu -> chunked scan (fusedops) -> gated
    RMSNorm -> out_proj, with transformers' NemotronHMamba2Mixer parameters (in_proj, conv1d,
    dt_bias, A_log, D, norm.weight, out_proj). forward(hidden_states [b, l, hidden],
    attention_mask [b, l] or None) -> [b, l, hidden]."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int,
                 state_size: int, *, conv_kernel: int = 4, chunk_size: int = 128,
                 time_step_min: float = 0.0, eps: float = 1e-5, use_conv_bias: bool = True,
                 use_bias: bool = False, backend: str = "auto") -> None:
        super().__init__()
        if num_heads % n_groups:
            raise ValidationError(f"n_groups: expected a divisor of num_heads = {num_heads}, got {n_groups}")
        if chunk_size not in CHUNK_SIZES:
            raise ValidationError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size!r}")
        self.num_heads, self.head_dim, self.n_groups, self.state_size = num_heads, head_dim, n_groups, state_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.chunk_size, self.time_step_limit, self.backend = chunk_size, (time_step_min, math.inf), backend
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim,
                                padding=conv_kernel - 1, bias=use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=use_bias)

    @classmethod
    def from_config(cls, config, **options) -> Mamba2Mixer:
        """From a transformers NemotronHConfig."""
        return cls(config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.n_groups,
                   config.ssm_state_size, conv_kernel=config.conv_kernel, chunk_size=config.chunk_size,
                   time_step_min=config.time_step_min, eps=config.layer_norm_epsilon,
                   use_conv_bias=config.use_conv_bias, use_bias=config.use_bias, **options)

    def allocate_state(self, batch: int, *, device=None, dtype=None) -> Mamba2State:
        """A fresh decode state for ``batch`` sequences (zero history)."""
        device = device or self.in_proj.weight.device
        dtype = dtype or self.in_proj.weight.dtype
        return Mamba2State(
            torch.zeros(batch, self.conv_dim, self.conv1d.kernel_size[0] - 1, device=device, dtype=dtype),
            torch.zeros(batch, self.num_heads, self.head_dim, self.state_size, device=device))

    def forward(self, hidden_states, cache=None, attention_mask=None, *, state: Mamba2State | None = None,
                **kwargs):
        """[b, l, hidden] -> [b, l, hidden]. With ``state``: a prefill (fresh state: the chunked
        scan, keeping the final states) or decode steps (the state update), advancing it."""
        _no_cache("Mamba2Mixer", cache)
        b, l, _ = hidden_states.shape
        projected = self.in_proj(_padding_mask(hidden_states, attention_mask))
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        kernel = self.conv1d.kernel_size[0]
        if state is not None:        # history [b, k - 1 + l, conv_dim]: channels-last, as the output
            history = torch.cat([state.conv.transpose(1, 2), xbc], dim=1)
            state.conv.copy_(history[:, -(kernel - 1):].transpose(1, 2))
            xbc = self._conv_channels_last(history.transpose(1, 2), 0)
        else:
            xbc = self._conv_channels_last(xbc.transpose(1, 2), kernel - 1)[:, :l]
        xbc = _padding_mask(F.silu(xbc), attention_mask)           # [b, l, conv_dim], channels last
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        # views of the conv output (x, B, C) and of the in-projection (dt) go in as they are
        x = x.unflatten(-1, (self.num_heads, self.head_dim))
        B, C = B.unflatten(-1, (self.n_groups, self.state_size)), C.unflatten(-1, (self.n_groups, self.state_size))
        param = accumulator_dtype(x.dtype)
        A = -torch.exp(self.A_log.to(param))
        options = dict(D=self.D.to(param), dt_bias=self.dt_bias.to(param), dt_softplus=True,
                       dt_limit=self.time_step_limit, backend=self.backend)
        if state is not None and state.tokens > 0:
            from ..plan.torch_ops import as_planned
            from ..mamba2_inference import mamba2_state_update
            y = mamba2_state_update(state.ssm, as_planned(x), as_planned(dt), A,
                                    as_planned(B), as_planned(C), **options)["y"]
        else:
            y, final = ops.mamba2_chunk_scan(x, dt, A, B, C, self.chunk_size, **options)
            if state is not None:
                state.ssm.copy_(final)
        if state is not None:
            state.tokens += l
        return self.out_proj(self.norm(y.reshape(b, l, -1), gate).to(hidden_states.dtype))

    def _conv_channels_last(self, xbc, padding: int):
        """The depthwise convolution of xbc [b, conv_dim, L] (a transposed [b, L, conv_dim]:
        the channels contiguous; padded by ``padding`` on both sides), returned as [b, L',
        conv_dim] with the channels contiguous. It runs as a 2-D convolution of [b, conv_dim, 1,
        L], whose channels-last input makes torch store the output channels-last, so the scan's
        x, B and C are views of it (conv1d's [b, conv_dim, L] output would need a transposing
        copy of each)."""
        out = F.conv2d(xbc.unsqueeze(2), self.conv1d.weight.unsqueeze(2), self.conv1d.bias,
                       padding=(0, padding), groups=self.conv_dim)
        return out.squeeze(2).transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.n_groups}, "
                f"state={self.state_size}, chunk={self.chunk_size}")


class GQAAttention(nn.Module):
    """Causal grouped-query attention without positional rotation (Nemotron-H), with
    transformers' NemotronHAttention parameters (q_proj, k_proj, v_proj, o_proj).
    forward(hidden_states [b, s, hidden]) -> (output [b, s, hidden], None), the pair
    transformers' attention modules return (no attention weights)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 backend: str = "auto") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.backend = num_heads, num_kv_heads, head_dim, backend
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    @classmethod
    def from_config(cls, config, **options) -> GQAAttention:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   **options)

    def allocate_state(self, batch: int, capacity: int, *, device=None, dtype=None) -> KVState:
        """An empty KV cache of ``capacity`` tokens for ``batch`` sequences."""
        device = device or self.q_proj.weight.device
        dtype = dtype or self.q_proj.weight.dtype
        shape = (batch, capacity, self.num_kv_heads, self.head_dim)
        return KVState(torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(batch, dtype=torch.int32, device=device))

    def forward(self, hidden_states, attention_mask=None, cache=None, *, state: KVState | None = None,
                **kwargs):
        """[b, s, hidden] -> ([b, s, hidden], None). With ``state``: the s new tokens are appended
        to the KV cache and attend to it (the KV-cache decode kernel), advancing the lengths."""
        _no_cache("GQAAttention", cache)
        if attention_mask is not None:
            raise UnsupportedError(
                "GQAAttention: attention_mask: expected None (causal masking is built in; pack "
                "sequences of different lengths with cu_seqlens through fusedops.ops.gqa_attention)")
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        if state is None:
            o = ops.gqa_attention(q, k, v, causal=True, backend=self.backend)
        else:
            from ..gqa_attention import gqa_attention_decode
            o = gqa_attention_decode(q, k, v, state.k, state.v, state.lengths,
                                     backend=self.backend)["o"]              # views go in as they are
            state.lengths += s
        return self.o_proj(o.reshape(b, s, -1)), None

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


class _Router(nn.Module):
    def __init__(self, experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))
        nn.init.normal_(self.weight, std=hidden_size ** -0.5)


class _Experts(nn.Module):
    def __init__(self, experts: int, intermediate: int, dim: int) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.randn(experts, intermediate, dim) * dim ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, intermediate) * intermediate ** -0.5)


class _SharedExpert(nn.Module):
    def __init__(self, dim: int, intermediate: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)


class ReLU2MoE(nn.Module):
    """Nemotron 3 MoE block: sigmoid top-k router (fp32 logits), routed ReLU2 experts and a
    shared expert, with transformers' NemotronHMoE parameters (gate.weight,
    gate.e_score_correction_bias, experts.up_proj, experts.down_proj, shared_experts.*, and
    fc1/fc2_latent_proj with a latent size). forward(hidden_states [..., hidden]) -> same shape.
    Without a latent projection the shared expert runs in the experts' fp32 sum."""

    def __init__(self, hidden_size: int, experts: int, intermediate: int, top_k: int, *,
                 shared_intermediate: int = 0, latent_size: int | None = None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, backend: str = "auto") -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor, self.backend = norm_topk_prob, routed_scaling_factor, backend
        dim = latent_size or hidden_size
        self.gate = _Router(experts, hidden_size)
        self.experts = _Experts(experts, intermediate, dim)
        self.shared_experts = _SharedExpert(hidden_size, shared_intermediate) if shared_intermediate else None
        if latent_size:
            self.fc1_latent_proj = nn.Linear(hidden_size, latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden_size, bias=False)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    @classmethod
    def from_config(cls, config, **options) -> ReLU2MoE:
        return cls(config.hidden_size, config.n_routed_experts, config.moe_intermediate_size,
                   config.num_experts_per_tok, shared_intermediate=config.moe_shared_expert_intermediate_size,
                   latent_size=config.moe_latent_size, n_group=config.n_group, topk_group=config.topk_group,
                   norm_topk_prob=config.norm_topk_prob,
                   routed_scaling_factor=config.routed_scaling_factor, **options)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = ops.moe_router(
            logits, self.top_k, correction_bias=self.gate.e_score_correction_bias, n_group=self.n_group,
            topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, backend=self.backend)
        shared = self.shared_experts
        if self.fc1_latent_proj is None:
            out = ops.relu2_moe(x, self.experts.up_proj, self.experts.down_proj, ids, weights,
                                shared_w_up=None if shared is None else shared.up_proj.weight,
                                shared_w_down=None if shared is None else shared.down_proj.weight,
                                backend=self.backend)
        else:
            routed = ops.relu2_moe(self.fc1_latent_proj(x), self.experts.up_proj, self.experts.down_proj,
                                   ids, weights, backend=self.backend)
            out = self.fc2_latent_proj(routed)
            if shared is not None:
                out = out + shared.down_proj(F.relu(shared.up_proj(x)).square())
        return out.reshape(shape)

    def extra_repr(self) -> str:
        E, I, _ = self.experts.up_proj.shape
        return (f"experts={E}, intermediate={I}, top_k={self.top_k}, groups={self.n_group}/"
                f"{self.topk_group}, scaling={self.routed_scaling_factor:g}")



__all__ = ["EngramGate", "GQAAttention", "GatedRMSNorm", "KVState", "Mamba2Mixer", "Mamba2State",
           "ReLU2MoE"]
