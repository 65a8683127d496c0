"""GQA attention: specialisations and programs of the Triton kernels (attention_kernels.py for
training, attention_decode.py for the KV-cache decode; the math: fusedops.attention.contract).

Absent optional operands are compiled out: without packing the cu_seqlens pointers, without
paging the block table, without an FP8 cache the scales are constexpr None.
"""

from __future__ import annotations

import torch
import triton

from fusedops.attention.contract import FP8, FP8_MAX
from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.program import Program, Stage, workspace_piece
from fusedops.core.workspace import Layout

from . import attention_decode as DK
from . import attention_kernels as K
from . import interpreter_active
from .runtime import KernelSpec, numerics, pointer_type

# ptxas for sm_100 holds these wide-tile kernels to 128 registers and spills; give it room (the
# dk/dv kernel needs up to ~216 on sm_90)
WIDE_TILE_REGISTERS = 192
DKDV_REGISTERS = 232
DELTA_ROWS = 16          # query rows per program of the backward's delta kernel


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


def _common(problem, bm, bn, bd) -> dict:
    left, right = problem.window
    return dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn, BD=bd,
                CAUSAL=problem.causal, LEFT=left, RIGHT=right, PACKED=problem.packed,
                **numerics(problem.dtype))


def _cu_seqlens(problem) -> tuple[tuple[str, str | None], ...]:
    cu = "*i32" if problem.packed else None
    return (("cu_seqlens_q_ptr", cu), ("cu_seqlens_k_ptr", cu))


def _rows(problem, block: int) -> int:
    return triton.cdiv(max(problem.seqlen_q, 1), block)


def forward_spec(problem) -> KernelSpec:
    bm, bn, bd, warps = blocks(problem)
    t = pointer_type(problem.dtype)
    args = (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("o_ptr", t), ("lse_ptr", "*fp32"),
            *_cu_seqlens(problem), ("SEQ_Q", "i32"), ("SEQ_K", "i32"), ("TOTAL_Q", "i32"),
            ("scale", "fp32"))
    return KernelSpec.make(K.attn_fwd_kernel, args, _common(problem, bm, bn, bd),
                           (_rows(problem, bm), problem.batch * problem.heads_q), num_warps=warps,
                           num_stages=2, maxnreg=WIDE_TILE_REGISTERS if bd >= 128 else None)


def backward_specs(problem) -> dict[str, KernelSpec]:
    """The backward's kernels in launch order: delta, dk/dv, dq."""
    bm, bn, bd, warps = blocks(problem, backward=True)
    t = pointer_type(problem.dtype)
    cu_q, cu_k = _cu_seqlens(problem)
    seq = (("SEQ_Q", "i32"), ("SEQ_K", "i32"), ("TOTAL_Q", "i32"), ("scale", "fp32"))
    common = _common(problem, bm, bn, bd)
    delta = KernelSpec.make(
        K.attn_bwd_delta_kernel,
        (("o_ptr", t), ("do_ptr", t), ("delta_ptr", "*fp32"), cu_q, ("SEQ_Q", "i32"),
         ("TOTAL_Q", "i32")),
        dict(HQ=problem.heads_q, D=problem.head_dim, BM=DELTA_ROWS, BD=bd, PACKED=problem.packed),
        (_rows(problem, DELTA_ROWS), problem.batch * problem.heads_q), num_warps=4, num_stages=2)
    dkdv = KernelSpec.make(
        K.attn_bwd_dkdv_kernel,
        (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
         ("delta_ptr", "*fp32"), cu_q, cu_k, ("dk_ptr", t), ("dv_ptr", t), *seq), common,
        (triton.cdiv(max(problem.seqlen_k, 1), bn), problem.batch * problem.heads_kv),
        num_warps=warps, num_stages=2, maxnreg=DKDV_REGISTERS if bd >= 128 else None)
    dq = KernelSpec.make(
        K.attn_bwd_dq_kernel,
        (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
         ("delta_ptr", "*fp32"), cu_q, cu_k, ("dq_ptr", t), *seq), common,
        (_rows(problem, bm), problem.batch * problem.heads_q), num_warps=warps, num_stages=2)
    return dict(delta=delta, dkdv=dkdv, dq=dq)


# -- the backend surface -----------------------------------------------------------------------
def unsupported_reason(problem) -> str | None:
    return kernel_dtype_reason("Triton attention kernels", problem.dtype)


def backward_workspace(problem) -> Layout:
    """delta = rowsum(do ∘ o): fp32, one per query row and head (laid out like lse)."""
    rows = problem.heads_q * (problem.total_q if problem.packed else problem.batch * problem.seqlen_q)
    return Layout([("delta", torch.float32, rows)])


def _lengths(problem) -> dict:
    return dict(SEQ_Q=problem.seqlen_q, SEQ_K=problem.seqlen_k, TOTAL_Q=problem.total_q)


