"""Mamba2 chunked scan: specialisations, buffer layouts and launch programs of the Triton
kernels (kernels_forward.py, kernels_backward.py; the math: fusedops.mamba2_scan.contract).

The forward and the backward share one ``saved`` layout (``saved_layout``): the state entering
every segment (unless recomputed) and y before the z gate (with z). Absent optional operands
(D, z, dt_bias, initial_states, dfinal_states, cu_seqlens and the varlen segment table, the
status word) are compiled out of every kernel, never aliased to another tensor.

Packed sequences: the first stage sanitises cu_seqlens into the workspace piece ``cu`` (and
reports Status.CU_SEQLENS), every later kernel reads that copy, and a last stage zeroes the
outputs at the tokens no sequence covers (docs/plans.md, "Index data"). Sequence ids: the first
stage numbers the runs of equal ids into the workspace piece ``runs`` (and reports
Status.SEQ_IDX); the kernels mask by them.

Strided operands: every kernel takes the strides of the activations it reads or writes
(``Stride`` binds, read from the tensors execute() is handed) in units of the operand group's
vector (``ScanProblem.vector``, ``bc_vector``, ``dt_vector``); the pieces of the saved buffer and
the workspace (y and dy before the gate) are contiguous, their strides plan-time numbers.
"""

from __future__ import annotations

import triton

from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.cost import Cost
from fusedops.core.program import Program, Stage, Stride, saved_piece, workspace_piece
from fusedops.mamba2_scan.contract import SOFTPLUS_THRESHOLD

from . import kernels_backward as bwd_kernels
from . import kernels_forward as fwd_kernels
from . import cost_backward as bwd_model
from . import cost as model
from .buffers import backward_workspace, forward_workspace, saved_layout
from .tiles import TILES, ScanTiles, Tiles, candidates, counts, fused_state_width, tiles
from .strides import contiguous_x, per_token_shape, stride_args, strides
from ..runtime import KernelSpec, numerics, pointer_type

__all__ = ["TILES", "ScanTiles", "Tiles", "backward_candidates", "backward_program",
           "backward_workspace", "candidates", "forward_candidates", "forward_program",
           "forward_workspace", "saved_layout", "tiles", "unsupported_reason"]

NUM_STAGES = 2


def _varlen(problem) -> bool:
    return problem.num_sequences is not None


def _counts(problem, t: Tiles | None = None) -> dict:
    return counts(problem, t or tiles(problem))


def _pairs(problem, t: Tiles) -> int:
    """Block pairs (i, j <= i) of a segment's row blocks: the C·B programs per (segment,
    group)."""
    nqb = _counts(problem, t)["NQB"]
    return nqb * (nqb + 1) // 2


# -- specialisations -------------------------------------------------------------------------
def _spec(kernel, args, constexprs, grid, warps=4, cost=None, maxnreg=None,
          stages=NUM_STAGES) -> KernelSpec:
    return KernelSpec.make(kernel, args, constexprs, grid, num_warps=warps, num_stages=stages,
                           maxnreg=maxnreg, cost=cost)


def _stage(spec: KernelSpec, **bind) -> Stage:
    """A stage of ``spec``; sources of compiled-out (absent) arguments are dropped."""
    compiled_out = {n for n, t in spec.signature if t == "constexpr"}
    return Stage(spec, {k: v for k, v in bind.items() if k not in compiled_out})


def _present(flag: bool, triton_type: str) -> str | None:
    """The argument's type, or None (compiled out) when its operand is absent."""
    return triton_type if flag else None


class _Types:
    """The Triton types and segment arguments every scan kernel shares."""

    def __init__(self, problem) -> None:
        varlen = _varlen(problem)
        self.x = pointer_type(problem.dtype)
        self.dt = pointer_type(problem.dt_dtype)
        self.cu = _present(varlen, "*i32")
        self.runs = ("runs_ptr", _present(problem.has_seq_idx, "*i32"))
        self.seg = (("cu_ptr", self.cu), ("off_ptr", self.cu))
        t = tiles(problem)
        self.common = dict(VARLEN=varlen, SEARCH_STEPS=t.SEARCH)
        self.seq = dict(HAS_SEQ=problem.has_seq_idx)


