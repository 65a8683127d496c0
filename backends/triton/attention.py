"""GQA attention: specialisations and programs of the Triton kernels (attention_kernels.py for
training, attention_decode.py for the KV-cache decode; the math: fusedops.attention.contract).

Absent optional operands are compiled out: without packing the cu_seqlens pointers, without
paging the block table, without an FP8 cache the scales, without a status word the reporting
(never the clamping) are constexpr None.

Tiles: per-architecture tables (attention_tiles.py: the entry of the plan's architecture, or a
``config=`` of the programs; ``forward_candidates``, ``backward_candidates`` and
``decode_candidates`` for autotune); every kernel carries its cost model (attention_cost.py).

Index data (docs/plans.md, "Index data"): packed programs start with a one-program stage that
writes the sanitised offsets to the workspace (the attention kernels read only those); decode's
append kernel decides each row's validity (cache length and every page the row needs) before
writing, and leaves it in the workspace for the split kernel, which skips invalid rows.
"""

from __future__ import annotations

import torch
import triton

from fusedops.attention.contract import FP8, FP8_MAX
from fusedops.core.device import device_capability
from fusedops.core.dtypes import kernel_dtype_reason
from fusedops.core.status import Status
from fusedops.core.program import Program, Stage, workspace_piece
from fusedops.core.target import target_arch
from fusedops.core.workspace import Layout

from . import attention_cost as C
from . import attention_decode as DK
from . import attention_tiles as TILES
from . import attention_kernels as K
from . import interpreter_active
from .attention_tiles import (BackwardTiles, DecodeTiles, Tiles, backward_tiles, decode_tiles,
                              forward_tiles)
from .runtime import KernelSpec, numerics, pointer_type

DELTA_ROWS = 16          # query rows per program of the backward's delta kernel
SANITISE_BLOCK = 256     # offsets per step of the sanitising kernel (one program)
TABLE_BLOCK = 128        # block-table entries per step of the decode append kernel


# autotune: the candidate configurations of each program, the table's entry first
forward_candidates = TILES.forward_candidates
backward_candidates = TILES.backward_candidates
decode_candidates = TILES.decode_candidates


def _bd(head_dim: int) -> int:
    """The head dim padded to the MMA tile width (a power of two >= 16)."""
    return max(16, triton.next_power_of_2(head_dim))


def _common(problem, bm, bn, bd) -> dict:
    left, right = problem.window
    return dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn, BD=bd,
                CAUSAL=problem.causal, LEFT=left, RIGHT=right, PACKED=problem.packed,
                **numerics(problem.dtype))


def _cu_seqlens(problem) -> tuple[tuple[str, str | None], ...]:
    cu = "*i32" if problem.packed else None
    return (("cu_seqlens_q_ptr", cu), ("cu_seqlens_k_ptr", cu))


def _status(problem) -> tuple[str, str | None]:
    return ("status_ptr", "*i32" if problem.has_status else None)


def sanitise_spec(problem) -> KernelSpec:
    """The packed programs' first stage: cu_seqlens_q/k -> sanitised offsets (workspace)."""
    return KernelSpec.make(
        K.attn_sanitise_kernel,
        (*_cu_seqlens(problem), ("cu_q_ptr", "*i32"), ("cu_k_ptr", "*i32"), _status(problem),
         ("N", "i32"), ("TOTAL_Q", "i32"), ("TOTAL_K", "i32"), ("SEQ_Q", "i32"), ("SEQ_K", "i32")),
        dict(BLOCK=SANITISE_BLOCK, BIT=int(Status.CU_SEQLENS), HAS_STATUS=problem.has_status),
        (1,), num_warps=4, cost=C.sanitise_cost(problem))


def offsets_workspace(problem) -> list:
    """The sanitised offsets (packed): int32 [nseq + 1] each for queries and keys."""
    n = problem.batch + 1 if problem.packed else 0
    return [("cu_q", torch.int32, n), ("cu_k", torch.int32, n)]


