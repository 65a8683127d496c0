"""GQA attention: training forward/backward and KV-cache decode plans, and their eager wrappers
(the math and the masks: ``contract``)."""

from __future__ import annotations

import functools

import torch

from ..core.checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ..core.dtypes import accumulator_dtype
from ..core.index_checks import check_cu_seqlens
from ..core.options import Option, expect_bool, expect_int, optional
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, indices, inputs, outputs, status_word
from .checks import expect_head_bytes, has_status, host_values, paged_table
from .contract import (DTYPES, MAX_HEAD_DIM, AttentionProblem, backward_floor, forward_floor,
                       resolve_scale, sequence_lengths, softcap, softmax_scale, window_size)

_length = optional(functools.partial(expect_int, minimum=0))

TRAINING_OPTIONS = (Option("causal", expect_bool, False),
                    Option("softmax_scale", softmax_scale, None),
                    Option("window_size", window_size, (-1, -1)),
                    Option("max_seqlen_q", _length, None),
                    Option("max_seqlen_k", _length, None),
                    Option("softcap", softcap, 0.0))


class _AttentionPlan(Plan):
    backend_module = "gqa_attention.program"
    backends = ("torch", "triton")
    options = TRAINING_OPTIONS

    def _validate_qkv(self, descs, *, causal, softmax_scale, window_size, max_seqlen_q,
                      max_seqlen_k, softcap) -> AttentionProblem:
        """Checks q, k, v (and cu_seqlens when packed, the block table when paged) and returns
        the problem. q, k, v may be strided views (last dimension contiguous)."""
        q, k, v = descs["q"], descs["k"], descs["v"]
        cq, ck = descs.get("cu_seqlens_q"), descs.get("cu_seqlens_k")
        packed = cq is not None or ck is not None
        paged = descs.get("block_table") is not None
        if paged and not packed:
            raise ValidationError("block_table: expected packed sequences (cu_seqlens_q, "
                                  "cu_seqlens_k) with a paged k, v, got none")
        layout = "[total, h, d]" if packed else "[b, s, h, d]"
        expect_ndim("q", q, 3 if packed else 4, layout)
        expect_dtype("q", q, DTYPES)
        for name, desc in (("k", k), ("v", v)):
            expect_ndim(name, desc, 4 if paged or not packed else 3,
                        "[num_pages, page_size, h_kv, d]" if paged else layout)
            expect_dtype(name, desc, (q.dtype,))
        hq, d = q.shape[-2], q.shape[-1]
        hkv = k.shape[-2]
        if hkv < 1 or hq % hkv:
            raise ValidationError(f"k: expected h_kv >= 1 dividing h_q = {hq}, got h_kv = {hkv}")
        if k.shape[-1] != d:
            raise ValidationError(f"k: expected head dim d = {d} like q, got {k.shape[-1]}")
        expect_shape("v", v, k.shape, "like k")
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValidationError(f"q: expected a head dim in [1, {MAX_HEAD_DIM}], got {d}")
        expect_head_bytes("q", q)
        page_size = max_pages = pages = 0
        if packed:
            if cq is None or ck is None:
                raise ValidationError(
                    "cu_seqlens_q, cu_seqlens_k: expected both for packed sequences, got one")
            expect_dtype("cu_seqlens_q", cq, (torch.int32,))
            expect_ndim("cu_seqlens_q", cq, 1, "[nseq + 1]")
            expect_dtype("cu_seqlens_k", ck, (torch.int32,))
            expect_shape("cu_seqlens_k", ck, cq.shape, "[nseq + 1] like cu_seqlens_q")
            if cq.shape[0] < 2:
                raise ValidationError(
                    f"cu_seqlens_q: expected [nseq + 1] with nseq >= 1, got {list(cq.shape)}")
            for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
                if value is None:
                    raise ValidationError(f"{name}: expected an int >= 0 (the longest sequence) "
                                          f"with packed sequences, got None")
            batch, total_q = cq.shape[0] - 1, q.shape[0]
            # no sequence covers more than the packed tokens: a larger bound changes nothing
            sq = min(max_seqlen_q, total_q)
            if paged:
                page_size, max_pages, pages = paged_table(descs, "k", batch, "nseq")
                if max_seqlen_k > page_size * max_pages:
                    raise ValidationError(
                        f"max_seqlen_k: expected at most the {max_pages} pages of {page_size} "
                        f"keys block_table gives a sequence, got {max_seqlen_k}")
                sk = max_seqlen_k
                total_k = batch * sk         # the offsets of keys held in pages: up to nseq·max
            else:
                total_k = k.shape[0]
                sk = min(max_seqlen_k, total_k)
        else:
            b, sq, _, _ = q.shape
            if k.shape[0] != b:
                raise ValidationError(f"k: expected batch {b} like q, got {k.shape[0]}")
            batch, sk = b, k.shape[1]
            total_q, total_k = b * sq, b * sk
        for name in ("cu_seqlens_q", "cu_seqlens_k", "block_table"):
            if name in descs:
                expect_contiguous(name, descs[name])
        return AttentionProblem(q.dtype, batch, sq, sk, hq, hkv, d, causal, window_size,
                                resolve_scale(softmax_scale, d), packed, total_q, total_k,
                                self.device, has_status(descs), softcap, paged, page_size,
                                max_pages, pages)

    def _check_index_values(self, tensors) -> None:
        """cu_seqlens_q/k (packed): starting at 0, non-decreasing, within the packed tokens, and
        no sequence longer than max_seqlen_q/k."""
        p = self.problem
        if not p.packed:
            return
        for name, total, option in (("cu_seqlens_q", p.total_q, "max_seqlen_q"),
                                    ("cu_seqlens_k", p.total_k, "max_seqlen_k")):
            longest = getattr(self, option)
            cu = tensors.get(name)
            if cu is None:
                continue
            check_cu_seqlens(name, cu, total)
            values = host_values(cu)
            for i in range(len(values) - 1):
                if values[i + 1] - values[i] > longest:
                    raise ValidationError(
                        f"{name}: expected sequences of at most {option} = {longest} tokens, got "
                        f"{name}[{i + 1}] - {name}[{i}] = {values[i + 1] - values[i]}")
        table, cu = tensors.get("block_table"), tensors.get("cu_seqlens_k")
        if p.paged and table is not None and cu is not None:
            rows, values = table.detach().to("cpu", torch.int64).tolist(), host_values(cu)
            for i in range(p.batch):
                for j in range(-(-(values[i + 1] - values[i]) // p.page_size)):
                    if not 0 <= rows[i][j] < p.pages:
                        raise ValidationError(f"block_table: expected entries in [0, {p.pages}), "
                                              f"got block_table[{i}, {j}] = {rows[i][j]}")

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """Packed: valid offsets of the sequences the cost models count (the longest the plan
        allows, as many as the tokens fill: ``contract.sequence_lengths``)."""
        p = self.problem
        if not p.packed:
            return {}
        lengths = sequence_lengths(p)
        out = {}
        for name, side in (("cu_seqlens_q", 0), ("cu_seqlens_k", 1)):
            offsets = [0]
            for pair in lengths:
                offsets.append(offsets[-1] + pair[side])
            out[name] = torch.tensor(offsets, dtype=torch.int32, device=self.device)
        if p.paged:      # each sequence its own pages, wrapping around a smaller pool
            table = torch.arange(p.batch * p.max_pages, dtype=torch.int64, device=self.device)
            out["block_table"] = (table % max(p.pages, 1)).view(p.batch, p.max_pages).to(torch.int32)
        return out

    def _lse_shape(self, problem: AttentionProblem) -> tuple[int, ...]:
        p = problem
        return (p.heads_q, p.total_q) if p.packed else (p.batch, p.heads_q, p.seqlen_q)


class GQAAttentionForward(_AttentionPlan):
    """Forward plan: o = softmax(scale·q kᵀ + mask) v per query head, and lse.

    Args (tensors or TensorDescs): q [b, s_q, h_q, d], k and v [b, s_k, h_kv, d] (bf16/fp16/fp32;
    float64 reference precision on the torch backend), d <= 256 with d·element size a multiple
    of 16 bytes, h_kv dividing h_q; or packed q [total_q, h_q, d], k, v [total_k, h_kv, d] with
    cu_seqlens_q, cu_seqlens_k [nseq + 1] int32 and static ints max_seqlen_q, max_seqlen_k (the
    longest sequences). q, k, v and o may be strided views (the last dimension contiguous, the
    other strides multiples of 16 bytes: slices of a fused QKV projection go in without a copy).
    causal (bool), window_size=(left, right) ints >= -1, softmax_scale (a finite float > 0;
    default 1/sqrt(d)), softcap (0: off, or a finite float > 0: S = softcap·tanh(scale·q kᵀ /
    softcap)): the bottom-right aligned masks of ``fusedops.gqa_attention.contract``.

    Paged prefill (flash-attn's varlen block_table): packed q and cu_seqlens with k, v pages
    [num_pages, page_size, h_kv, d] (page_size a multiple of 16) and block_table [nseq,
    max_pages] int32: sequence i's key j is row j % page_size of page block_table[i, j //
    page_size], its key count cu_seqlens_k[i + 1] - cu_seqlens_k[i] (max_seqlen_k <= max_pages ·
    page_size). A sequence that needs a page outside [0, num_pages) sees no key (o = 0, lse =
    -inf; Status.BLOCK_TABLE). Forward only: GQAAttentionBackward takes no block table.

    status: an optional int32 [1] status word (a tensor or TensorDesc; pass it to execute too):
    the kernels OR Status.CU_SEQLENS (Status.BLOCK_TABLE) into it for invalid index data.

    execute(q, k, v, o, lse, cu_seqlens_q=, cu_seqlens_k=, block_table=, workspace=, status=)
    writes o like q and lse fp32 (float64 for float64 inputs) [b, h_q, s_q] (packed: [h_q,
    total_q], contiguous): the natural-log log-sum-exp of the scaled, masked scores, -inf for a
    row that sees no key (its o is 0). Packed offsets are sanitised on the device, never read
    on the host (docs/plans.md, "Index data"): tokens no sequence covers get o = 0, lse = -inf.
    Workspace (Triton, packed): the sanitised offsets, 2·4·(nseq + 1) bytes; none otherwise. o
    and lse must not overlap the inputs; keep them for the backward.
    """

    op_name = "gqa_attention_forward"
    program_name = "forward"
    operands = (*inputs("q", "k", "v", strided=True), *outputs("o", strided=True),
                *outputs("lse"), *indices("cu_seqlens_q", "cu_seqlens_k", optional=True),
                *indices("block_table", optional=True), *status_word())
    returns = ("o", "lse")

    def __init__(self, q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                 softcap=0.0, block_table=None, status=None, backend: str = "auto") -> None:
        super().__init__(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              block_table=block_table, status=status),
                         dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              softcap=softcap), backend)

    def floor(self):
        """q, k, v read and o, lse written once; 4·b·h_q·s_q·s_k·d tensor-core FLOPs (about
        half causal): ``contract.forward_floor``."""
        return forward_floor(self.problem)

    def _validate(self, descs, **options) -> AttentionProblem:
        problem = self._validate_qkv(descs, **options)
        q = descs["q"]
        self._plan_tensor("o", q.shape, problem.dtype)
        self._plan_tensor("lse", self._lse_shape(problem), accumulator_dtype(problem.dtype))
        return problem

    def execute(self, q, k, v, o, lse, *, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
                workspace=None, status=None, current_stream=None) -> TupleDict:
        """Runs the forward into ``o`` and ``lse``; returns TupleDict(o, lse)."""
        return self._execute(dict(q=q, k=k, v=v, o=o, lse=lse, cu_seqlens_q=cu_seqlens_q,
                                  cu_seqlens_k=cu_seqlens_k, block_table=block_table,
                                  workspace=workspace, status=status,
                                  current_stream=current_stream))