def _segment_args(problem) -> dict:
    """Runtime sources of the segment arguments (the sanitised cu_seqlens, the segment table,
    L, NSEQ)."""
    return dict(cu_ptr=workspace_piece("cu"), off_ptr=workspace_piece("offsets"),
                L=problem.length, NSEQ=problem.sequences)


RUNS_BLOCK = 1024
"""Tokens per step of the kernel numbering the runs of sequence ids."""


def runs_spec(problem) -> KernelSpec:
    """Sequence ids: the run of every token (one program per row; SEQ_IDX reported). Reads the
    ids and writes the runs once (b·l·4 bytes each)."""
    tokens = problem.batch * problem.length
    return _spec(fwd_kernels.ssd_seq_runs_kernel,
                 (("seq_idx_ptr", "*i32"), ("runs_ptr", "*i32"),
                  ("status_ptr", _present(problem.has_status, "*i32"))),
                 dict(BLOCK=min(RUNS_BLOCK, triton.next_power_of_2(problem.length)),
                      HAS_STATUS=problem.has_status),
                 (problem.batch,), cost=Cost(2 * tokens, 8 * tokens, 4 * tokens))


def table_spec(problem) -> KernelSpec:
    """Varlen: cu_seqlens sanitised into the workspace (CU_SEQLENS reported), then the first
    segment of every sequence (one program)."""
    return _spec(fwd_kernels.ssd_segment_table_kernel,
                 (("cu_ptr", "*i32"), ("cu_out_ptr", "*i32"), ("off_ptr", "*i32"),
                  ("status_ptr", _present(problem.has_status, "*i32"))),
                 dict(Q=problem.chunk,
                      BLOCK=min(1024, triton.next_power_of_2(problem.sequences + 1)),
                      HAS_STATUS=problem.has_status),
                 (1,), cost=model.table_cost(problem))


ZERO_TOKENS = 16
"""Tokens per program of the stage that zeroes the outputs at uncovered tokens."""

def zero_uncovered_spec(problem, outputs) -> KernelSpec:
    """Varlen: zeroes up to five per-token outputs, ``outputs`` = ((pointer type, rows per
    token, row width, stride unit), ...), at the tokens no sequence covers (a covered block
    returns at once)."""
    outputs = list(outputs) + [(None, 0, 0, 1)] * (5 - len(outputs))
    widest = max(w for _, _, w, _ in outputs)
    args = (("cu_ptr", "*i32"), *((f"out{i}_ptr", t) for i, (t, _, _, _) in enumerate(outputs)))
    shapes = {}
    for i, (_, rows, width, unit) in enumerate(outputs):
        shapes.update({f"NH{i}": rows, f"W{i}": width, f"V{i}": unit})
    return _spec(fwd_kernels.ssd_zero_uncovered_kernel, args,
                 dict(**shapes, BT=ZERO_TOKENS,
                      BW=max(16, min(256, triton.next_power_of_2(widest)))),
                 (triton.cdiv(problem.length, ZERO_TOKENS),),
                 cost=model.zero_uncovered_cost(problem))


