"""GQA attention: specialisations and launch sequences of the Triton kernels
(attention_kernels.py for training, attention_decode.py for the KV-cache decode)."""

from __future__ import annotations

import torch
import triton

from fusedops._backend import triton_interpreter_active
from fusedops._workspace import Layout

from . import attention_kernels as K
from .compiler import KernelSpec, make_launcher, pointer_type


def blocks(problem, backward: bool = False) -> tuple[int, int, int, int]:
    """(BM, BN, BD, warps). Forward: 64 x 64 tiles (32 keys at d = 256). Backward: 32 query rows
    per step against 64 keys (16 x 32 at d = 256): the key block's dk, dv accumulators and k, v
    stay in registers while query blocks stream by."""
    bd = max(16, triton.next_power_of_2(problem.head_dim))
    longest = triton.next_power_of_2(max(problem.seqlen_q, problem.seqlen_k, 1))
    if backward:
        bm, bn = (32, 64) if bd <= 128 else (16, 32)
    else:
        bm, bn = 64, (64 if bd <= 128 else 32)
    return (max(16, min(bm, longest)), max(16, min(bn, longest)), bd, 4 if bd <= 64 else 8)


def _numerics(problem) -> dict:
    return dict(UPCAST=triton_interpreter_active() and problem.dtype == torch.bfloat16,
                IEEE=problem.dtype == torch.float32)


def _spec(kernel, args, constexprs, warps, stages=2, maxnreg=None) -> KernelSpec:
    aligned = tuple(n for n, t in args if t.startswith("*") and t != "*i32")
    return KernelSpec(kernel, tuple(args) + tuple((k, "constexpr") for k in constexprs),
                      tuple(constexprs.items()), aligned=aligned, num_warps=warps, num_stages=stages,
                      maxnreg=maxnreg)


# ptxas for sm_100 holds these wide-tile kernels to 128 registers and spills; give it room (the
# dk/dv kernel needs up to ~216 on sm_90)
WIDE_TILE_REGISTERS = 192
DKDV_REGISTERS = 232


def _common(problem, bm, bn, bd):
    left, right = problem.window
    return dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn, BD=bd,
                CAUSAL=problem.causal, LEFT=left, RIGHT=right, PACKED=problem.packed,
                **_numerics(problem))


def forward_spec(problem) -> KernelSpec:
    bm, bn, bd, warps = blocks(problem)
    t = pointer_type(problem.dtype)
    args = (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("o_ptr", t), ("lse_ptr", "*fp32"),
            ("cu_q_ptr", "*i32"), ("cu_k_ptr", "*i32"), ("SEQ_Q", "i32"), ("SEQ_K", "i32"),
            ("TOTAL_Q", "i32"), ("scale", "fp32"))
    return _spec(K.attn_fwd_kernel, args, _common(problem, bm, bn, bd), warps,
                 maxnreg=WIDE_TILE_REGISTERS if bd >= 128 else None)


def backward_specs(problem) -> dict[str, KernelSpec]:
    bm, bn, bd, warps = blocks(problem, backward=True)
    t = pointer_type(problem.dtype)
    seq = (("SEQ_Q", "i32"), ("SEQ_K", "i32"), ("TOTAL_Q", "i32"), ("scale", "fp32"))
    delta = _spec(K.attn_bwd_delta_kernel,
                  (("o_ptr", t), ("do_ptr", t), ("delta_ptr", "*fp32"), ("cu_q_ptr", "*i32"),
                   ("SEQ_Q", "i32"), ("TOTAL_Q", "i32")),
                  dict(HQ=problem.heads_q, D=problem.head_dim, BM=16, BD=bd, PACKED=problem.packed), 4)
    dkdv = _spec(K.attn_bwd_dkdv_kernel,
                 (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
                  ("delta_ptr", "*fp32"), ("cu_q_ptr", "*i32"), ("cu_k_ptr", "*i32"), ("dk_ptr", t),
                  ("dv_ptr", t), *seq), _common(problem, bm, bn, bd), warps,
                 maxnreg=DKDV_REGISTERS if bd >= 128 else None)
    dq = _spec(K.attn_bwd_dq_kernel,
               (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
                ("delta_ptr", "*fp32"), ("cu_q_ptr", "*i32"), ("cu_k_ptr", "*i32"), ("dq_ptr", t),
                *seq), _common(problem, bm, bn, bd), warps)
    return dict(delta=delta, dkdv=dkdv, dq=dq)


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    if problem.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the Triton attention kernels take bf16/fp16/fp32, not {problem.dtype} (use backend='torch')"
    return None


