"""Mamba2 chunked scan: specialisations, workspace layouts and launch sequences of the Triton
kernels (mamba2_fwd.py, mamba2_bwd.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from fusedops._backend import triton_interpreter_active
from fusedops._workspace import Layout

from . import mamba2_fwd as fwd_kernels
from .compiler import KernelSpec, make_launcher, pointer_type


@dataclass(frozen=True)
class Tiles:
    BQ: int          # tokens per tile (rows and columns of a segment's Q x Q blocks)
    BP: int          # head-dim tile
    BN: int          # state tile
    BLOCK_H: int     # heads per dt-cumsum program
    PASS: int        # state elements per state-passing program
    SEARCH: int      # binary-search steps to find a segment's sequence (varlen)


def tiles(problem) -> Tiles:
    def pow2_between(value, lo, hi):
        return max(lo, min(hi, triton.next_power_of_2(value)))
    search = max(1, math.ceil(math.log2(problem.sequences + 1))) if problem.num_sequences else 1
    return Tiles(BQ=min(problem.chunk, 64), BP=pow2_between(problem.head_dim, 16, 64),
                 BN=pow2_between(problem.state, 16, 64), BLOCK_H=pow2_between(problem.heads, 1, 16),
                 PASS=pow2_between(problem.head_dim * problem.state, 16, 1024), SEARCH=search)


def _numerics(problem) -> dict:
    """UPCAST: the CPU interpreter multiplies bf16 bit patterns, so dot operands go to fp32 there;
    IEEE: fp32 inputs get exact fp32 products rather than tf32."""
    return dict(UPCAST=triton_interpreter_active() and problem.dtype == torch.bfloat16,
                IEEE=problem.dtype == torch.float32)


# -- buffers ---------------------------------------------------------------------------------
def forward_workspace(problem) -> Layout:
    S, H, Q = problem.max_segments, problem.heads, problem.chunk
    varlen = problem.num_sequences is not None
    return Layout([
        ("offsets", torch.int32, problem.sequences + 1 if varlen else 0),
        ("dts", torch.float32, S * H * Q),
        ("acum", torch.float32, S * H * Q),
        ("cb", torch.float32, S * problem.groups * Q * Q),
        ("states", torch.float32, S * H * problem.head_dim * problem.state if problem.recompute_states else 0),
    ])


def saved_layout(problem) -> Layout:
    return Layout([
        ("states", torch.float32, 0 if problem.recompute_states else
         problem.max_segments * problem.heads * problem.head_dim * problem.state),
        ("ypre", problem.dtype, problem.batch * problem.length * problem.heads * problem.head_dim
         if problem.has_z else 0),
    ])


# -- specialisations -------------------------------------------------------------------------
def _spec(kernel, args, constexprs, warps=4, stages=2) -> KernelSpec:
    aligned = tuple(n for n, t in args if t.startswith("*") and t != "*i32")
    signature = tuple(args) + tuple((n, "constexpr") for n in constexprs)
    return KernelSpec(kernel, signature, tuple(constexprs.items()), aligned=aligned,
                      num_warps=warps, num_stages=stages)


def forward_specs(problem) -> dict[str, KernelSpec]:
    t = tiles(problem)
    xt, dtt = pointer_type(problem.dtype), pointer_type(problem.dt_dtype)
    H, G, P, N, Q = problem.heads, problem.groups, problem.head_dim, problem.state, problem.chunk
    varlen = problem.num_sequences is not None
    common = dict(VARLEN=varlen, SEARCH_STEPS=t.SEARCH)
    seg = (("cu_ptr", "*i32"), ("off_ptr", "*i32"), ("L", "i32"), ("NSEQ", "i32"))
    specs = {}
    if varlen:
        specs["table"] = _spec(fwd_kernels.ssd_segment_table_kernel,
                               (("cu_ptr", "*i32"), ("off_ptr", "*i32"), ("NSEQ", "i32")),
                               dict(Q=Q, BLOCK=min(1024, triton.next_power_of_2(problem.sequences))))
    specs["dt_cumsum"] = _spec(
        fwd_kernels.ssd_dt_cumsum_kernel,
        (("dt_ptr", dtt), ("A_ptr", "*fp32"), ("bias_ptr", "*fp32"), *seg[:2], ("dts_ptr", "*fp32"),
         ("acum_ptr", "*fp32"), *seg[2:], ("dt_min", "fp32"), ("dt_max", "fp32")),
        dict(H=H, Q=Q, BLOCK_H=t.BLOCK_H, HAS_BIAS=problem.has_dt_bias,
             SOFTPLUS=problem.dt_softplus, **common))
    specs["cb"] = _spec(
        fwd_kernels.ssd_cb_kernel,
        (("C_ptr", xt), ("B_ptr", xt), *seg[:2], ("cb_ptr", "*fp32"), *seg[2:]),
        dict(G=G, N=N, Q=Q, BQ=t.BQ, BN=t.BN, **common, **_numerics(problem)))
    specs["segment_state"] = _spec(
        fwd_kernels.ssd_segment_state_kernel,
        (("x_ptr", xt), ("B_ptr", xt), ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"), *seg[:2],
         ("states_ptr", "*fp32"), *seg[2:]),
        dict(H=H, G=G, P=P, N=N, Q=Q, BP=t.BP, BN=t.BN, BK=t.BQ, FROM_START=False, **common,
             **_numerics(problem)))
    specs["state_passing"] = _spec(
        fwd_kernels.ssd_state_passing_kernel,
        (("states_ptr", "*fp32"), ("acum_ptr", "*fp32"), ("h0_ptr", "*fp32"), ("final_ptr", "*fp32"),
         ("off_ptr", "*i32"), ("L", "i32")),
        dict(H=H, PN=P * N, Q=Q, BLOCK=t.PASS, HAS_H0=problem.has_initial_states, VARLEN=varlen))
    specs["chunk_scan"] = _spec(
        fwd_kernels.ssd_chunk_scan_fwd_kernel,
        (("x_ptr", xt), ("z_ptr", xt), ("C_ptr", xt), ("cb_ptr", "*fp32"), ("dts_ptr", "*fp32"),
         ("acum_ptr", "*fp32"), ("states_ptr", "*fp32"), ("D_ptr", "*fp32"), *seg[:2],
         ("y_ptr", xt), ("ypre_ptr", xt), *seg[2:]),
        dict(H=H, G=G, P=P, N=N, Q=Q, BQ=t.BQ, BP=t.BP, BN=t.BN, HAS_D=problem.has_D,
             D_PER_CHANNEL=problem.D_per_channel, HAS_Z=problem.has_z, **common,
             **_numerics(problem)))
    return specs


def forward_grids(problem) -> dict[str, tuple[int, int, int]]:
    t = tiles(problem)
    S, H, G, P, N, Q = (problem.max_segments, problem.heads, problem.groups, problem.head_dim,
                        problem.state, problem.chunk)
    return dict(table=(1, 1, 1), dt_cumsum=(S, triton.cdiv(H, t.BLOCK_H), 1),
                cb=(S * G, (Q // t.BQ) ** 2, 1),
                segment_state=(S * H, triton.cdiv(P, t.BP), triton.cdiv(N, t.BN)),
                state_passing=(problem.sequences, H, triton.cdiv(P * N, t.PASS)),
                chunk_scan=(S * H, triton.cdiv(P, t.BP), Q // t.BQ))


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    if problem.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the Triton scan kernels take bf16/fp16/fp32, not {problem.dtype} (use backend='torch')"
    return None


def saved_size(problem) -> int:
    return saved_layout(problem).size


def forward_workspace_size(problem) -> int:
    return forward_workspace(problem).size


def forward_launcher(problem):
    specs, grids = forward_specs(problem), forward_grids(problem)
    launch = {name: make_launcher(spec, grids[name], problem.device) for name, spec in specs.items()}
    ws_layout, saved_layout_ = forward_workspace(problem), saved_layout(problem)
    L, nseq = problem.length, problem.sequences
    lo, hi = problem.dt_limit
    varlen = problem.num_sequences is not None

    def run(t, *, stream):
        ws, saved = t["workspace"], t["saved"]
        x = t["x"]
        dts, acum, cb = (ws_layout.carve(ws, k) for k in ("dts", "acum", "cb"))
        states = (ws_layout.carve(ws, "states") if problem.recompute_states
                  else saved_layout_.carve(saved, "states"))
        offsets = ws_layout.carve(ws, "offsets") if varlen else t["A"]
        cu = t["cu_seqlens"] if varlen else t["A"]
        ypre = saved_layout_.carve(saved, "ypre") if problem.has_z else x
        if varlen:
            launch["table"](cu, offsets, nseq, stream=stream)
        launch["dt_cumsum"](t["dt"], t["A"], t["dt_bias"] if problem.has_dt_bias else t["A"], cu,
                            offsets, dts, acum, L, nseq, lo, hi, stream=stream)
        launch["cb"](t["C"], t["B"], cu, offsets, cb, L, nseq, stream=stream)
        launch["segment_state"](x, t["B"], dts, acum, cu, offsets, states, L, nseq, stream=stream)
        launch["state_passing"](states, acum, t["initial_states"] if problem.has_initial_states
                                else t["final_states"], t["final_states"], offsets, L,
                                stream=stream)
        launch["chunk_scan"](x, t["z"] if problem.has_z else x, t["C"], cb, dts, acum, states,
                             t["D"] if problem.has_D else t["A"], cu, offsets, t["y"], ypre, L, nseq,
                             stream=stream)
    return run


# -- backward ----------------------------------------------------------------------------------
def _counts(problem):
    t = tiles(problem)
    return dict(NQB=problem.chunk // t.BQ, NPB=triton.cdiv(problem.head_dim, t.BP),
                NNB=triton.cdiv(problem.state, t.BN),
                NT=triton.cdiv(problem.head_dim * problem.state, t.PASS))


def backward_workspace(problem) -> Layout:
    S, H, G, P, N, Q = (problem.max_segments, problem.heads, problem.groups, problem.head_dim,
                        problem.state, problem.chunk)
    c = _counts(problem)
    varlen = problem.num_sequences is not None
    recompute = problem.recompute_states
    return Layout([
        ("offsets", torch.int32, problem.sequences + 1 if varlen else 0),
        ("dts", torch.float32, S * H * Q),
        ("acum", torch.float32, S * H * Q),
        ("cb", torch.float32, S * G * Q * Q),
        ("states", torch.float32, S * H * P * N if recompute else 0),
        ("final", torch.float32, problem.sequences * H * P * N if recompute else 0),
        ("dypre", problem.dtype, problem.batch * problem.length * H * P if problem.has_z else 0),
        ("dstates", torch.float32, S * H * P * N),
        ("dcb", torch.float32, S * G * Q * Q),
        ("intra", torch.float32, S * H * c["NQB"] * Q),
        ("ddt_part", torch.float32, S * H * c["NPB"] * Q),
        ("u", torch.float32, S * H * c["NNB"] * Q),
        ("w", torch.float32, S * H * c["NNB"] * Q),
        ("v", torch.float32, S * H * c["NT"]),
        ("dD_part", torch.float32, S * H * c["NQB"] * P if problem.has_D else 0),
        ("dA_part", torch.float32, S * H),
        ("dbias_part", torch.float32, S * H if problem.has_dt_bias else 0),
    ])


def backward_specs(problem) -> dict[str, KernelSpec]:
    from . import mamba2_bwd as bwd_kernels
    t, c = tiles(problem), _counts(problem)
    xt, dtt = pointer_type(problem.dtype), pointer_type(problem.dt_dtype)
    H, G, P, N, Q = problem.heads, problem.groups, problem.head_dim, problem.state, problem.chunk
    varlen = problem.num_sequences is not None
    common = dict(VARLEN=varlen, SEARCH_STEPS=t.SEARCH)
    seg, tail = (("cu_ptr", "*i32"), ("off_ptr", "*i32")), (("L", "i32"), ("NSEQ", "i32"))
    fwd = forward_specs(problem)
    specs = {k: fwd[k] for k in ("table", "dt_cumsum", "cb", "segment_state", "state_passing") if k in fwd}
    specs["gate"] = _spec(bwd_kernels.ssd_gate_bwd_kernel,
                          (("dy_ptr", xt), ("z_ptr", xt), ("ypre_ptr", xt), ("dypre_ptr", xt),
                           ("dz_ptr", xt), ("NUMEL", "i64")), dict(BLOCK=1024))
    specs["dstates"] = _spec(
        fwd_kernels.ssd_segment_state_kernel,
        (("x_ptr", xt), ("B_ptr", xt), ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"), *seg,
         ("states_ptr", "*fp32"), *tail),
        dict(H=H, G=G, P=P, N=N, Q=Q, BP=t.BP, BN=t.BN, BK=t.BQ, FROM_START=True, **common,
             **_numerics(problem)), warps=8)
    specs["state_passing_bwd"] = _spec(
        bwd_kernels.ssd_state_passing_bwd_kernel,
        (("dstates_ptr", "*fp32"), ("states_ptr", "*fp32"), ("acum_ptr", "*fp32"),
         ("dfinal_ptr", "*fp32"), ("dh0_ptr", "*fp32"), ("v_ptr", "*fp32"), ("off_ptr", "*i32"),
         ("L", "i32")),
        dict(H=H, PN=P * N, Q=Q, BLOCK=t.PASS, NT=c["NT"], HAS_DFINAL=problem.has_dfinal_states,
             HAS_DH0=problem.has_initial_states, VARLEN=varlen))
    specs["dx"] = _spec(
        bwd_kernels.ssd_chunk_scan_bwd_dx_kernel,
        (("x_ptr", xt), ("dy_ptr", xt), ("B_ptr", xt), ("cb_ptr", "*fp32"), ("dts_ptr", "*fp32"),
         ("acum_ptr", "*fp32"), ("dstates_ptr", "*fp32"), ("D_ptr", "*fp32"), *seg, ("dx_ptr", xt),
         ("ddt_part_ptr", "*fp32"), ("dD_part_ptr", "*fp32"), *tail),
        dict(H=H, G=G, P=P, N=N, Q=Q, BQ=t.BQ, BP=t.BP, BN=t.BN, HAS_D=problem.has_D,
             D_PER_CHANNEL=problem.D_per_channel, **common, **_numerics(problem)), warps=8)
    specs["dcb"] = _spec(
        bwd_kernels.ssd_dcb_kernel,
        (("x_ptr", xt), ("dy_ptr", xt), ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"), *seg,
         ("dcb_ptr", "*fp32"), *tail),
        dict(H=H, G=G, P=P, Q=Q, BQ=t.BQ, BP=t.BP, **common, **_numerics(problem)), warps=8)
    specs["dacs_intra"] = _spec(
        bwd_kernels.ssd_dacs_intra_kernel,
        (("x_ptr", xt), ("dy_ptr", xt), ("cb_ptr", "*fp32"), ("dts_ptr", "*fp32"),
         ("acum_ptr", "*fp32"), *seg, ("part_ptr", "*fp32"), *tail),
        dict(H=H, G=G, P=P, Q=Q, BQ=t.BQ, BP=t.BP, **common, **_numerics(problem)), warps=8)
    for name, grad_b in (("dB", True), ("dC", False)):
        specs[name] = _spec(
            bwd_kernels.ssd_dbc_kernel,
            (("x_ptr", xt), ("dy_ptr", xt), ("B_ptr", xt), ("C_ptr", xt), ("dcb_ptr", "*fp32"),
             ("dts_ptr", "*fp32"), ("acum_ptr", "*fp32"), ("states_ptr", "*fp32"),
             ("dstates_ptr", "*fp32"), *seg, ("out_ptr", xt), ("uw_part_ptr", "*fp32"), *tail),
            dict(H=H, G=G, P=P, N=N, Q=Q, BQ=t.BQ, BP=t.BP, BN=t.BN, GRAD_B=grad_b, **common,
                 **_numerics(problem)), warps=8)
    specs["dt_bwd"] = _spec(
        bwd_kernels.ssd_dt_bwd_kernel,
        (("dt_ptr", dtt), ("A_ptr", "*fp32"), ("bias_ptr", "*fp32"), ("dts_ptr", "*fp32"),
         ("acum_ptr", "*fp32"), ("intra_ptr", "*fp32"), ("ddt_part_ptr", "*fp32"),
         ("u_part_ptr", "*fp32"), ("w_part_ptr", "*fp32"), ("v_ptr", "*fp32"), *seg, ("ddt_ptr", dtt),
         ("dA_part_ptr", "*fp32"), ("dbias_part_ptr", "*fp32"), *tail, ("dt_min", "fp32"),
         ("dt_max", "fp32")),
        dict(H=H, Q=Q, BQ=t.BQ, NPB=c["NPB"], NNB=c["NNB"], NT=c["NT"],
             NT_POW2=triton.next_power_of_2(c["NT"]), HAS_BIAS=problem.has_dt_bias, SOFTPLUS=problem.dt_softplus, **common))
    specs["param_reduce"] = _spec(
        bwd_kernels.ssd_param_reduce_kernel,
        (("dA_part_ptr", "*fp32"), ("dbias_part_ptr", "*fp32"), ("dD_part_ptr", "*fp32"),
         ("dA_ptr", "*fp32"), ("dbias_ptr", "*fp32"), ("dD_ptr", "*fp32"), ("NUM_SEGMENTS", "i32")),
        dict(H=H, P=P, NQB=c["NQB"], BLOCK_H=min(16, triton.next_power_of_2(H)),
             BLOCK_P=triton.next_power_of_2(P), HAS_BIAS=problem.has_dt_bias, HAS_D=problem.has_D,
             D_PER_CHANNEL=problem.D_per_channel, ACCUMULATE=problem.accumulate))
    return specs


def backward_grids(problem) -> dict[str, tuple[int, int, int]]:
    t, c = tiles(problem), _counts(problem)
    S, H, G, P, N, Q = (problem.max_segments, problem.heads, problem.groups, problem.head_dim,
                        problem.state, problem.chunk)
    grids = forward_grids(problem)
    numel = problem.batch * problem.length * H * P
    grids.update(gate=(triton.cdiv(numel, 1024), 1, 1),
                 dstates=(S * H, c["NPB"], c["NNB"]),
                 state_passing_bwd=(problem.sequences, H, c["NT"]),
                 dx=(S * H, c["NPB"], c["NQB"]),
                 dcb=(S * G, c["NQB"] ** 2, 1),
                 dacs_intra=(S * H, c["NQB"], 1),
                 dB=(S * G, c["NQB"], c["NNB"]), dC=(S * G, c["NQB"], c["NNB"]),
                 dt_bwd=(S * H, 1, 1),
                 param_reduce=(triton.cdiv(H, min(16, triton.next_power_of_2(H))), 1, 1))
    return grids


def backward_workspace_size(problem) -> int:
    return backward_workspace(problem).size


def backward_launcher(problem):
    specs, grids = backward_specs(problem), backward_grids(problem)
    launch = {name: make_launcher(spec, grids[name], problem.device) for name, spec in specs.items()}
    ws_layout, saved_layout_ = backward_workspace(problem), saved_layout(problem)
    L, nseq, S = problem.length, problem.sequences, problem.max_segments
    lo, hi = problem.dt_limit
    varlen = problem.num_sequences is not None
    numel = problem.batch * problem.length * problem.heads * problem.head_dim

    def run(t, *, stream):
        ws, saved = t["workspace"], t["saved"]
        x, A = t["x"], t["A"]
        r = {k: ws_layout.carve(ws, k) for k in ws_layout.offsets}
        offsets = r["offsets"] if varlen else A
        cu = t["cu_seqlens"] if varlen else A
        states = r["states"] if problem.recompute_states else saved_layout_.carve(saved, "states")
        bias = t["dt_bias"] if problem.has_dt_bias else A
        if varlen:
            launch["table"](cu, offsets, nseq, stream=stream)
        launch["dt_cumsum"](t["dt"], A, bias, cu, offsets, r["dts"], r["acum"], L, nseq, lo, hi,
                            stream=stream)
        launch["cb"](t["C"], t["B"], cu, offsets, r["cb"], L, nseq, stream=stream)
        if problem.recompute_states:
            launch["segment_state"](x, t["B"], r["dts"], r["acum"], cu, offsets, states, L, nseq,
                                    stream=stream)
            launch["state_passing"](states, r["acum"], t["initial_states"]
                                    if problem.has_initial_states else r["final"], r["final"],
                                    offsets, L, stream=stream)
        dy = t["dy"]
        if problem.has_z:
            launch["gate"](dy, t["z"], saved_layout_.carve(saved, "ypre"), r["dypre"], t["dz"], numel,
                           stream=stream)
            dy = r["dypre"]
        launch["dstates"](dy, t["C"], r["dts"], r["acum"], cu, offsets, r["dstates"], L, nseq,
                          stream=stream)
        launch["state_passing_bwd"](r["dstates"], states, r["acum"],
                                    t["dfinal_states"] if problem.has_dfinal_states else A,
                                    t["dinitial_states"] if problem.has_initial_states else A,
                                    r["v"], offsets, L, stream=stream)
        dD_part = r["dD_part"] if problem.has_D else r["dA_part"]
        launch["dx"](x, dy, t["B"], r["cb"], r["dts"], r["acum"], r["dstates"],
                     t["D"] if problem.has_D else A, cu, offsets, t["dx"], r["ddt_part"], dD_part,
                     L, nseq, stream=stream)
        launch["dcb"](x, dy, r["dts"], r["acum"], cu, offsets, r["dcb"], L, nseq, stream=stream)
        launch["dacs_intra"](x, dy, r["cb"], r["dts"], r["acum"], cu, offsets, r["intra"], L, nseq,
                             stream=stream)
        launch["dB"](x, dy, t["B"], t["C"], r["dcb"], r["dts"], r["acum"], states, r["dstates"],
                     cu, offsets, t["dB"], r["w"], L, nseq, stream=stream)
        launch["dC"](x, dy, t["B"], t["C"], r["dcb"], r["dts"], r["acum"], states, r["dstates"],
                     cu, offsets, t["dC"], r["u"], L, nseq, stream=stream)
        dbias_part = r["dbias_part"] if problem.has_dt_bias else r["dA_part"]
        launch["dt_bwd"](t["dt"], A, bias, r["dts"], r["acum"], r["intra"], r["ddt_part"], r["u"],
                         r["w"], r["v"], cu, offsets, t["ddt"], r["dA_part"], dbias_part, L, nseq, lo, hi,
                         stream=stream)
        launch["param_reduce"](r["dA_part"], dbias_part, dD_part, t["dA"],
                               t["ddt_bias"] if problem.has_dt_bias else t["dA"],
                               t["dD"] if problem.has_D else t["dA"], S, stream=stream)
    return run


def aot_specs():
    """(label, KernelSpec) of every forward and backward kernel at Nemotron-H shapes (h=128,
    p=64, n=128, g=8, bf16, chunk 128 and 256, all options), packed sequences, and p = 80."""
    from fusedops.mamba2 import ScanProblem
    cpu = torch.device("cpu")
    base = ScanProblem(torch.bfloat16, torch.bfloat16, 2, 8192, 128, 64, 8, 128, 256, None, True,
                       False, True, True, True, (0.0, math.inf), True, False, False, True, cpu)
    variants = (("h128 p64 n128 Q256", base),
                ("h128 p64 n128 Q128", ScanProblem(**{**base.__dict__, "chunk": 128})),
                ("varlen Q256", ScanProblem(**{**base.__dict__, "batch": 1, "num_sequences": 64})),
                ("p80 Q128", ScanProblem(**{**base.__dict__, "head_dim": 80, "chunk": 128,
                                            "D_per_channel": True})))
    for label, problem in variants:
        specs = backward_specs(problem)
        specs["chunk_scan"] = forward_specs(problem)["chunk_scan"]
        for name, spec in specs.items():
            yield f"scan {name} {label}", spec