def _zero_stage(problem, outputs) -> Stage:
    """The stage zeroing the per-token ``outputs`` (names) at uncovered tokens (y before the
    gate too, so the backward's gate reads zeros there)."""
    ty = _Types(problem)
    types = dict(y=ty.x, ypre=ty.x, dx=ty.x, dz=ty.x, ddt=ty.dt, dB=ty.x, dC=ty.x)
    entries, bind = [], {}
    for i, name in enumerate(outputs):
        rows, width, unit = per_token_shape(problem, name)
        entries.append((types[name], rows, width, unit))
        bind[f"out{i}_ptr"] = saved_piece("ypre") if name == "ypre" else name
        if name == "ypre":
            _, l_stride, h_stride = contiguous_x(problem)
            bind.update({f"stride_{i}l": l_stride // unit, f"stride_{i}h": h_stride // unit})
        else:
            bind.update({f"stride_{i}l": Stride(name, 1, unit),
                         f"stride_{i}h": Stride(name, 2, unit) if rows > 1 else 0})
    for i in range(len(outputs), 5):
        bind.update({f"stride_{i}l": 0, f"stride_{i}h": 0})
    return _stage(zero_uncovered_spec(problem, entries), cu_ptr=workspace_piece("cu"),
                  L=problem.length, NSEQ=problem.sequences, **bind)


def dt_cumsum_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """The dt transform and its cumulative log-decay per segment and head."""
    ty, t = _Types(problem), t or tiles(problem)
    return _spec(fwd_kernels.ssd_dt_cumsum_kernel,
                 (("dt_ptr", ty.dt), ("A_ptr", "*fp32"),
                  ("bias_ptr", _present(problem.has_dt_bias, "*fp32")),
                  *ty.seg, ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"), *stride_args("dt", "dt"),
                  ("dt_min", "fp32"), ("dt_max", "fp32")),
                 dict(H=problem.heads, Q=problem.chunk, BLOCK_H=t.BLOCK_H,
                      HAS_BIAS=problem.has_dt_bias, SOFTPLUS=problem.dt_softplus,
                      SOFTPLUS_THRESHOLD=SOFTPLUS_THRESHOLD, VDT=problem.dt_vector, **ty.common),
                 (problem.max_segments, triton.cdiv(problem.heads, t.BLOCK_H)),
                 cost=model.dt_cumsum_cost(problem, t))


def cb_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """C·B per segment and group (tiles on or below the diagonal, the diagonal ones' lower
    halves; zero across runs of sequence ids). 8 warps: at 4 the diagonal's masked store spills
    on sm_100a."""
    ty, t = _Types(problem), t or tiles(problem)
    Q = problem.chunk
    return _spec(fwd_kernels.ssd_cb_kernel,
                 (("C_ptr", ty.x), ("B_ptr", ty.x), *ty.seg, ty.runs, ("cb_ptr", "*fp32"),
                  *stride_args("C", "B"), *stride_args("B", "B")),
                 dict(G=problem.groups, N=problem.state, Q=Q, BQ=t.BQ, BN=t.BN, **ty.common,
                      **numerics(problem.dtype), **ty.seq, VB=problem.bc_vector),
                 (_pairs(problem, t) * problem.max_segments * problem.groups,), warps=8,
                 cost=model.cb_cost(problem, t))


def chunk_states_spec(problem, t: Tiles | None = None, entering: bool = False) -> KernelSpec:
    """The state entering every segment (in the plan's state dtype; ``entering``: also into the
    plan's segment_states, fp32) and final_states, one walk along every sequence."""
    ty, t = _Types(problem), t or tiles(problem)
    c = _counts(problem, t)
    return _spec(fwd_kernels.ssd_chunk_states_kernel,
                 (("x_ptr", ty.x), ("B_ptr", ty.x), ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"),
                  ("h0_ptr", _present(problem.has_initial_states, "*fp32")), *ty.seg, ty.runs,
                  ("states_ptr", pointer_type(problem.state_dtype)),
                  ("entering_ptr", _present(entering, "*fp32")), ("final_ptr", "*fp32"),
                  *stride_args("x", "x"), *stride_args("B", "B")),
                 dict(H=problem.heads, G=problem.groups, P=problem.head_dim, N=problem.state,
                      Q=problem.chunk, BP=t.BP, BN=t.BN, BK=t.BQ,
                      HAS_H0=problem.has_initial_states, HAS_ENTERING=entering,
                      VARLEN=_varlen(problem), **numerics(problem.dtype), **ty.seq,
                      VX=problem.vector, VB=problem.bc_vector),
                 (c["NNB"] * c["NPB"] * problem.sequences * problem.heads,),
                 cost=model.chunk_states_cost(problem, t, entering))


def fused_fwd_spec(problem, t: Tiles | None = None, entering: bool = False) -> KernelSpec:
    """The states and the output in one walk along every sequence (``t.FUSED``): the entering
    states (in the plan's state dtype; ``entering``: also the plan's segment_states, fp32),
    final_states, y and y before the gate, one program per (head-dim tile, sequence·head)
    holding the whole state of its head-dim rows."""
    ty, t = _Types(problem), t or tiles(problem)
    c = _counts(problem, t)
    return _spec(fwd_kernels.ssd_fused_fwd_kernel,
                 (("x_ptr", ty.x), ("z_ptr", _present(problem.has_z, ty.x)), ("B_ptr", ty.x),
                  ("C_ptr", ty.x), ("cb_ptr", "*fp32"), ("dts_ptr", "*fp32"),
                  ("acum_ptr", "*fp32"), ("h0_ptr", _present(problem.has_initial_states, "*fp32")),
                  ("D_ptr", _present(problem.has_D, "*fp32")), *ty.seg, ty.runs,
                  ("states_ptr", pointer_type(problem.state_dtype)),
                  ("entering_ptr", _present(entering, "*fp32")), ("final_ptr", "*fp32"),
                  ("y_ptr", ty.x), ("ypre_ptr", _present(problem.has_z, ty.x)),
                  *stride_args("x", "x"), *stride_args("z", "x"), *stride_args("B", "B"),
                  *stride_args("C", "B"), *stride_args("y", "x")),
                 dict(H=problem.heads, G=problem.groups, P=problem.head_dim, N=problem.state,
                      Q=problem.chunk, BQ=t.BQ, BP=t.BP, BN=fused_state_width(problem.state),
                      HAS_H0=problem.has_initial_states, HAS_ENTERING=entering,
                      HAS_D=problem.has_D, D_PER_CHANNEL=problem.D_per_channel,
                      HAS_Z=problem.has_z, VARLEN=_varlen(problem), **numerics(problem.dtype),
                      **ty.seq, VX=problem.vector, VB=problem.bc_vector),
                 (c["NPB"] * problem.sequences * problem.heads,), warps=t.FUSED_WARPS,
                 stages=t.FUSED_STAGES, cost=model.fused_fwd_cost(problem, t, entering))


def chunk_scan_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """The output: the entering state's term, the causal intra-segment product, D and the gate
    (y before the gate saved for the backward)."""
    ty, t = _Types(problem), t or tiles(problem)
    c = _counts(problem, t)
    return _spec(fwd_kernels.ssd_chunk_scan_fwd_kernel,
                 (("x_ptr", ty.x), ("z_ptr", _present(problem.has_z, ty.x)), ("C_ptr", ty.x),
                  ("cb_ptr", "*fp32"), ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"),
                  ("states_ptr", pointer_type(problem.state_dtype)),
                  ("D_ptr", _present(problem.has_D, "*fp32")), *ty.seg,
                  ty.runs, ("y_ptr", ty.x), ("ypre_ptr", _present(problem.has_z, ty.x)),
                  *stride_args("x", "x"), *stride_args("z", "x"), *stride_args("C", "B"),
                  *stride_args("y", "x")),
                 dict(H=problem.heads, G=problem.groups, P=problem.head_dim, N=problem.state,
                      Q=problem.chunk, BQ=t.BQ, BP=t.BP, BN=t.BN, HAS_D=problem.has_D,
                      D_PER_CHANNEL=problem.D_per_channel, HAS_Z=problem.has_z, **ty.common,
                      **numerics(problem.dtype), **ty.seq, VX=problem.vector,
                      VB=problem.bc_vector),
                 (c["NPB"] * c["NQB"] * problem.max_segments * problem.heads,),
                 cost=model.chunk_scan_cost(problem, t))


GATED_WALK_REGISTERS = (128, 168)
"""The backward walk's register budgets with the gate fused in (16 tokens a step), head-dim tiles
full or the last one masked: 4 and 3 CTAs of 4 warps per SM, as without the gate (ptxas's own
choice leaves 2; 128 with a masked tile spills, and so do steps of 32 or 64 tokens)."""


def _walk_step(problem, t: Tiles) -> int:
    """Tokens per step of the backward walk: the row block, or with the gate (dy, z and y
    before it held in fp32 beside the dH tile) a quarter of it, at least 16 (the MMA's K)."""
    return max(16, t.BQ // 4) if problem.has_z else t.BQ


def chunk_states_bwd_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """Backwards along every sequence, one walk: each segment's end-state gradient, the
    <dH1, H0> partials (one per state tile) and dinitial_states; with z, the gate's backward
    (dz, and dy·silu(z) for the later kernels) inside the walk."""
    ty, t = _Types(problem), t or tiles(problem)
    c = _counts(problem, t)
    gate = _present(problem.has_z, ty.x)
    return _spec(bwd_kernels.ssd_chunk_states_bwd_kernel,
                 (("dy_ptr", ty.x), ("z_ptr", gate), ("ypre_ptr", gate), ("dypre_ptr", gate),
                  ("dz_ptr", gate), ("C_ptr", ty.x), ("acum_ptr", "*fp32"),
                  ("dfinal_ptr", _present(problem.has_dfinal_states, "*fp32")),
                  ("dh0_ptr", _present(problem.has_initial_states, "*fp32")), *ty.seg, ty.runs,
                  ("dstates_ptr", ty.x), *stride_args("dy", "x"),
                  *stride_args("z", "x"), *stride_args("y", "x"), *stride_args("dz", "x"),
                  *stride_args("C", "B")),
                 dict(H=problem.heads, G=problem.groups, P=problem.head_dim, N=problem.state,
                      Q=problem.chunk, BP=t.BP, BN=t.BN, BK=_walk_step(problem, t),
                      HAS_DFINAL=problem.has_dfinal_states, HAS_DH0=problem.has_initial_states,
                      GATE=problem.has_z,
                      VARLEN=_varlen(problem), **numerics(problem.dtype), **ty.seq,
                      VX=problem.vector, VB=problem.bc_vector),
                 (c["NNB"] * c["NPB"] * problem.sequences * problem.heads,),
                 cost=model.chunk_states_cost(problem, t, False, True), stages=t.WALK_STAGES,
                 maxnreg=(GATED_WALK_REGISTERS[problem.head_dim % t.BP > 0] if problem.has_z
                          else None))


def dx_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """dx, the dt-linear part of ddt and the dD partials."""
    ty, t = _Types(problem), t or tiles(problem)
    c = _counts(problem, t)
    return _spec(bwd_kernels.ssd_chunk_scan_bwd_dx_kernel,
                 (("x_ptr", ty.x), ("dy_ptr", ty.x), ("B_ptr", ty.x), ("cb_ptr", "*fp32"),
                  ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"), ("dstates_ptr", ty.x),
                  ("D_ptr", _present(problem.has_D, "*fp32")), *ty.seg, ty.runs, ("dx_ptr", ty.x),
                  ("ddt_part_ptr", "*fp32"), ("dD_part_ptr", _present(problem.has_D, "*fp32")),
                  *stride_args("x", "x"), *stride_args("dy", "x"), *stride_args("B", "B"),
                  *stride_args("dx", "x")),
                 dict(H=problem.heads, G=problem.groups, P=problem.head_dim, N=problem.state,
                      Q=problem.chunk, BQ=t.BQ, BP=t.BP, BN=t.BN, HAS_D=problem.has_D,
                      D_PER_CHANNEL=problem.D_per_channel, **ty.common, **numerics(problem.dtype),
                      **ty.seq, VX=problem.vector, VB=problem.bc_vector),
                 (c["NPB"] * c["NQB"] * problem.max_segments * problem.heads,), warps=8,
                 cost=bwd_model.dx_cost(problem, t))


def dbc_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """dB and dC with their per-head state terms and the d(C·B) tiles they need, per head the
    block pairs' pieces of the straddling sums of the log-decay gradient, and either the
    backward's C·B (for the dx kernel) or, with the table's DX_IN_DBC, dx itself (with the dt
    part of ddt and the dD partials; C·B then comes from the prologue)."""
    ty, t = _Types(problem), t or tiles(problem)
    dx = t.DX_IN_DBC
    D = _present(dx and problem.has_D, "*fp32")
    return _spec(bwd_kernels.ssd_dbc_kernel,
                 (("x_ptr", ty.x), ("dy_ptr", ty.x), ("B_ptr", ty.x), ("C_ptr", ty.x),
                  ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"),
                  ("states_ptr", pointer_type(problem.state_dtype)), ("dstates_ptr", ty.x),
                  *ty.seg, ty.runs, ("cb_ptr", "*fp32"), ("intra_ptr", "*fp32"),
                  ("dB_ptr", ty.x), ("dC_ptr", ty.x), ("w_part_ptr", "*fp32"),
                  ("u_part_ptr", "*fp32"), ("v_ptr", "*fp32"), ("D_ptr", D),
                  ("dx_ptr", _present(dx, ty.x)), ("ddt_part_ptr", _present(dx, "*fp32")),
                  ("dD_part_ptr", D), *stride_args("x", "x"),
                  *stride_args("dy", "x"), *stride_args("B", "B"), *stride_args("C", "B"),
                  *stride_args("dB", "B"), *stride_args("dC", "B"),
                  *stride_args("dx", "x", present=dx)),
                 dict(H=problem.heads, G=problem.groups, P=problem.head_dim, N=problem.state,
                      Q=problem.chunk, BQ=t.BQ, BP=t.BP, BN=t.DBC_BN, DX_BN=t.BN, WITH_DX=dx,
                      HAS_D=problem.has_D, D_PER_CHANNEL=problem.D_per_channel, **ty.common,
                      **numerics(problem.dtype), **ty.seq, VX=problem.vector,
                      VB=problem.bc_vector),
                 (bwd_model.dbc_programs(problem, t) * problem.max_segments * problem.groups,),
                 warps=8, stages=t.DBC_STAGES, cost=bwd_model.dbc_cost(problem, t))


def dt_bwd_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """ddt through the dt transform, and the per-segment dA and ddt_bias partials."""
    ty, t = _Types(problem), t or tiles(problem)
    c = _counts(problem, t)
    bias = _present(problem.has_dt_bias, "*fp32")
    return _spec(bwd_kernels.ssd_dt_bwd_kernel,
                 (("dt_ptr", ty.dt), ("A_ptr", "*fp32"), ("bias_ptr", bias), ("dts_ptr", "*fp32"),
                  ("acum_ptr", "*fp32"), ("intra_ptr", "*fp32"), ("ddt_part_ptr", "*fp32"),
                  ("u_part_ptr", "*fp32"), ("w_part_ptr", "*fp32"), ("v_ptr", "*fp32"), *ty.seg,
                  ("ddt_ptr", ty.dt), ("dA_part_ptr", "*fp32"), ("dbias_part_ptr", bias),
                  *stride_args("dt", "dt"), *stride_args("ddt", "dt"),
                  ("dt_min", "fp32"), ("dt_max", "fp32")),
                 dict(H=problem.heads, Q=problem.chunk, BQ=t.BQ, NPB=c["NPB"], NNB=c["DBC_NNB"],
                      NNB_POW2=triton.next_power_of_2(c["DBC_NNB"]),
                      HAS_BIAS=problem.has_dt_bias, SOFTPLUS=problem.dt_softplus,
                      SOFTPLUS_THRESHOLD=SOFTPLUS_THRESHOLD, VDT=problem.dt_vector, **ty.common),
                 (problem.max_segments * problem.heads,), cost=bwd_model.dt_bwd_cost(problem, t))


def param_reduce_spec(problem, t: Tiles | None = None) -> KernelSpec:
    """dA, ddt_bias and dD: fixed-order sums of the partials (+= with accumulate)."""
    t = t or tiles(problem)
    block_h = min(16, triton.next_power_of_2(problem.heads))
    bias = _present(problem.has_dt_bias, "*fp32")
    D = _present(problem.has_D, "*fp32")
    return _spec(bwd_kernels.ssd_param_reduce_kernel,
                 (("dA_part_ptr", "*fp32"), ("dbias_part_ptr", bias), ("dD_part_ptr", D),
                  ("dA_ptr", "*fp32"), ("dbias_ptr", bias), ("dD_ptr", D)),
                 dict(H=problem.heads, P=problem.head_dim, NQB=_counts(problem, t)["NQB"],
                      BLOCK_H=block_h, BLOCK_P=triton.next_power_of_2(problem.head_dim),
                      HAS_BIAS=problem.has_dt_bias, HAS_D=problem.has_D,
                      D_PER_CHANNEL=problem.D_per_channel, ACCUMULATE=problem.accumulate),
                 (triton.cdiv(problem.heads, block_h),),
                 cost=bwd_model.param_reduce_cost(problem, t))


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    """Why the Triton scan kernels cannot serve ``problem`` (float64: the torch backend)."""
    return kernel_dtype_reason("Triton scan kernels", problem.dtype)


def _prologue(problem, t: Tiles, cb: bool = True) -> list[Stage]:
    """The segment table (varlen) or the runs of sequence ids, the dt transform with its
    cumulative log-decay, and C·B (unless not ``cb``: the backward's dB/dC kernel computes
    it)."""
    ws = workspace_piece
    seg = _segment_args(problem)
    dts, acum = ws("dts"), ws("acum")
    stages = []
    if _varlen(problem):
        stages.append(_stage(table_spec(problem), cu_ptr="cu_seqlens", cu_out_ptr=ws("cu"),
                             off_ptr=ws("offsets"), NSEQ=problem.sequences,
                             TOTAL=problem.length))
    if problem.has_seq_idx:
        stages.append(_stage(runs_spec(problem), runs_ptr=ws("runs"), L=problem.length))
    lo, hi = problem.dt_limit
    stages.append(_stage(dt_cumsum_spec(problem, t), bias_ptr="dt_bias", dts_ptr=dts,
                         acum_ptr=acum, dt_min=lo, dt_max=hi,
                         **strides("dt", "dt", "dt", problem.dt_vector), **seg))
    if cb:
        stages.append(_stage(cb_spec(problem, t), cb_ptr=ws("cb"), runs_ptr=ws("runs"),
                             **strides("C", "B", "C", problem.bc_vector),
                             **strides("B", "B", "B", problem.bc_vector), **seg))
    return stages


def _states_stage(problem, t: Tiles, states, final, entering: bool = False) -> Stage:
    """The state entering each segment into ``states``, the last one into ``final`` (and into
    the plan's segment_states with ``entering``)."""
    ws = workspace_piece
    return _stage(chunk_states_spec(problem, t, entering), dts_ptr=ws("dts"), acum_ptr=ws("acum"),
                  h0_ptr="initial_states", cu_ptr=ws("cu"), off_ptr=ws("offsets"),
                  runs_ptr=ws("runs"), states_ptr=states, entering_ptr="segment_states",
                  final_ptr=final, L=problem.length, **strides("x", "x", "x", problem.vector),
                  **strides("B", "B", "B", problem.bc_vector))


def forward_program(problem, config: ScanTiles | None = None) -> Program:
    """Segment table (varlen) or runs (sequence ids), dt transform, C·B, then the states along
    every sequence (also into the plan's ``segment_states`` when it has them) and the output:
    one walk computing both (``FUSED``) or a states kernel and an output kernel; with the tile
    table's entry for the plan's architecture (or ``config``)."""
    t = tiles(problem, config)
    ws = workspace_piece
    states = ws("states") if problem.recompute_states else saved_piece("states")
    seg = _segment_args(problem)
    v, vb = problem.vector, problem.bc_vector
    output = dict(cb_ptr=ws("cb"), dts_ptr=ws("dts"), acum_ptr=ws("acum"), states_ptr=states,
                  D_ptr="D", z_ptr="z", ypre_ptr=saved_piece("ypre"), runs_ptr=ws("runs"),
                  **strides("x", "x", "x", v), **strides("z", "x", "z", v, problem.has_z),
                  **strides("C", "B", "C", vb), **strides("y", "x", "y", v))
    if t.FUSED:
        walk = [_stage(fused_fwd_spec(problem, t, problem.has_segment_states),
                       h0_ptr="initial_states", cu_ptr=ws("cu"), off_ptr=ws("offsets"),
                       entering_ptr="segment_states", final_ptr="final_states",
                       L=problem.length, **strides("B", "B", "B", vb), **output)]
    else:
        walk = [_states_stage(problem, t, states, "final_states", problem.has_segment_states),
                _stage(chunk_scan_spec(problem, t), **output, **seg)]
    stages = [*_prologue(problem, t), *walk]
    if _varlen(problem):
        stages.append(_zero_stage(problem, ["y", *(["ypre"] if problem.has_z else [])]))
    return Program(workspace=forward_workspace(problem), saved=saved_layout(problem),
                   stages=tuple(stages))


def backward_program(problem, config: ScanTiles | None = None) -> Program:
    """The forward's prologue recomputed, C·B only with DX_IN_DBC (and its states with
    recompute_states), the state gradients backwards along each sequence (with the gate's
    backward), dB and dC with the d(C·B) tiles and the straddling pairs of the log-decay
    gradient, and C·B for dx's own launch or (DX_IN_DBC) dx in theirs, then ddt and the
    fixed-order parameter reduction (tiles: the table's entry, or ``config``)."""
    t = tiles(problem, config)
    ws = workspace_piece
    seg = _segment_args(problem)
    v, vb = problem.vector, problem.bc_vector
    stages = _prologue(problem, t, cb=t.DX_IN_DBC)
    if problem.recompute_states:
        states = ws("states")
        stages.append(_states_stage(problem, t, states, ws("final")))
    else:
        states = saved_piece("states")
    gate = problem.has_z
    dy, dy_strides = (ws("dypre"), contiguous_x(problem)) if gate else ("dy", "dy")
    lo, hi = problem.dt_limit
    x_strides = strides("x", "x", "x", v)
    grad_strides = strides("dy", "x", dy_strides, v)
    fixed = dict(dts_ptr=ws("dts"), acum_ptr=ws("acum"), **seg)
    runs = dict(runs_ptr=ws("runs"))
    dx_binds = dict(cb_ptr=ws("cb"), dstates_ptr=ws("dstates"), D_ptr="D",
                    ddt_part_ptr=ws("ddt_part"), dD_part_ptr=ws("dD_part"), **x_strides,
                    **grad_strides, **strides("B", "B", "B", vb), **strides("dx", "x", "dx", v),
                    **runs, **fixed)
    stages += [
        _stage(chunk_states_bwd_spec(problem, t), dy_ptr="dy", z_ptr="z",
               ypre_ptr=saved_piece("ypre"), dypre_ptr=ws("dypre"), dz_ptr="dz", C_ptr="C",
               acum_ptr=ws("acum"), dfinal_ptr="dfinal_states",
               dh0_ptr="dinitial_states", cu_ptr=ws("cu"), off_ptr=ws("offsets"),
               dstates_ptr=ws("dstates"), L=problem.length,
               **strides("dy", "x", "dy", v), **strides("z", "x", "z", v, gate),
               **strides("y", "x", contiguous_x(problem), v, gate),
               **strides("dz", "x", "dz", v, gate), **strides("C", "B", "C", vb), **runs),
        _stage(dbc_spec(problem, t), dy_ptr=dy, states_ptr=states, intra_ptr=ws("intra"),
               w_part_ptr=ws("w"), u_part_ptr=ws("u"), v_ptr=ws("v"),
               **strides("C", "B", "C", vb), **strides("dB", "B", "dB", vb),
               **strides("dC", "B", "dC", vb), **dx_binds),
        *([] if t.DX_IN_DBC else [_stage(dx_spec(problem, t), dy_ptr=dy, **dx_binds)]),
        _stage(dt_bwd_spec(problem, t), bias_ptr="dt_bias", intra_ptr=ws("intra"),
               ddt_part_ptr=ws("ddt_part"), u_part_ptr=ws("u"), w_part_ptr=ws("w"), v_ptr=ws("v"),
               dA_part_ptr=ws("dA_part"), dbias_part_ptr=ws("dbias_part"), dt_min=lo, dt_max=hi,
               **strides("dt", "dt", "dt", problem.dt_vector),
               **strides("ddt", "dt", "ddt", problem.dt_vector), **fixed),
        _stage(param_reduce_spec(problem, t), dA_part_ptr=ws("dA_part"),
               dbias_part_ptr=ws("dbias_part"), dD_part_ptr=ws("dD_part"), dbias_ptr="ddt_bias",
               NUM_SEGMENTS=problem.max_segments),
    ]
    if _varlen(problem):
        stages.append(_zero_stage(problem, ["dx", "ddt", "dB", "dC",
                                            *(["dz"] if problem.has_z else [])]))
    return Program(workspace=backward_workspace(problem, t), saved=saved_layout(problem),
                   stages=tuple(stages))


forward_candidates = candidates
backward_candidates = candidates