def forward_program(problem) -> Program:
    return Program(stages=(Stage(forward_spec(problem), dict(_lengths(problem), scale=problem.scale)),))


def backward_program(problem) -> Program:
    specs = backward_specs(problem)
    delta = workspace_piece("delta")
    lengths = _lengths(problem)
    return Program(workspace=backward_workspace(problem), stages=(
        Stage(specs["delta"], dict(delta_ptr=delta, SEQ_Q=problem.seqlen_q, TOTAL_Q=problem.total_q)),
        Stage(specs["dkdv"], dict(lengths, delta_ptr=delta, scale=problem.scale)),
        Stage(specs["dq"], dict(lengths, delta_ptr=delta, scale=problem.scale)),
    ))


# -- decode ------------------------------------------------------------------------------------
def decode_blocks(problem) -> tuple[int, int, int]:
    """(BM rows = T·G padded, BN keys per tile (divides the page), BD)."""
    bm = max(16, triton.next_power_of_2(problem.tokens * (problem.heads_q // problem.heads_kv)))
    bn = 64 if problem.page_size % 64 == 0 else (32 if problem.page_size % 32 == 0 else 16)
    return bm, bn, max(16, triton.next_power_of_2(problem.head_dim))


def split_length(problem) -> int:
    """Key positions per split: the capacity cut into num_splits ranges of whole BN tiles."""
    _, bn, _ = decode_blocks(problem)
    return triton.cdiv(triton.cdiv(problem.capacity, problem.num_splits), bn) * bn


def decode_workspace(problem) -> Layout:
    """The splits' normalised partial outputs [b·h_kv·splits·BM, BD] and lse, fp32."""
    bm, _, bd = decode_blocks(problem)
    parts = problem.batch * problem.heads_kv * problem.num_splits * bm
    return Layout([("o_part", torch.float32, parts * bd), ("lse_part", torch.float32, parts)])


def decode_specs(problem) -> dict[str, KernelSpec]:
    """The decode step's kernels in launch order: append, split, combine."""
    bm, bn, bd = decode_blocks(problem)
    t, ct = pointer_type(problem.dtype), pointer_type(problem.cache_dtype)
    fp8 = problem.cache_dtype == FP8
    table = ("block_table_ptr", "*i32" if problem.paged else None)
    scales = (("k_scale_ptr", "*fp32" if fp8 else None), ("v_scale_ptr", "*fp32" if fp8 else None))
    paging = dict(PAGE=problem.page_size, MAX_PAGES=problem.max_pages, PAGED=problem.paged)
    quant = dict(FP8=fp8, SCALE_PER_HEAD=problem.scale_per_head)
    bk = problem.batch * problem.heads_kv
    block = min(1024, triton.next_power_of_2(problem.heads_kv * problem.head_dim))
    append = KernelSpec.make(
        DK.decode_append_kernel,
        (("k_new_ptr", t), ("v_new_ptr", t), ("k_cache_ptr", ct), ("v_cache_ptr", ct),
         ("cache_seqlens_ptr", "*i32"), table, *scales, ("T", "i32"), ("CAPACITY", "i32")),
        dict(HKV=problem.heads_kv, D=problem.head_dim, BLOCK=block, FP8_MAX=FP8_MAX,
             EXACT_NEAREST=fp8 and interpreter_active(), **paging, **quant),
        (problem.batch, problem.tokens, triton.cdiv(problem.heads_kv * problem.head_dim, block)))
    split = KernelSpec.make(
        DK.decode_split_kernel,
        (("q_ptr", t), ("k_cache_ptr", ct), ("v_cache_ptr", ct), ("cache_seqlens_ptr", "*i32"),
         table, *scales, ("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"), ("T", "i32"),
         ("CAPACITY", "i32"), ("scale", "fp32")),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn, BD=bd,
             SPLITS=problem.num_splits, SPLIT_LEN=split_length(problem), **paging, **quant,
             **numerics(problem.dtype)),
        (bk, problem.num_splits), num_stages=2)
    combine = KernelSpec.make(
        DK.decode_combine_kernel,
        (("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"), ("o_ptr", t), ("lse_ptr", "*fp32"),
         ("T", "i32")),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BD=bd,
             SPLITS=problem.num_splits),
        (bk,))
    return dict(append=append, split=split, combine=combine)


def decode_program(problem) -> Program:
    specs = decode_specs(problem)
    parts = dict(o_part_ptr=workspace_piece("o_part"), lse_part_ptr=workspace_piece("lse_part"))
    sizes = dict(T=problem.tokens, CAPACITY=problem.capacity)
    return Program(workspace=decode_workspace(problem), stages=(
        Stage(specs["append"], sizes),
        Stage(specs["split"], dict(parts, **sizes, scale=problem.scale)),
        Stage(specs["combine"], dict(parts, T=problem.tokens)),
    ))
