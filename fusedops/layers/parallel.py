"""torch.nn layers that take a process group: the expert-parallel MoE block and the
context-parallel Mamba2 mixer and attention of a Nemotron-H / Nemotron 3 model.

Each subclasses its single-process layer in ``fusedops.layers.modules``, so parameter names are the
same: the context-parallel layers hold every parameter (replicated: sum their gradients over
the group), and ``load_state_dict`` of a single-process layer's state moves the weights; the
expert-parallel layer holds only this rank's experts (``experts.up_proj`` [E / world, I, H]),
and ``load_state_dict`` of a single-process state takes this rank's slice of the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedError, ValidationError
from .modules import GQAAttention, Mamba2Mixer, ReLU2MoE
from ..ops import moe_router
from ..distributed.attention import context_parallel_gqa_attention
from ..distributed.collectives import group_rank_world
from ..distributed.conv_halo import causal_conv1d
from ..distributed.mamba2 import check_layout, context_parallel_mamba2_scan
from ..distributed.moe_op import expert_parallel_relu2_moe


class _ShardedExperts(nn.Module):
    """Experts [first, first + count) of ``total``: up_proj [count, I, dim], down_proj
    [count, dim, I]. Loading a state with all ``total`` experts keeps this shard's slice."""

    def __init__(self, total: int, first: int, count: int, intermediate: int, dim: int) -> None:
        super().__init__()
        self.total, self.first, self.count = total, first, count
        self.up_proj = nn.Parameter(torch.randn(count, intermediate, dim) * dim ** -0.5)
        self.down_proj = nn.Parameter(torch.randn(count, dim, intermediate) * intermediate ** -0.5)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("up_proj", "down_proj"):
            value = state_dict.get(prefix + name)
            if value is not None and value.shape[0] == self.total and self.total != self.count:
                state_dict[prefix + name] = value[self.first:self.first + self.count]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class ExpertParallelReLU2MoE(ReLU2MoE):
    """ReLU2MoE with its routed experts sharded over ``group``: rank r holds experts
    [r·E/W, (r + 1)·E/W) (``experts.up_proj`` [E/W, I, H]); tokens are dispatched to the ranks
    holding their experts and combined back (``expert_parallel_relu2_moe``). The router, the
    shared expert and the latent projections are replicated and run on this rank's tokens.
    forward(hidden_states [..., hidden]) -> same shape; ranks may pass different token counts
    (0 on an empty rank).

    ``capacity``: None (dropless) or row slots per rank pair (needs ``max_tokens``, the most
    tokens any rank passes); ``max_tokens`` also spares dropless one all_reduce per call.
    """

    def __init__(self, hidden_size: int, experts: int, intermediate: int, top_k: int, *,
                 group=None, capacity: int | None = None, max_tokens: int | None = None,
                 **options) -> None:
        rank, world = group_rank_world(group)
        if experts % world:
            raise ValidationError(f"experts: expected a multiple of the group's {world} ranks, got "
                                  f"{experts}")
        with torch.device("meta"):      # no rank allocates every expert, even for a moment
            super().__init__(hidden_size, experts, intermediate, top_k, **options)
        dim = self.experts.up_proj.shape[2]
        self.experts = None
        self.to_empty(device=torch.device("cpu"))
        self._initialise(hidden_size)
        count = experts // world
        self.experts = _ShardedExperts(experts, rank * count, count, intermediate, dim)
        self.group, self.capacity, self.max_tokens = group, capacity, max_tokens

    def _initialise(self, hidden_size: int) -> None:
        """ReLU2MoE's initial values for what the meta-device construction left empty."""
        with torch.no_grad():
            nn.init.normal_(self.gate.weight, std=hidden_size ** -0.5)
            self.gate.e_score_correction_bias.zero_()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()

    @classmethod
    def from_config(cls, config, **options) -> ExpertParallelReLU2MoE:
        """From a transformers NemotronHConfig; ``group``, ``capacity``, ``max_tokens`` and
        ``backend`` by keyword."""
        return super().from_config(config, **options)

    def forward(self, hidden_states):
        """[..., hidden] (this rank's tokens) -> the same shape."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = moe_router(
            logits, self.top_k, correction_bias=self.gate.e_score_correction_bias, n_group=self.n_group,
            topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, backend=self.backend)
        inner = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = expert_parallel_relu2_moe(inner, self.experts.up_proj, self.experts.down_proj, ids,
                                        weights, group=self.group, capacity=self.capacity,
                                        max_tokens=self.max_tokens, backend=self.backend)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        shared = self.shared_experts
        if shared is not None:
            out = out + shared.down_proj(F.relu(shared.up_proj(x)).square())
        return out.reshape(shape)

    def extra_repr(self) -> str:
        """The expert range this rank holds, top-k and capacity."""
        e = self.experts
        return (f"experts={e.total} ([{e.first}, {e.first + e.count}) here), top_k={self.top_k}, "
                f"capacity={self.capacity}")


def _layout_of(layer, layout):
    layout = layout if layout is not None else layer.layout
    if layout is None:
        raise ValidationError(f"layout: expected the SequenceLayout of this step (forward(..., "
                              f"layout=) or {type(layer).__name__}.layout), got None")
    return layout


class ContextParallelMamba2Mixer(Mamba2Mixer):
    """Mamba2Mixer over a sequence split across ``group`` by a SequenceLayout: this rank's
    hidden_states [b, l, hidden] hold ``layout.shard`` of the sequence. The causal convolution
    takes the K − 1 positions before each piece from the ranks holding them, the scan is
    ``context_parallel_mamba2_scan``. forward(hidden_states, layout=None) -> [b, l, hidden]
    (``layout`` defaults to ``self.layout``). No attention_mask and no decode state.
    ``check_consistency``: as in context_parallel_mamba2_scan (one small all-gather and a host
    read per call when True)."""

    def __init__(self, *args, group=None, layout=None, check_consistency: bool = True,
                 **options) -> None:
        super().__init__(*args, **options)
        self.group, self.layout, self.check_consistency = group, layout, check_consistency

    def forward(self, hidden_states, cache=None, attention_mask=None, *, state=None, layout=None,
                **kwargs):
        """[b, l, hidden] (this rank's part of the layout) -> [b, l, hidden]."""
        if cache is not None or state is not None or attention_mask is not None:
            raise UnsupportedError("ContextParallelMamba2Mixer: cache, state, attention_mask: "
                                   "expected None (training over a split sequence)")
        layout = _layout_of(self, layout)
        rank, world = group_rank_world(self.group)
        check_layout(layout, world, rank, "hidden_states", hidden_states, 1, "[b, l, hidden]")
        b, l, _ = hidden_states.shape
        gate, xbc, dt = self.in_proj(hidden_states).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        xbc = F.silu(causal_conv1d(xbc, self.conv1d.weight, self.conv1d.bias, layout, rank, self.group))
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        y, _ = context_parallel_mamba2_scan(
            x.reshape(b, l, self.num_heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
            B.reshape(b, l, self.n_groups, self.state_size), C.reshape(b, l, self.n_groups, self.state_size),
            layout, self.chunk_size, D=self.D.float(), dt_bias=self.dt_bias.float(), dt_softplus=True,
            dt_limit=self.time_step_limit, group=self.group, backend=self.backend,
            check_consistency=self.check_consistency)
        y = y.reshape(b, l, self.intermediate_size)
        # GatedRMSNorm cannot view an empty tensor into groups; an empty part needs no norm
        normed = self.norm(y, gate) if l else y * self.norm.weight + gate
        return self.out_proj(normed.to(hidden_states.dtype))


class ContextParallelGQAAttention(GQAAttention):
    """GQAAttention over a sequence split across ``group`` (``context_parallel_gqa_attention``,
    causal by global position): this rank's hidden_states [b, l, hidden] hold ``layout.shard``
    of the sequence. forward(hidden_states, layout=None) -> ([b, l, hidden], None). ``overlap``:
    the forward's own-key attention runs while K/V are gathered. No decode state.
    ``check_consistency``: as in context_parallel_gqa_attention."""

    def __init__(self, *args, group=None, layout=None, overlap: bool = True,
                 check_consistency: bool = True, **options) -> None:
        super().__init__(*args, **options)
        self.group, self.layout, self.overlap = group, layout, overlap
        self.check_consistency = check_consistency

    def forward(self, hidden_states, attention_mask=None, cache=None, *, state=None, layout=None,
                **kwargs):
        """[b, l, hidden] (this rank's part of the layout) -> ([b, l, hidden], None)."""
        if cache is not None or state is not None or attention_mask is not None:
            raise UnsupportedError("ContextParallelGQAAttention: cache, state, attention_mask: "
                                   "expected None (training over a split sequence)")
        layout = _layout_of(self, layout)
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        o = context_parallel_gqa_attention(q, k, v, layout, causal=True, overlap=self.overlap,
                                           group=self.group, backend=self.backend,
                                           check_consistency=self.check_consistency)
        return self.o_proj(o.reshape(b, s, self.num_heads * self.head_dim)), None
