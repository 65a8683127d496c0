"""GQA attention: specialisations and programs of the Triton kernels (kernels.py for
training, kernels_decode.py for the KV-cache decode; the math: fusedops.gqa_attention.contract).

Absent optional operands are compiled out: without packing the cu_seqlens pointers, without
paging the block table, without an FP8 cache the scales, without a status word the reporting
(never the clamping) are constexpr None; without a softcap its tanh (SOFTCAP), without rotary,
cache_batch_idx or cache_leftpad their code.

Strides: every activation ([.., h, d] tensors: q, k, v, o, do, dq, dk, dv, k_new, v_new, the
caches) is read and written through its strides (``Stride`` binds: taken from the tensor handed
to execute, in units of a 16-byte vector, multiplied in the kernel by the constexpr VEC), so
views go in and out without copies; a packed tensor's batch stride is 0. The compile cache keys
on none of them (one compile serves every layout).

TMA (``uses_tma``: sm_90 and sm_100, not a paged prefill): the training kernels make tensor
descriptors of each sequence on the device (3 a program forward, 2 dk/dv, 4 dq), kept in the
workspace's ``global_scratch`` piece (``runtime.scratch_piece``).

Tiles: per-architecture tables (tiles.py: the entry of the plan's architecture, or a
``config=`` of the programs; ``forward_candidates``, ``backward_candidates`` and
``decode_candidates`` for autotune); every kernel carries its cost model (cost.py).

Index data (docs/plans.md, "Index data"): packed programs start with a one-program stage that
writes the sanitised offsets to the workspace (the attention kernels read only those); decode's
append kernel decides each row's validity (cache length and every page the row needs) before
writing, and leaves it in the workspace for the split kernel, which skips invalid rows.
"""

from __future__ import annotations

import torch
import triton

import math

from fusedops.gqa_attention.contract import FP8, FP8_MAX
from fusedops.core.device import device_capability
from fusedops.core.dtypes import element_size, kernel_dtype_reason
from fusedops.core.status import Status
from fusedops.core.program import Program, Stage, Stride, workspace_piece
from fusedops.core.target import emulated_target, target_arch
from fusedops.core.workspace import Layout

from . import cost as C
from . import kernels_decode as DK
from . import tiles as TILES
from . import kernels as K
from .. import interpreter_active
from .tiles import BackwardTiles, DecodeTiles, Tiles, backward_tiles, decode_tiles, forward_tiles
from ..runtime import KernelSpec, numerics, pointer_type, scratch_piece

LOG2E = math.log2(math.e)
DELTA_CHUNK = 128        # head-dim features per step of the delta kernel (d = 256: two)
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
                SOFTCAP=problem.softcap > 0, VEC=vector_elements(problem.dtype),
                **numerics(problem.dtype))


def vector_elements(dtype) -> int:
    """Elements of a 16-byte vector: the unit the kernels take strides in."""
    return 16 // element_size(dtype)


def _strides(problem, *tensors: str, names: dict | None = None, dims: str = "bsh",
             packed: bool | None = None, dtype=None) -> dict:
    """The Stride binds of each [b, s, h, d] tensor (packed [total, h, d]: batch stride 0) in
    16-byte vectors; ``names`` maps a tensor to its argument prefix (default its name)."""
    unit = vector_elements(dtype or problem.dtype)
    packed = problem.packed if packed is None else packed
    out = {}
    for t in tensors:
        arg = (names or {}).get(t, t)
        if packed:
            out.update({f"stride_{arg}{dims[0]}": 0, f"stride_{arg}{dims[1]}": Stride(t, 0, unit),
                        f"stride_{arg}{dims[2]}": Stride(t, 1, unit)})
        else:
            out.update({f"stride_{arg}{d}": Stride(t, i, unit) for i, d in enumerate(dims)})
    return out


def _softcap(problem) -> dict:
    """cap_in = scale / softcap, cap_out = softcap·log2(e) (unused without a softcap)."""
    c = problem.softcap
    return dict(cap_in=problem.scale / c if c else 0.0, cap_out=c * LOG2E)


def _cu_seqlens(problem) -> tuple[tuple[str, str | None], ...]:
    cu = "*i32" if problem.packed else None
    return (("cu_seqlens_q_ptr", cu), ("cu_seqlens_k_ptr", cu))


def _status(problem) -> tuple[str, str | None]:
    return ("status_ptr", "*i32" if problem.has_status else None)