def forward_workspace_size(problem) -> int:
    return 0


def backward_workspace(problem) -> Layout:
    rows = problem.heads_q * (problem.total_q if problem.packed else problem.batch * problem.seqlen_q)
    return Layout([("delta", torch.float32, rows)])


def backward_workspace_size(problem) -> int:
    return backward_workspace(problem).size


def _lengths(problem):
    return problem.seqlen_q, problem.seqlen_k, problem.total_q


def forward_launcher(problem):
    bm, _, _, _ = blocks(problem)
    grid = (triton.cdiv(max(problem.seqlen_q, 1), bm), problem.batch * problem.heads_q, 1)
    launch_fwd = make_launcher(forward_spec(problem), grid, problem.device)
    sq, sk, total_q = _lengths(problem)

    def launch(t, *, stream):
        cu_q = t["cu_seqlens_q"] if problem.packed else t["lse"]
        cu_k = t["cu_seqlens_k"] if problem.packed else t["lse"]
        launch_fwd(t["q"], t["k"], t["v"], t["o"], t["lse"], cu_q, cu_k, sq, sk, total_q,
                   problem.scale, stream=stream)
    return launch


def backward_launcher(problem):
    bm, bn, _, _ = blocks(problem, backward=True)
    specs = backward_specs(problem)
    rows = (triton.cdiv(max(problem.seqlen_q, 1), bm), problem.batch * problem.heads_q, 1)
    delta_rows = (triton.cdiv(max(problem.seqlen_q, 1), 16), problem.batch * problem.heads_q, 1)
    cols = (triton.cdiv(max(problem.seqlen_k, 1), bn), problem.batch * problem.heads_kv, 1)
    launch_delta = make_launcher(specs["delta"], delta_rows, problem.device)
    launch_dkdv = make_launcher(specs["dkdv"], cols, problem.device)
    launch_dq = make_launcher(specs["dq"], rows, problem.device)
    layout = backward_workspace(problem)
    sq, sk, total_q = _lengths(problem)

    def launch(t, *, stream):
        delta = layout.carve(t["workspace"], "delta")
        cu_q = t["cu_seqlens_q"] if problem.packed else t["lse"]
        cu_k = t["cu_seqlens_k"] if problem.packed else t["lse"]
        launch_delta(t["o"], t["do"], delta, cu_q, sq, total_q, stream=stream)
        launch_dkdv(t["q"], t["k"], t["v"], t["do"], t["lse"], delta, cu_q, cu_k, t["dk"], t["dv"],
                    sq, sk, total_q, problem.scale, stream=stream)
        launch_dq(t["q"], t["k"], t["v"], t["do"], t["lse"], delta, cu_q, cu_k, t["dq"], sq, sk,
                  total_q, problem.scale, stream=stream)
    return launch


