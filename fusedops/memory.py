"""Cache-size arithmetic for hybrid models: recurrent Mamba2 state against the attention KV
cache (Nemotron 3 Ultra's 48 Mamba blocks of [256, 64, 128] hold 384 MiB of fp32 state per
sequence, reached by 12 FP8 attention layers with 2 KV heads of width 128 at 65,536 tokens), and
the training-time saved and workspace bytes of the plans, from the plans themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .core.desc import TensorDesc

MIB = 2 ** 20

__all__ = ["HybridCacheConfig", "LayerBytes", "NEMOTRON_3_ULTRA", "format_model_bytes", "load_config",
           "load_nemotron_h_config", "model_bytes"]


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype, or the int itself (e.g. 1 for FP8)."""
    if isinstance(dtype, int):
        return dtype
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class HybridCacheConfig:
    """The cache-relevant shape of a hybrid model (per sequence)."""

    mamba_layers: int
    mamba_heads: int
    mamba_head_dim: int
    mamba_state: int
    attention_layers: int
    kv_heads: int
    kv_head_dim: int

    def state_bytes(self, state_dtype=torch.float32) -> int:
        """Recurrent state of every Mamba layer for one sequence."""
        return (self.mamba_layers * self.mamba_heads * self.mamba_head_dim * self.mamba_state
                * dtype_bytes(state_dtype))

    def kv_bytes_per_token(self, kv_dtype=1) -> int:
        """Keys and values of every attention layer for one token."""
        return self.attention_layers * self.kv_heads * self.kv_head_dim * 2 * dtype_bytes(kv_dtype)

    def kv_bytes(self, tokens: int, kv_dtype=1) -> int:
        return tokens * self.kv_bytes_per_token(kv_dtype)

    def crossover_tokens(self, state_dtype=torch.float32, kv_dtype=1) -> int:
        """The context length at which the KV cache reaches the recurrent state's size."""
        return math.ceil(self.state_bytes(state_dtype) / self.kv_bytes_per_token(kv_dtype))


NEMOTRON_3_ULTRA = HybridCacheConfig(mamba_layers=48, mamba_heads=256, mamba_head_dim=64,
                                     mamba_state=128, attention_layers=12, kv_heads=2,
                                     kv_head_dim=128)


@dataclass(frozen=True)
class LayerBytes:
    """What one layer kind of a model holds, in bytes (per layer)."""

    kind: str
    layers: int
    inference_state: int        # per sequence: recurrent state, or KV cache at ``context`` tokens
    training_saved: int         # the fused op's saved buffer for one step of ``tokens`` tokens
    training_workspace: int     # its larger of forward/backward workspace


PATTERN_LAYERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def load_nemotron_h_config(values: dict):
    """A NemotronH config from its config.json dict: transformers' NemotronHConfig when installed,
    else a namespace with ``layers_block_type`` derived from ``hybrid_override_pattern``."""
    try:
        from transformers import NemotronHConfig
    except ImportError:
        from types import SimpleNamespace
        values = dict(values)
        if "layers_block_type" not in values:
            pattern = values.get("hybrid_override_pattern")
            if not isinstance(pattern, str) or set(pattern) - set(PATTERN_LAYERS):
                raise ValueError("expected layers_block_type or a hybrid_override_pattern of "
                                 f"{''.join(PATTERN_LAYERS)}, got {pattern!r}")
            values["layers_block_type"] = [PATTERN_LAYERS[c] for c in pattern]
        return SimpleNamespace(**values)
    return NemotronHConfig(**values)


def load_config(path: str):
    """The NemotronH config of a model directory or config.json file, through transformers' own
    loader (``NemotronHConfig.from_pretrained``: every field transformers writes, such as its
    encoded infinities, reads back); without transformers, the plain JSON through
    ``load_nemotron_h_config``."""
    import json
    import pathlib
    target = pathlib.Path(path)
    if not target.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    try:
        from transformers import NemotronHConfig
    except ImportError:
        file = target / "config.json" if target.is_dir() else target
        return load_nemotron_h_config(json.loads(file.read_text()))
    return NemotronHConfig.from_pretrained(str(target))