def sanitise_spec(problem) -> KernelSpec:
    """The packed programs' first stage: cu_seqlens_q/k -> sanitised offsets (workspace)."""
    return KernelSpec.make(
        K.attn_sanitise_kernel,
        (*_cu_seqlens(problem), ("cu_q_ptr", "*i32"), ("cu_k_ptr", "*i32"), _status(problem)),
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


def _wide(problem) -> bool:
    """The variants that take the tiles' wide register budget: packed or softcapped."""
    return problem.packed or problem.softcap > 0


def uses_tma(problem) -> bool:
    """Whether the training kernels read their tiles through tensor descriptors made per
    program (TMA on sm_90 and sm_100: no per-thread addresses, no masks, tokens past a sequence
    read as zeros): every architecture but sm_80 (Ampere has no TMA), and not a paged prefill
    (its keys come from a block table, row by row)."""
    return target_arch(problem.device) != "sm_80" and not problem.paged


def _descriptors(problem, count: int) -> dict:
    """The TMA constexpr and the spec's descriptor count (0 without TMA)."""
    tma = uses_tma(problem)
    return dict(constexpr=dict(TMA=tma), descriptors=count if tma else 0)


def _paging(problem) -> dict:
    return dict(PAGED=problem.paged, PAGE=max(problem.page_size, 1), MAX_PAGES=max(problem.max_pages, 1))


def forward_spec(problem, config: Tiles | None = None) -> KernelSpec:
    """attn_fwd_kernel with the tile table's entry for the plan's architecture (or ``config``)."""
    tiles, bd = forward_tiles(problem, config), _bd(problem.head_dim)
    t = pointer_type(problem.dtype)
    args = (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("o_ptr", t), ("lse_ptr", "*fp32"),
            *_cu_seqlens(problem), ("block_table_ptr", "*i32" if problem.paged else None),
            ("status_ptr", "*i32" if problem.has_status and problem.paged else None),
            ("scale", "fp32"), ("cap_in", "fp32"),
            ("cap_out", "fp32"))
    tma = _descriptors(problem, 3)                  # q, k, v
    return KernelSpec.make(K.attn_fwd_kernel, args,
                           dict(_common(problem, tiles.bm, tiles.bn, bd), **_paging(problem),
                                TABLE_BLOCK=TABLE_BLOCK, TABLE_BIT=int(Status.BLOCK_TABLE),
                                HAS_STATUS=problem.has_status and problem.paged,
                                **tma["constexpr"]),
                           (_rows(problem, tiles.bm), problem.batch * problem.heads_q),
                           num_warps=tiles.warps, num_stages=tiles.stages,
                           maxnreg=tiles.budget(_wide(problem)), descriptors=tma["descriptors"],
                           cost=C.forward_cost(problem, tiles, bd, target_arch(problem.device)))


def backward_specs(problem, config: BackwardTiles | None = None) -> dict[str, KernelSpec]:
    """The backward's kernels in launch order: delta, dk/dv, dq."""
    tiles, bd = backward_tiles(problem, config), _bd(problem.head_dim)
    kv, qt = tiles.dkdv, tiles.dq
    t = pointer_type(problem.dtype)
    cu_q, cu_k = _cu_seqlens(problem)
    scales = (("scale", "fp32"), ("cap_in", "fp32"), ("cap_out", "fp32"))
    tma_dkdv, tma_dq = _descriptors(problem, 2), _descriptors(problem, 4)   # q, do; q, do, k, v
    delta = KernelSpec.make(
        K.attn_bwd_delta_kernel,
        (("o_ptr", t), ("do_ptr", t), ("delta_ptr", "*fp32"), cu_q),
        dict(HQ=problem.heads_q, D=problem.head_dim, BM=DELTA_ROWS, BD=bd,
             CHUNK=min(bd, DELTA_CHUNK), PACKED=problem.packed, VEC=vector_elements(problem.dtype)),
        (_rows(problem, DELTA_ROWS), problem.batch * problem.heads_q), num_warps=4, num_stages=2,
        cost=C.delta_cost(problem, DELTA_ROWS))
    dkdv = KernelSpec.make(
        K.attn_bwd_dkdv_kernel,
        (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
         ("delta_ptr", "*fp32"), cu_q, cu_k, ("dk_ptr", t), ("dv_ptr", t), *scales),
        dict(_common(problem, kv.bm, kv.bn, bd), FEATURES_M=tiles.features_m,
             **tma_dkdv["constexpr"]),
        (triton.cdiv(max(problem.seqlen_k, 1), kv.bn), problem.batch * problem.heads_kv),
        num_warps=kv.warps, num_stages=kv.stages, maxnreg=kv.budget(_wide(problem)),
        descriptors=tma_dkdv["descriptors"],
        cost=C.dkdv_cost(problem, kv, bd, target_arch(problem.device), tiles.features_m))
    dq = KernelSpec.make(
        K.attn_bwd_dq_kernel,
        (("q_ptr", t), ("k_ptr", t), ("v_ptr", t), ("do_ptr", t), ("lse_ptr", "*fp32"),
         ("delta_ptr", "*fp32"), cu_q, cu_k, ("dq_ptr", t), *scales),
        dict(_common(problem, qt.bm, qt.bn, bd), **tma_dq["constexpr"]),
        (_rows(problem, qt.bm), problem.batch * problem.heads_q), num_warps=qt.warps,
        num_stages=qt.stages, maxnreg=qt.budget(_wide(problem)), descriptors=tma_dq["descriptors"],
        cost=C.dq_cost(problem, qt, bd, target_arch(problem.device)))
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
    if reason is None and problem.device.type == "cpu" and emulated_target() is not None:
        return unsupported_arch_reason(problem, target_arch(problem.device))   # the emulated target
    return reason


def unsupported_arch_reason(problem, arch: str) -> str | None:
    """Why the kernels cannot be compiled for the tile-table family ``arch`` (the kernel report
    asks; on a device, ``unsupported_reason`` checks the exact capability)."""
    if _fp8_cache(problem) and arch == "sm_80":
        return "FP8 (e4m3) KV caches need sm_89 or newer"
    return None


def forward_workspace(problem, config: Tiles | None = None) -> Layout:
    """The sanitised offsets (packed); the tensor descriptors (TMA: ``scratch_piece``)."""
    return Layout([*offsets_workspace(problem), scratch_piece(forward_spec(problem, config))])


def backward_workspace(problem, config: BackwardTiles | None = None) -> Layout:
    """delta = rowsum(do ∘ o): fp32, one per query row and head (laid out like lse); the
    sanitised offsets (packed); the tensor descriptors of the dk/dv or the dq launch, whichever
    needs more (TMA: ``scratch_piece``)."""
    rows = problem.heads_q * (problem.total_q if problem.packed else problem.batch * problem.seqlen_q)
    return Layout([("delta", torch.float32, rows), *offsets_workspace(problem),
                   scratch_piece(*backward_specs(problem, config).values())])


def _lengths(problem) -> dict:
    return dict(SEQ_Q=problem.seqlen_q, SEQ_K=problem.seqlen_k, TOTAL_Q=problem.total_q)


def _kv_strides(problem, *tensors: str) -> dict:
    """k, v strides: paged pages [num_pages, page, h, d] (page, row, head), else as q's."""
    if problem.paged:
        return _strides(problem, *tensors, packed=False)
    return _strides(problem, *tensors)


def forward_program(problem, config: Tiles | None = None) -> Program:
    return Program(workspace=forward_workspace(problem, config), stages=(
        *_sanitise_stage(problem),
        Stage(forward_spec(problem, config), dict(
            _lengths(problem), **_sanitised(problem), **_strides(problem, "q", "o"),
            **_kv_strides(problem, "k", "v"), PAGES=problem.pages, scale=problem.scale,
            **_softcap(problem))),
    ))


def backward_program(problem, config: BackwardTiles | None = None) -> Program:
    specs = backward_specs(problem, config)
    delta = workspace_piece("delta")
    lengths = dict(_lengths(problem), **_sanitised(problem))
    scales = dict(scale=problem.scale, **_softcap(problem))
    return Program(workspace=backward_workspace(problem, config), stages=(
        *_sanitise_stage(problem),
        Stage(specs["delta"], dict(delta_ptr=delta, SEQ_Q=problem.seqlen_q, TOTAL_Q=problem.total_q,
                                   **_strides(problem, "o", "do"),
                                   **{k: v for k, v in _sanitised(problem).items() if "_q_" in k})),
        Stage(specs["dkdv"], dict(lengths, delta_ptr=delta, TOTAL_K=problem.total_k, **scales,
                                  **_strides(problem, "q", "k", "v", "do", "dk", "dv"))),
        Stage(specs["dq"], dict(lengths, delta_ptr=delta, **scales,
                                **_strides(problem, "q", "k", "v", "do", "dq"))),
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
    validity (int32 [b], written by the append kernel); (rotary) the rotated q [b, T, h_q, d]."""
    bm, _, bd = decode_blocks(problem, config)
    parts = problem.batch * problem.heads_kv * problem.num_splits * bm
    rotated = problem.batch * problem.tokens * problem.heads_q * problem.head_dim
    return Layout([("o_part", torch.float32, parts * bd), ("lse_part", torch.float32, parts),
                   ("row_ok", torch.int32, problem.batch),
                   ("q_rot", problem.dtype, rotated if problem.rotary_dim else 0)])


def _decode_flags(problem) -> dict:
    return dict(PAGE=problem.page_size, MAX_PAGES=problem.max_pages, PAGED=problem.paged,
                BATCH_IDX=problem.batch_idx, LEFTPAD=problem.leftpad)


def decode_specs(problem, config: DecodeTiles | None = None) -> dict[str, KernelSpec]:
    """The decode step's kernels in launch order: append, split, combine."""
    tiles = decode_tiles(problem, config)
    bm, bn, bd = decode_blocks(problem, config)
    split_len = split_length(problem, config)
    t, ct = pointer_type(problem.dtype), pointer_type(problem.cache_dtype)
    fp8 = problem.cache_dtype == FP8
    rotary, append = problem.rotary_dim > 0, problem.appended > 0
    index = (("block_table_ptr", "*i32" if problem.paged else None),
             ("cache_batch_idx_ptr", "*i32" if problem.batch_idx else None),
             ("cache_leftpad_ptr", "*i32" if problem.leftpad else None))
    scales = (("k_scale_ptr", "*fp32" if fp8 else None), ("v_scale_ptr", "*fp32" if fp8 else None))
    quant = dict(FP8=fp8, SCALE_PER_HEAD=problem.scale_per_head)
    vec = dict(VEC=vector_elements(problem.dtype), VEC_C=vector_elements(problem.cache_dtype))
    bk = problem.batch * problem.heads_kv
    block = min(1024, triton.next_power_of_2(problem.heads_kv * problem.head_dim))
    kv_blocks = triton.cdiv(problem.heads_kv * problem.head_dim, block) if append else 1
    q_blocks = triton.cdiv(problem.heads_q * problem.head_dim, block) if rotary else 0
    rot = pointer_type(problem.rotary_dtype) if rotary else None
    append_spec = KernelSpec.make(
        DK.decode_append_kernel,
        (("q_ptr", t if rotary else None), ("k_new_ptr", t if append else None),
         ("v_new_ptr", t if append else None), ("k_cache_ptr", ct), ("v_cache_ptr", ct),
         ("cache_seqlens_ptr", "*i32"), *index, *scales, ("rotary_cos_ptr", rot),
         ("rotary_sin_ptr", rot), ("q_rot_ptr", t if rotary else None), ("row_ok_ptr", "*i32"),
         _status(problem)),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BLOCK=block,
             KV_BLOCKS=kv_blocks, APPEND=append, ROTARY=rotary,
             HALF=max(1, problem.rotary_dim // 2), INTERLEAVED=problem.rotary_interleaved,
             ROTATE_EACH_QUERY=problem.rotary_queries == problem.tokens, FP8_MAX=FP8_MAX,
             EXACT_NEAREST=fp8 and interpreter_active(), TABLE_BLOCK=TABLE_BLOCK,
             LENGTH_BIT=int(Status.CACHE_SEQLENS), TABLE_BIT=int(Status.BLOCK_TABLE),
             SLOT_BIT=int(Status.SLOT_INDEX), HAS_STATUS=problem.has_status,
             **_decode_flags(problem), **quant, **vec),
        (problem.batch, max(problem.appended, problem.tokens if rotary else 1, 1),
         kv_blocks + q_blocks),
        cost=C.append_cost(problem, block))
    left, right = problem.window
    split = KernelSpec.make(
        DK.decode_split_kernel,
        (("q_ptr", t), ("k_cache_ptr", ct), ("v_cache_ptr", ct), ("cache_seqlens_ptr", "*i32"),
         *index, *scales, ("row_ok_ptr", "*i32"), ("o_part_ptr", "*fp32"),
         ("lse_part_ptr", "*fp32"), ("scale", "fp32"), ("cap_in", "fp32"), ("cap_out", "fp32")),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BN=bn, BD=bd,
             SPLITS=problem.num_splits, SPLIT_LEN=split_len, CAUSAL=problem.causal, LEFT=left,
             RIGHT=right, SOFTCAP=problem.softcap > 0, **_decode_flags(problem), **quant, **vec,
             **numerics(problem.dtype)),
        (bk, problem.num_splits), num_warps=tiles.warps, num_stages=tiles.stages,
        maxnreg=tiles.maxnreg, cost=C.split_cost(problem, tiles, bm, bd, split_len,
                                                      target_arch(problem.device)))
    combine = KernelSpec.make(
        DK.decode_combine_kernel,
        (("o_part_ptr", "*fp32"), ("lse_part_ptr", "*fp32"), ("o_ptr", t), ("lse_ptr", "*fp32")),
        dict(HQ=problem.heads_q, HKV=problem.heads_kv, D=problem.head_dim, BM=bm, BD=bd,
             SPLITS=problem.num_splits, VEC=vector_elements(problem.dtype)),
        (bk,), cost=C.combine_cost(problem, bm, bd))
    return dict(append=append_spec, split=split, combine=combine)


def _decode_strides(problem) -> dict:
    """Stride binds of the decode tensors: q, k_new, v_new, o [b, T, h, d]; the caches [rows
    or pages, positions, h, d] (in their own dtype's vectors)."""
    out = _strides(problem, "k_new", "v_new", names=dict(k_new="kn", v_new="vn"), dims="bth",
                   packed=False) if problem.appended else {}
    out.update(_strides(problem, "o", dims="bth", packed=False))
    out.update(_strides(problem, "k_cache", "v_cache", names=dict(k_cache="kc", v_cache="vc"),
                        dims="bsh", packed=False, dtype=problem.cache_dtype))
    if problem.rotary_dim:      # the split kernel reads the rotated q, contiguous in the workspace
        unit = vector_elements(problem.dtype)
        row = problem.heads_q * problem.head_dim
        out["split_q"] = dict(stride_qb=problem.tokens * row // unit, stride_qt=row // unit,
                              stride_qh=problem.head_dim // unit)
    else:
        out["split_q"] = _strides(problem, "q", dims="bth", packed=False)
    out["append_q"] = (_strides(problem, "q", dims="bth", packed=False) if problem.rotary_dim
                       else dict(stride_qb=0, stride_qt=0, stride_qh=0))
    if not problem.appended:
        out.update(stride_knb=0, stride_knt=0, stride_knh=0, stride_vnb=0, stride_vnt=0,
                   stride_vnh=0)
    return out


def decode_program(problem, config: DecodeTiles | None = None) -> Program:
    specs = decode_specs(problem, config)
    parts = dict(o_part_ptr=workspace_piece("o_part"), lse_part_ptr=workspace_piece("lse_part"))
    row_ok = dict(row_ok_ptr=workspace_piece("row_ok"))
    strides = _decode_strides(problem)
    split_q, append_q = strides.pop("split_q"), strides.pop("append_q")
    caches = {k: v for k, v in strides.items() if k.startswith(("stride_kc", "stride_vc"))}
    new = {k: v for k, v in strides.items() if k.startswith(("stride_kn", "stride_vn"))}
    sizes = dict(T=problem.tokens, N=problem.appended, CAPACITY=problem.capacity)
    room = problem.rotary_len - problem.rotary_queries if problem.rotary_dim else problem.capacity
    rotated = dict(q_rot_ptr=workspace_piece("q_rot")) if problem.rotary_dim else {}
    split_source = dict(q_ptr=workspace_piece("q_rot")) if problem.rotary_dim else {}
    return Program(workspace=decode_workspace(problem, config), stages=(
        Stage(specs["append"], dict(row_ok, **rotated, **sizes, **append_q, **new, **caches,
                                    PAGES=problem.pages, ROOM=room)),
        Stage(specs["split"], dict(parts, **row_ok, **split_source, **sizes, **split_q, **caches,
                                   scale=problem.scale, **_softcap(problem))),
        Stage(specs["combine"], dict(parts, T=problem.tokens,
                                     **{k: v for k, v in strides.items() if k.startswith("stride_o")})),
    ))