def _sanitise_stage(problem) -> tuple[Stage, ...]:
    if not problem.packed:
        return ()
    return (Stage(sanitise_spec(problem), dict(
        cu_q_ptr=workspace_piece("cu_q"), cu_k_ptr=workspace_piece("cu_k"), N=problem.batch + 1,
        TOTAL_Q=problem.total_q, TOTAL_K=problem.total_k, SEQ_Q=problem.seqlen_q,
        SEQ_K=problem.seqlen_k)),)


def _sanitised(problem) -> dict:
    """The attention kernels' offsets: the sanitised ones in the workspace (packed)."""
    if not problem.packed:
        return {}
    return dict(cu_seqlens_q_ptr=workspace_piece("cu_q"), cu_seqlens_k_ptr=workspace_piece("cu_k"))


def _rows(problem, block: int) -> int:
    return triton.cdiv(max(problem.seqlen_q, 1), block)


def forward_spec(problem, config: Tiles | None = None) -> KernelSpec:
    """attn_fwd_kernel with the tile table's entry for the plan's architecture (or ``config``)."""
    tiles, bd = forward_tiles(problem, config), _bd(problem.head_dim)
    t = pointer_type(problem.dtype)
    args = (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("o_ptr", t), ("lse_ptr", "*fp32"),
            *_cu_seqlens(problem), ("SEQ_Q", "i32"), ("SEQ_K", "i32"), ("TOTAL_Q", "i32"),
            ("scale", "fp32"))
    return KernelSpec.make(K.attn_fwd_kernel, args, _common(problem, tiles.bm, tiles.bn, bd),
                           (_rows(problem, tiles.bm), problem.batch * problem.heads_q),
                           num_warps=tiles.warps, num_stages=tiles.stages,
                           maxnreg=tiles.budget(problem.packed),
                           cost=C.forward_cost(problem, tiles, bd, target_arch(problem.device)))


def backward_specs(problem, config: BackwardTiles | None = None) -> dict[str, KernelSpec]:
    """The backward's kernels in launch order: delta, dk/dv, dq."""
    tiles, bd = backward_tiles(problem, config), _bd(problem.head_dim)
    kv, qt = tiles.dkdv, tiles.dq
    t = pointer_type(problem.dtype)
    cu_q, cu_k = _cu_seqlens(problem)
    seq = (("SEQ_Q", "i32"), ("SEQ_K", "i32"), ("TOTAL_Q", "i32"), ("scale", "fp32"))
    delta = KernelSpec.make(
        K.attn_bwd_delta_kernel,
        (("o_ptr", t), ("do_ptr", t), ("delta_ptr", "*fp32"), cu_q, ("SEQ_Q", "i32"),
         ("TOTAL_Q", "i32")),
        dict(HQ=problem.heads_q, D=problem.head_dim, BM=DELTA_ROWS, BD=bd, PACKED=problem.packed),
        (_rows(problem, DELTA_ROWS), problem.batch * problem.heads_q), num_warps=4, num_stages=2,
        cost=C.delta_cost(problem, DELTA_ROWS))
    dkdv = KernelSpec.make(
        K.attn_bwd_dkdv_kernel,
        (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
         ("delta_ptr", "*fp32"), cu_q, cu_k, ("dk_ptr", t), ("dv_ptr", t), *seq[:3],
         ("TOTAL_K", "i32"), seq[3]), _common(problem, kv.bm, kv.bn, bd),
        (triton.cdiv(max(problem.seqlen_k, 1), kv.bn), problem.batch * problem.heads_kv),
        num_warps=kv.warps, num_stages=kv.stages, maxnreg=kv.budget(problem.packed),
        cost=C.dkdv_cost(problem, kv, bd, target_arch(problem.device)))
    dq = KernelSpec.make(
        K.attn_bwd_dq_kernel,
        (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
         ("delta_ptr", "*fp32"), cu_q, cu_k, ("dq_ptr", t), *seq),
        _common(problem, qt.bm, qt.bn, bd),
        (_rows(problem, qt.bm), problem.batch * problem.heads_q), num_warps=qt.warps,
        num_stages=qt.stages, maxnreg=qt.budget(problem.packed), cost=C.dq_cost(problem, qt, bd, target_arch(problem.device)))
    return dict(delta=delta, dkdv=dkdv, dq=dq)


