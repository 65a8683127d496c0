"""mamba_ssm's Mamba2 functions over fusedops' scan and state update, with mamba_ssm's semantics.

``mamba_chunk_scan_combined`` follows mamba_ssm's sequence rule: the state restarts only where
``seq_idx`` changes along a row (rows of any batch, with or without ``initial_states``, which
enter a row's leading run of id 0); ``cu_seqlens`` never resets anything, it only selects the
``varlen_states`` returned with ``return_varlen_states=True``, computed by mamba_ssm's formula
(``varlen_states``). ``selective_state_update`` takes mamba_ssm's dtype mix (B, C and dt in fp32
with fp16/bf16 x and state) as it is. Activations go in as views (no copy) wherever the plans
take their layout. Both functions add one keyword, ``backend`` ("auto", "torch", "triton"),
which picks the fusedops backend; float64 inputs (with float64 parameters) run the torch
backend's reference precision, so ``torch.autograd.gradcheck`` goes through the drop-in.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fusedops import ops
from fusedops.core.dtypes import accumulator_dtype
from fusedops.errors import UnsupportedError, ValidationError
from fusedops.mamba2_scan.contract import SOFTPLUS_THRESHOLD
from fusedops.plan.torch_ops import as_planned
from fusedops.mamba2_scan.plans import mamba2_chunk_scan_forward
from fusedops.mamba2_inference import mamba2_state_update

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _param(t, dtype: torch.dtype):
    """A parameter or state as contiguous ``dtype`` (fp32, or float64 for float64 activations;
    no copy when it is already)."""
    return None if t is None else t.to(dtype).contiguous()


def _expect_state_dtype(value):
    if value is not None and value not in STATE_DTYPES:
        raise ValidationError(f"state_dtype: expected None or one of float32, bfloat16, float16, "
                              f"got {value!r}")
    return value


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                              dt_limit=(0.0, float("inf")), return_final_states=False,
                              return_varlen_states=False, state_dtype=None, *, backend="auto"):
    """x [b, l, h, p], dt [b, l, h], A [h], B, C [b, l, g, n], D [h] or [h, p], z [b, l, h, p],
    dt_bias [h], initial_states [b, h, p, n], seq_idx [b, l] (the state restarts where the id
    changes; valid ids are non-negative and non-decreasing along a row). Returns out like x
    (differentiable), then final_states [b, h, p, n] fp32 (``return_final_states``: the state
    after each row's last token) and varlen_states [nseq, h, p, n] (``return_varlen_states``,
    b = 1: the states at the ends of the ``cu_seqlens`` sequences by mamba_ssm's formula, in
    ``state_dtype``, default C's dtype; not differentiable, as in mamba_ssm, so out is not
    either then). ``cu_seqlens`` is read only for varlen_states. The scan keeps its states in
    fp32 whatever ``state_dtype`` (which sets only varlen_states' dtype). ``backend``: the
    fusedops backend (a keyword mamba_ssm does not have)."""
    state_dtype = _expect_state_dtype(state_dtype)
    if return_varlen_states and cu_seqlens is None:
        raise ValidationError("cu_seqlens: expected the packed sequences' offsets with "
                              "return_varlen_states=True, got None")
    if return_varlen_states and x.shape[0] != 1:
        raise ValidationError(f"x: expected b == 1 with return_varlen_states (packed sequences), "
                              f"got b = {x.shape[0]}")
    # mixes the scan does not read as they are (one conversion each)
    dt = dt if dt.dtype in (x.dtype, torch.float32) else dt.float()
    B = B if B.dtype == x.dtype else B.to(x.dtype)
    C = C if C.dtype == x.dtype else C.to(x.dtype)
    z = z if z is None or z.dtype == x.dtype else z.to(x.dtype)
    if seq_idx is not None and seq_idx.dtype != torch.int32:
        seq_idx = seq_idx.to(torch.int32)
    param = accumulator_dtype(x.dtype)
    options = dict(D=_param(D, param), z=z, dt_bias=_param(dt_bias, param),
                   dt_softplus=bool(dt_softplus), dt_limit=tuple(float(v) for v in dt_limit),
                   initial_states=_param(initial_states, param), seq_idx=seq_idx, backend=backend)
    chunk_size = int(chunk_size)
    if not return_varlen_states:
        y, final = ops.mamba2_chunk_scan(x, dt, _param(A, param), B, C, chunk_size, **options)
        return (y, final) if return_final_states else y
    out = mamba2_chunk_scan_forward(as_planned(x), as_planned(dt), _param(A, param),
                                    as_planned(B), as_planned(C), chunk_size,
                                    **dict(options, z=as_planned(z)), return_segment_states=True)
    states = varlen_states(x, dt, A, B, cu_seqlens, out["segment_states"], chunk_size,
                           dt_bias=options["dt_bias"], dt_softplus=bool(dt_softplus),
                           dt_limit=options["dt_limit"]).to(state_dtype or C.dtype)
    y = out["y"]
    return (y, out["final_states"], states) if return_final_states else (y, states)


@torch.no_grad()
def varlen_states(x, dt, A, B, cu_seqlens, entering, chunk_size, *, dt_bias=None,
                  dt_softplus=False, dt_limit=(0.0, math.inf)) -> torch.Tensor:
    """mamba_ssm's varlen states of one packed row (fp32 [nseq, h, p, n]): for the sequence
    [s, e) of cu_seqlens whose last token lies in chunk c (c·Q <= e - 1, Q = chunk_size), the
    tokens of [max(s, c·Q), e) weighted by exp(Acum_{e-1} - Acum_k)·dt_k (Acum: the cumulative
    dt·A within the chunk), plus, when the sequence started in an earlier chunk (s < c·Q), the
    state entering chunk c (``entering``, the scan's segment states) times exp(Acum_{e-1}).
    With seq_idx changing exactly at the cu_seqlens offsets these are the sequences' final
    states. Offsets are clamped into [0, l] (memory-safe for any values)."""
    l, h = x.shape[1], x.shape[2]
    g, Q = B.shape[2], int(chunk_size)
    chunks = -(-l // Q)
    u = dt[0].float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        u = F.softplus(u, threshold=SOFTPLUS_THRESHOLD)
    dtv = torch.clamp(u, min=dt_limit[0], max=dt_limit[1])                     # [l, h]
    a = F.pad(dtv * A.float(), (0, 0, 0, chunks * Q - l)).view(chunks, Q, h)
    acum = torch.cumsum(a, dim=1).reshape(chunks * Q, h)                        # within chunks
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64).clamp(0, l)
    start, end = cu[:-1], torch.maximum(cu[1:], cu[:-1])
    chunk = torch.div(end - 1, Q, rounding_mode="floor").clamp(min=0)
    first = chunk * Q
    last = (end - 1).clamp(min=0)
    zero = torch.zeros((), device=x.device)
    carried = (start < first) & (end > start)
    out = torch.where(carried[:, None, None, None],
                      torch.exp(acum[last])[..., None, None] * entering.float()[chunk], zero)
    for s0 in range(0, start.numel(), VARLEN_BATCH):        # bounded temporaries
        sl = slice(s0, s0 + VARLEN_BATCH)
        k = first[sl, None] + torch.arange(Q, device=x.device)                  # [s, Q]
        valid = (k >= torch.maximum(start[sl], first[sl])[:, None]) & (k < end[sl, None])
        k = k.clamp(max=l - 1)
        decay = torch.exp(torch.clamp(acum[last[sl]][:, None] - acum[k], max=0.0)) * dtv[k]
        weight = torch.where(valid[..., None], decay, zero).unflatten(-1, (g, h // g))
        xs = x[0][k].float().unflatten(2, (g, h // g))                         # [s, Q, g, r, p]
        local = torch.einsum("sqgr,sqgrp,sqgn->sgrpn", weight, xs, B[0][k].float())
        out[sl] += local.flatten(1, 2)
    return out


VARLEN_BATCH = 8
"""Sequences per step of ``varlen_states`` (its temporaries: 8·Q·h·p fp32 values)."""


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
                           state_batch_indices=None, dt_limit=(0.0, math.inf), *, backend="auto"):
    """One Mamba2 decode step in place on state [b or slots, h, p, n] (fp32, bf16 or fp16):
    x [b, h, p], dt [b, h, p] and A [h, p, n], dt_bias [h, p] as Mamba2 expands them per head, B,
    C [b, g, n] or [b, n] (one group; x's dtype or fp32, as mamba_ssm's tests mix them), D [h]
    or [h, p], z [b, h, p];
    returns out [b, h, p]. x, dt, B, C and z go in as views; a negative state_batch_indices entry
    is padding (out 0, no slot touched). Not differentiable (an in-place decode step, as in
    mamba_ssm). ``dt_limit`` and ``backend`` are fusedops keywords mamba_ssm does not have."""
    if state.dim() != 4:
        raise UnsupportedError(f"selective_state_update: state: expected Mamba2's [b, h, p, n], "
                               f"got {list(state.shape)} (Mamba1 states are not implemented)")
    dt_h = _per_head("dt", dt, (2,)) if dt.dim() == 3 else dt
    A_h = _per_head("A", A, (1, 2)) if A.dim() == 3 else A
    bias_h = _per_head("dt_bias", dt_bias, (1,)) if dt_bias is not None and dt_bias.dim() == 2 else dt_bias
    if D is not None and D.dim() == 2 and D.stride(1) == 0:
        D = D[:, 0]
    if B.dim() == 2:                          # mamba_ssm's [b, n]: one group
        B, C = B[:, None], C[:, None]
    dt_h = dt_h if dt_h.dtype in (x.dtype, torch.float32) else dt_h.float()
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if B.dtype not in (x.dtype, wide) or C.dtype != B.dtype:    # one lossless conversion each
        B, C = B.to(wide), C.to(wide)
    z = z if z is None or z.dtype == x.dtype else z.to(x.dtype)
    indices = None if state_batch_indices is None else state_batch_indices.to(torch.int32)
    param = accumulator_dtype(x.dtype)
    out = mamba2_state_update(state, as_planned(x), as_planned(dt_h), _param(A_h, param),
                              as_planned(B), as_planned(C), D=_param(D, param),
                              z=as_planned(z), dt_bias=_param(bias_h, param),
                              dt_softplus=bool(dt_softplus), dt_limit=tuple(dt_limit),
                              state_batch_indices=indices, backend=backend)
    return out["y"]
