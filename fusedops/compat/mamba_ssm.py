"""mamba_ssm's Mamba2 functions over fusedops' scan and state update."""

from __future__ import annotations

import math

import torch

from fusedops import ops
from fusedops.errors import UnsupportedError
from fusedops.mamba2_inference import mamba2_state_update


def _fp32(t):
    return None if t is None else t.float().contiguous()


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False):
    """x [b, l, h, p], dt [b, l, h], A [h], B, C [b, l, g, n], D [h] or [h, p], z, dt_bias [h],
    initial_states [b, h, p, n]: out like x (differentiable), plus final_states and, for packed
    sequences, varlen_states [nseq, h, p, n] when asked. Packed sequences (b = 1) come as seq_idx
    [1, l] (converted to boundaries on the host: one synchronisation) or cu_seqlens."""
    if seq_idx is not None:
        if initial_states is not None:
            raise UnsupportedError("mamba_chunk_scan_combined: initial_states: expected None with "
                                   "seq_idx (pass cu_seqlens for per-sequence states)")
        if cu_seqlens is None:
            counts = torch.bincount(seq_idx.reshape(-1).long())
            cu_seqlens = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    packed = cu_seqlens is not None
    y, final = ops.mamba2_chunk_scan(
        x, dt, A.float(), B, C, int(chunk_size), D=_fp32(D), z=z, dt_bias=_fp32(dt_bias),
        dt_softplus=bool(dt_softplus), dt_limit=tuple(float(v) for v in dt_limit),
        initial_states=_fp32(initial_states), cu_seqlens=None if not packed else cu_seqlens.to(torch.int32))
    results = [y]
    if return_final_states:
        results.append(final[-1:] if packed else final)
    if return_varlen_states:
        if not packed:
            raise UnsupportedError("mamba_chunk_scan_combined: return_varlen_states: expected "
                                   "cu_seqlens or seq_idx (packed sequences)")
        results.append(final)
    return results[0] if len(results) == 1 else tuple(results)


def _per_head(name: str, t, dims: tuple[int, ...]):
    """The per-head values of a tensor mamba_ssm expands along the head dims (stride 0)."""
    if t is None:
        return None
    if any(t.stride(d) != 0 and t.shape[d] != 1 for d in dims):
        raise UnsupportedError(f"selective_state_update: {name}: expected values tied across the "
                               f"head dim (Mamba2's expanded [.., h, p] view, stride 0), got "
                               f"strides {list(t.stride())}")
    index = [slice(None)] * t.dim()
    for d in dims:
        index[d] = 0
    return t[tuple(index)]


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, dt_limit=(0.0, math.inf)):
    """One Mamba2 decode step in place on state [b or slots, h, p, n]: x [b, h, p], dt [b, h, p]
    and A [h, p, n], dt_bias [h, p] as Mamba2 expands them per head, B, C [b, g, n], D [h] or
    [h, p], z [b, h, p]; returns out [b, h, p]."""
    if state.dim() != 4:
        raise UnsupportedError(f"selective_state_update: state: expected Mamba2's [b, h, p, n], "
                               f"got {list(state.shape)} (Mamba1 states are not implemented)")
    dt_h = _per_head("dt", dt, (2,)) if dt.dim() == 3 else dt
    A_h = _per_head("A", A, (1, 2)) if A.dim() == 3 else A
    bias_h = _per_head("dt_bias", dt_bias, (1,)) if dt_bias is not None and dt_bias.dim() == 2 else dt_bias
    if D is not None and D.dim() == 2 and D.stride(1) == 0:
        D = D[:, 0]
    indices = None if state_batch_indices is None else state_batch_indices.to(torch.int32)
    out = mamba2_state_update(state, x.contiguous(), dt_h.contiguous(), _fp32(A_h),
                              B.contiguous(), C.contiguous(), D=_fp32(D),
                              z=None if z is None else z.contiguous(),
                              dt_bias=_fp32(bias_h),
                              dt_softplus=bool(dt_softplus), dt_limit=tuple(dt_limit),
                              state_batch_indices=indices)
    return out["y"]