class GQAAttentionBackward(_AttentionPlan):
    """Backward plan: dq, dk, dv from q, k, v, the forward's o and lse, and do, with the
    forward's options (softcap included).

    Args (tensors or TensorDescs): q, k, v, cu_seqlens as in the forward; o and do like q; lse
    as the forward writes it (fp32, or float64 for float64 inputs; contiguous). q, k, v, o, do,
    dq, dk and dv may be strided views (the last dimension contiguous, the other strides
    multiples of 16 bytes): dq, dk, dv can be written straight into one fused gradient buffer.

    execute(q, k, v, o, lse, do, dq, dk, dv, cu_seqlens_q=, cu_seqlens_k=, workspace=) writes dq
    like q and dk, dv like k (q's dtype). dk and dv are accumulated over the h_q / h_kv query heads
    of each KV head inside the kernels (never per query head) and deterministically (no float
    atomics). Tokens no sequence covers (packed offsets sanitised as in the forward) get zero
    gradients; ``status`` as in the forward. Workspace (Triton): delta = rowsum(do ∘ o), fp32
    per query row and head, and (packed) the sanitised offsets. The gradients must not overlap
    the inputs or each other.
    """

    op_name = "gqa_attention_backward"
    program_name = "backward"
    operands = (*inputs("q", "k", "v", "o", strided=True), *inputs("lse"),
                *inputs("do", strided=True), *outputs("dq", "dk", "dv", strided=True),
                *indices("cu_seqlens_q", "cu_seqlens_k", optional=True), *status_word())
    returns = ("dq", "dk", "dv")

    def __init__(self, q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                 window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                 max_seqlen_k=None, softcap=0.0, status=None, backend: str = "auto") -> None:
        super().__init__(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, status=status),
                         dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              softcap=softcap), backend)

    def floor(self):
        """q, k, v, o, do, lse read and dq, dk, dv written once; the standard backward's five
        products, 2.5x the forward's FLOPs: ``contract.backward_floor``."""
        return backward_floor(self.problem)

    def _validate(self, descs, **options) -> AttentionProblem:
        problem = self._validate_qkv(descs, **options)
        qd = descs["q"]
        for name in ("o", "do"):
            expect_dtype(name, descs[name], (qd.dtype,))
            expect_shape(name, descs[name], qd.shape, "like q")
        lse = descs["lse"]
        expect_dtype("lse", lse, (accumulator_dtype(qd.dtype),))
        expect_shape("lse", lse, self._lse_shape(problem),
                     "[h_q, total_q]" if problem.packed else "[b, h_q, s_q]")
        expect_contiguous("lse", lse)
        for name, src in (("dq", "q"), ("dk", "k"), ("dv", "v")):
            self._plan_tensor(name, descs[src].shape, qd.dtype)
        return problem

    def execute(self, q, k, v, o, lse, do, dq, dk, dv, *, cu_seqlens_q=None, cu_seqlens_k=None,
                workspace=None, status=None, current_stream=None) -> TupleDict:
        """Runs the backward into ``dq``, ``dk``, ``dv``; returns TupleDict(dq, dk, dv)."""
        return self._execute(dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=dq, dk=dk, dv=dv,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  workspace=workspace, status=status,
                                  current_stream=current_stream))