# -- the backend surface -----------------------------------------------------------------------
FP8_MIN_CAPABILITY = (8, 9)      # e4m3 loads and conversions: Ada, Hopper, Blackwell


def _fp8_cache(problem) -> bool:
    return getattr(problem, "cache_dtype", None) == FP8


def unsupported_reason(problem) -> str | None:
    reason = kernel_dtype_reason("Triton attention kernels", problem.dtype)
    if reason is None and _fp8_cache(problem) and problem.device.type == "cuda":
        cap = device_capability(problem.device.index)
        if cap < FP8_MIN_CAPABILITY:
            return (f"FP8 (e4m3) KV caches need compute capability >= 8.9; {problem.device} has "
                    f"{cap[0]}.{cap[1]}")
    return reason


def unsupported_arch_reason(problem, arch: str) -> str | None:
    """Why the kernels cannot be compiled for the tile-table family ``arch`` (the kernel report
    asks; on a device, ``unsupported_reason`` checks the exact capability)."""
    if _fp8_cache(problem) and arch == "sm_80":
        return "FP8 (e4m3) KV caches need sm_89 or newer"
    return None


def forward_workspace(problem) -> Layout:
    """The sanitised offsets (packed; nothing otherwise)."""
    return Layout(offsets_workspace(problem))


def backward_workspace(problem) -> Layout:
    """delta = rowsum(do ∘ o): fp32, one per query row and head (laid out like lse); the
    sanitised offsets (packed)."""
    rows = problem.heads_q * (problem.total_q if problem.packed else problem.batch * problem.seqlen_q)
    return Layout([("delta", torch.float32, rows), *offsets_workspace(problem)])


def _lengths(problem) -> dict:
    return dict(SEQ_Q=problem.seqlen_q, SEQ_K=problem.seqlen_k, TOTAL_Q=problem.total_q)


def forward_program(problem, config: Tiles | None = None) -> Program:
    return Program(workspace=forward_workspace(problem), stages=(
        *_sanitise_stage(problem),
        Stage(forward_spec(problem, config), dict(_lengths(problem), **_sanitised(problem),
                                          scale=problem.scale)),
    ))


def backward_program(problem, config: BackwardTiles | None = None) -> Program:
    specs = backward_specs(problem, config)
    delta = workspace_piece("delta")
    lengths = dict(_lengths(problem), **_sanitised(problem))
    return Program(workspace=backward_workspace(problem), stages=(
        *_sanitise_stage(problem),
        Stage(specs["delta"], dict(delta_ptr=delta, SEQ_Q=problem.seqlen_q, TOTAL_Q=problem.total_q,
                                   **{k: v for k, v in _sanitised(problem).items() if "_q_" in k})),
        Stage(specs["dkdv"], dict(lengths, delta_ptr=delta, TOTAL_K=problem.total_k,
                                  scale=problem.scale)),
        Stage(specs["dq"], dict(lengths, delta_ptr=delta, scale=problem.scale)),
    ))