# -- decode ------------------------------------------------------------------------------------
def decode_blocks(problem) -> tuple[int, int, int]:
    """(BM rows = T·G padded, BN keys per tile (divides the page), BD)."""
    bm = max(16, triton.next_power_of_2(problem.tokens * (problem.heads_q // problem.heads_kv)))
    bn = 64 if problem.page_size % 64 == 0 else (32 if problem.page_size % 32 == 0 else 16)
    return bm, bn, max(16, triton.next_power_of_2(problem.head_dim))


def split_length(problem) -> int:
    _, bn, _ = decode_blocks(problem)
    return triton.cdiv(triton.cdiv(problem.capacity, problem.num_splits), bn) * bn


def decode_workspace(problem) -> Layout:
    bm, _, bd = decode_blocks(problem)
    parts = problem.batch * problem.heads_kv * problem.num_splits * bm
    return Layout([("o_part", torch.float32, parts * bd), ("lse_part", torch.float32, parts)])


def decode_specs(problem) -> dict[str, KernelSpec]:
    bm, bn, bd = decode_blocks(problem)
    t, ct = pointer_type(problem.dtype), pointer_type(problem.cache_dtype)
    fp8 = problem.cache_dtype == torch.float8_e4m3fn
    paging = dict(PAGE=problem.page_size, MAX_PAGES=problem.max_pages, PAGED=problem.paged)
    quant = dict(FP8=fp8, SCALE_PER_HEAD=problem.scale_per_head)
    from . import attention_decode as DK
    append = _spec(DK.decode_append_kernel,
                   (("k_new_ptr", t), ("v_new_ptr", t), ("k_cache_ptr", ct), ("v_cache_ptr", ct),
                    ("seqlens_ptr", "*i32"), ("table_ptr", "*i32"), ("k_scale_ptr", "*fp32"),
                    ("v_scale_ptr", "*fp32"), ("T", "i32"), ("CAPACITY", "i32")),
                   dict(HKV=problem.heads_kv, D=problem.head_dim,
                        BLOCK=min(1024, triton.next_power_of_2(problem.heads_kv * problem.head_dim)),
                        EXACT_NEAREST=fp8 and triton_interpreter_active(), **paging, **quant), 4, 1)
    split = _spec(DK.decode_split_kernel,
                  (("q_ptr", t), ("k_cache_ptr", ct), ("v_cache_ptr", ct), ("seqlens_ptr", "*i32"),
                   ("table_ptr", "*i32"), ("k_scale_ptr", "*fp32"), ("v_scale_ptr", "*fp32"),
                   ("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"), ("T", "i32"),
                   ("CAPACITY", "i32"), ("scale", "fp32")),
                  dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn,
                       BD=bd, SPLITS=problem.num_splits, SPLIT_LEN=split_length(problem), **paging,
                       **quant, **_numerics(problem)), 4)
    combine = _spec(DK.decode_combine_kernel,
                    (("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"), ("o_ptr", t),
                     ("lse_ptr", "*fp32"), ("T", "i32")),
                    dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BD=bd,
                         SPLITS=problem.num_splits), 4, 1)
    return dict(append=append, split=split, combine=combine)


def decode_workspace_size(problem) -> int:
    return decode_workspace(problem).size


def decode_launcher(problem):
    specs = decode_specs(problem)
    block = dict(specs["append"].constexprs)["BLOCK"]
    bk = problem.batch * problem.heads_kv
    launch_append = make_launcher(specs["append"], (problem.batch, problem.tokens,
                                  triton.cdiv(problem.heads_kv * problem.head_dim, block)), problem.device)
    launch_split = make_launcher(specs["split"], (bk, problem.num_splits, 1), problem.device)
    launch_combine = make_launcher(specs["combine"], (bk, 1, 1), problem.device)
    layout = decode_workspace(problem)
    T, capacity = problem.tokens, problem.capacity
    fp8 = problem.cache_dtype == torch.float8_e4m3fn

    def launch(t, *, stream):
        o_part, lse_part = layout.carve(t["workspace"], "o_part"), layout.carve(t["workspace"], "lse_part")
        table = t["block_table"] if problem.paged else t["cache_seqlens"]
        k_scale = t["k_scale"] if fp8 else t["lse"]
        v_scale = t["v_scale"] if fp8 else t["lse"]
        launch_append(t["k_new"], t["v_new"], t["k_cache"], t["v_cache"], t["cache_seqlens"], table,
                      k_scale, v_scale, T, capacity, stream=stream)
        launch_split(t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], table, k_scale, v_scale,
                     o_part, lse_part, T, capacity, problem.scale, stream=stream)
        launch_combine(o_part, lse_part, t["o"], t["lse"], T, stream=stream)
    return launch


def aot_specs():
    """(label, KernelSpec): training kernels at h_q=32, d=128 (h_kv 8 and 2, causal or not), d=64
    and d=256; decode (T=1 and 4, contiguous bf16 and paged FP8) at d=128."""
    from fusedops.attention import AttentionProblem, DecodeAttentionProblem
    cpu = torch.device("cpu")
    for hkv, d, causal in ((8, 128, True), (2, 128, False), (8, 64, True), (8, 256, True)):
        p = AttentionProblem(torch.bfloat16, 4, 4096, 4096, 32, hkv, d, causal, (-1, -1),
                             d ** -0.5, False, 4 * 4096, 4 * 4096, cpu)
        label = f"attn hkv{hkv} d{d}{' causal' if causal else ''}"
        yield f"{label} fwd", forward_spec(p)
        for name, spec in backward_specs(p).items():
            yield f"{label} bwd {name}", spec
    for tokens, paged, cache in ((1, False, torch.bfloat16), (4, True, torch.float8_e4m3fn)):
        p = DecodeAttentionProblem(torch.bfloat16, cache, 64, tokens, 32, 8, 128, paged,
                                   64 if paged else 8192, 128 if paged else 1, 8192, 128 ** -0.5,
                                   paged, 16, cpu)
        for name, spec in decode_specs(p).items():
            yield f"decode T{tokens} {'paged fp8' if paged else 'bf16'} {name}", spec