MODEL_FIELDS = ("layers_block_type", "hidden_size", "mamba_num_heads", "mamba_head_dim", "n_groups",
                "ssm_state_size", "conv_kernel", "chunk_size", "num_attention_heads",
                "num_key_value_heads", "n_routed_experts", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size", "num_experts_per_tok")


def missing_fields(config) -> list[str]:
    """The fields ``model_bytes`` reads that the config lacks (those of layer kinds it has)."""
    kinds = set(getattr(config, "layers_block_type", None) or ())
    needed = ["layers_block_type", "hidden_size"]
    if "linear_attention" in kinds:
        needed += ["mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
                   "chunk_size"]
    if "full_attention" in kinds:
        needed += ["num_attention_heads", "num_key_value_heads"]
    if "moe" in kinds:
        needed += ["n_routed_experts", "moe_intermediate_size", "num_experts_per_tok"]
    return [f for f in needed if getattr(config, f, None) is None]


def _count(kinds, name) -> int:
    return sum(1 for k in kinds if k == name)


def _desc(*shape, dtype=torch.bfloat16) -> TensorDesc:
    return TensorDesc(shape, dtype, device="cpu")


def _scan_bytes(config, tokens: int, sequences: int, dtype) -> tuple[int, int]:
    """(saved, workspace) of the Triton scan plans for one step, from the plans' programs."""
    from .mamba2_scan import CHUNK_SIZES, Mamba2ChunkScanBackward, Mamba2ChunkScanForward
    h, p, n, g = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups
    if config.chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {config.chunk_size!r}")
    x, dt, B = _desc(1, tokens, h, p, dtype=dtype), _desc(1, tokens, h, dtype=dtype), _desc(1, tokens, g, n, dtype=dtype)
    options = dict(chunk_size=config.chunk_size, D=_desc(h, dtype=torch.float32),
                   dt_bias=_desc(h, dtype=torch.float32), dt_softplus=True,
                   cu_seqlens=_desc(sequences + 1, dtype=torch.int32) if sequences > 1 else None,
                   backend="torch")
    A = _desc(h, dtype=torch.float32)
    fwd = Mamba2ChunkScanForward(x, dt, A, B, B, **options).kernel_program("triton")
    bwd = Mamba2ChunkScanBackward(x, dt, A, B, B, x, **options).kernel_program("triton")
    return fwd.saved.size, max(fwd.workspace.size, bwd.workspace.size)


def _moe_bytes(config, tokens: int, dtype) -> tuple[int, int]:
    """(saved, workspace) of the Triton expert plans for one step."""
    from .relu2_moe import ReLU2MoEBackward, ReLU2MoEForward
    dim = getattr(config, "moe_latent_size", None) or config.hidden_size
    E, I, k = config.n_routed_experts, config.moe_intermediate_size, config.num_experts_per_tok
    S = 0 if getattr(config, "moe_latent_size", None) else config.moe_shared_expert_intermediate_size
    experts = (_desc(tokens, dim, dtype=dtype), _desc(E, I, dim, dtype=dtype), _desc(E, dim, I, dtype=dtype),
               _desc(tokens, k, dtype=torch.int32), _desc(tokens, k, dtype=torch.float32))
    shared = dict(shared_w_up=_desc(S, dim, dtype=dtype) if S else None,
                  shared_w_down=_desc(dim, S, dtype=dtype) if S else None, backend="torch")
    fwd = ReLU2MoEForward(*experts, **shared).kernel_program("triton")
    bwd = ReLU2MoEBackward(*experts, _desc(tokens, dim, dtype=dtype), **shared).kernel_program("triton")
    return fwd.saved.size, max(fwd.workspace.size, bwd.workspace.size)


def model_bytes(config, *, tokens: int, context: int, sequences: int = 1,
                dtype=torch.bfloat16, state_dtype=torch.float32, kv_dtype=torch.bfloat16) -> list[LayerBytes]:
    """Per layer kind of a transformers NemotronHConfig (or any object with its attributes):
    decode-time state for one sequence at ``context`` tokens, and the training-time bytes the
    Triton backend's plans save and use as workspace for a step of ``tokens`` tokens packed in
    ``sequences`` sequences (asked of the plans, built from TensorDescs: needs no GPU)."""
    kinds = list(config.layers_block_type)
    rows = []
    elt = dtype_bytes(dtype)
    n_mamba = _count(kinds, "linear_attention")
    if n_mamba:
        h, p, n, g = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size, config.n_groups
        conv_dim = h * p + 2 * g * n
        state = h * p * n * dtype_bytes(state_dtype) + conv_dim * (config.conv_kernel - 1) * elt
        rows.append(LayerBytes("mamba2", n_mamba, state, *_scan_bytes(config, tokens, sequences, dtype)))
    n_attn = _count(kinds, "full_attention")
    if n_attn:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv = 2 * context * config.num_key_value_heads * head_dim * dtype_bytes(kv_dtype)
        lse = 4 * tokens * config.num_attention_heads
        rows.append(LayerBytes("attention", n_attn, kv, lse, lse))
    n_moe = _count(kinds, "moe")
    if n_moe:
        rows.append(LayerBytes("moe", n_moe, 0, *_moe_bytes(config, tokens, dtype)))
    return rows


def format_model_bytes(rows: list[LayerBytes], *, tokens: int, context: int) -> str:
    """A table of model_bytes() rows with totals (MiB)."""
    lines = [f"{'layers':<10} {'count':>5} {'state/seq @' + str(context):>20} {'saved @' + str(tokens):>16} "
             f"{'workspace':>12}   (MiB, per layer)"]
    total_state = total_saved = 0
    for r in rows:
        lines.append(f"{r.kind:<10} {r.layers:>5} {r.inference_state / MIB:>20.2f} "
                     f"{r.training_saved / MIB:>16.2f} {r.training_workspace / MIB:>12.2f}")
        total_state += r.layers * r.inference_state
        total_saved += r.layers * r.training_saved
    peak_ws = max((r.training_workspace for r in rows), default=0)
    lines.append(f"{'all':<10} {sum(r.layers for r in rows):>5} {total_state / MIB:>20.2f} "
                 f"{total_saved / MIB:>16.2f} {peak_ws / MIB:>12.2f}   (totals; workspace: the largest, reused)")
    return "\n".join(lines)