def gqa_attention_forward(q, k, v, *, causal: bool = False, softmax_scale=None, window_size=(-1, -1),
                          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                          softcap=0.0, block_table=None, status=None,
                          check_inputs: bool | None = None, backend: str = "auto",
                          current_stream=None) -> TupleDict:
    """Eager forward (see GQAAttentionForward): allocates o, lse and the workspace, returns
    TupleDict(o, lse). ``check_inputs=True`` (or FUSEDOPS_CHECK_INPUTS=1) first checks the
    packed offsets on the host (a synchronisation) and raises ValidationError naming the bad
    entry; ``status``: the optional status word the kernels report into.

    Example::

        o, lse = fusedops.gqa_attention_forward(q, k, v, causal=True)
    """
    return GQAAttentionForward.eager(
        dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
             block_table=block_table, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softcap=softcap)


def gqa_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, softmax_scale=None,
                           window_size=(-1, -1), cu_seqlens_q=None, cu_seqlens_k=None,
                           max_seqlen_q=None, max_seqlen_k=None, softcap=0.0, status=None,
                           check_inputs: bool | None = None, backend: str = "auto",
                           current_stream=None) -> TupleDict:
    """Eager backward (see GQAAttentionBackward): allocates the gradients and the workspace,
    returns TupleDict(dq, dk, dv). ``status``, ``check_inputs``: as in gqa_attention_forward."""
    return GQAAttentionBackward.eager(
        dict(q=q, k=k, v=v, o=o, lse=lse, do=do, cu_seqlens_q=cu_seqlens_q,
             cu_seqlens_k=cu_seqlens_k, status=status),
        backend=backend, current_stream=current_stream, check_inputs=check_inputs, causal=causal,
        softmax_scale=softmax_scale, window_size=window_size, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, softcap=softcap)