# -- decode ------------------------------------------------------------------------------------
def decode_blocks(problem, config: DecodeTiles | None = None) -> tuple[int, int, int]:
    """(BM rows = T·G padded, BN keys per tile (divides the page), BD)."""
    bm = max(16, triton.next_power_of_2(problem.tokens * (problem.heads_q // problem.heads_kv)))
    return bm, decode_tiles(problem, config).bn, _bd(problem.head_dim)


def split_length(problem, config: DecodeTiles | None = None) -> int:
    """Key positions per split: the capacity cut into num_splits ranges of whole BN tiles."""
    _, bn, _ = decode_blocks(problem, config)
    return triton.cdiv(triton.cdiv(problem.capacity, problem.num_splits), bn) * bn


def decode_workspace(problem, config: DecodeTiles | None = None) -> Layout:
    """The splits' normalised partial outputs [b·h_kv·splits·BM, BD] and lse, fp32; each row's
    validity (int32 [b], written by the append kernel)."""
    bm, _, bd = decode_blocks(problem, config)
    parts = problem.batch * problem.heads_kv * problem.num_splits * bm
    return Layout([("o_part", torch.float32, parts * bd), ("lse_part", torch.float32, parts),
                   ("row_ok", torch.int32, problem.batch)])


def decode_specs(problem, config: DecodeTiles | None = None) -> dict[str, KernelSpec]:
    """The decode step's kernels in launch order: append, split, combine."""
    tiles = decode_tiles(problem, config)
    bm, bn, bd = decode_blocks(problem, config)
    split_len = split_length(problem, config)
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
         ("cache_seqlens_ptr", "*i32"), table, *scales, ("row_ok_ptr", "*i32"), _status(problem),
         ("T", "i32"), ("CAPACITY", "i32"), ("PAGES", "i32")),
        dict(HKV=problem.heads_kv, D=problem.head_dim, BLOCK=block, FP8_MAX=FP8_MAX,
             EXACT_NEAREST=fp8 and interpreter_active(), TABLE_BLOCK=TABLE_BLOCK,
             LENGTH_BIT=int(Status.CACHE_SEQLENS), TABLE_BIT=int(Status.BLOCK_TABLE),
             HAS_STATUS=problem.has_status, **paging, **quant),
        (problem.batch, problem.tokens, triton.cdiv(problem.heads_kv * problem.head_dim, block)),
        cost=C.append_cost(problem, block))
    split = KernelSpec.make(
        DK.decode_split_kernel,
        (("q_ptr", t), ("k_cache_ptr", ct), ("v_cache_ptr", ct), ("cache_seqlens_ptr", "*i32"),
         table, *scales, ("row_ok_ptr", "*i32"), ("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"),
         ("T", "i32"), ("CAPACITY", "i32"), ("scale", "fp32")),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn, BD=bd,
             SPLITS=problem.num_splits, SPLIT_LEN=split_len, **paging, **quant,
             **numerics(problem.dtype)),
        (bk, problem.num_splits), num_warps=tiles.warps, num_stages=tiles.stages,
        maxnreg=tiles.maxnreg, cost=C.split_cost(problem, tiles, bm, bd, split_len,
                                                      target_arch(problem.device)))
    combine = KernelSpec.make(
        DK.decode_combine_kernel,
        (("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"), ("o_ptr", t), ("lse_ptr", "*fp32"),
         ("T", "i32")),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BD=bd,
             SPLITS=problem.num_splits),
        (bk,), cost=C.combine_cost(problem, bm, bd))
    return dict(append=append, split=split, combine=combine)


def decode_program(problem, config: DecodeTiles | None = None) -> Program:
    specs = decode_specs(problem, config)
    parts = dict(o_part_ptr=workspace_piece("o_part"), lse_part_ptr=workspace_piece("lse_part"))
    row_ok = dict(row_ok_ptr=workspace_piece("row_ok"))
    sizes = dict(T=problem.tokens, CAPACITY=problem.capacity)
    return Program(workspace=decode_workspace(problem, config), stages=(
        Stage(specs["append"], dict(row_ok, **sizes, PAGES=problem.pages)),
        Stage(specs["split"], dict(parts, **row_ok, **sizes, scale=problem.scale)),
        Stage(specs["combine"], dict(parts, T=problem.tokens)),
    ))
