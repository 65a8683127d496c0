"""Expert-parallel routed ReLU2 experts: the dispatch and combine over ``all_to_all_single``
around the existing expert plans (``ReLU2MoEForward`` / ``ReLU2MoEBackward``), as one plan.

Forward: routing tables from topk_ids (``moe_routing``); dropless: the per-destination row
counts exchanged (one all_to_all of W int64s, read on the host: the split sizes); the token
rows and their (local ids, weights) sent; the local experts run on the received rows (rows
past those received are padding, id −1); their outputs sent back; each token's rows summed in
rank order in fp32 and rounded once. Backward mirrors it: d_out sent along the dispatch's
route, the expert backward on the received rows, d_x rows and d_topk_weights sent back along
the combine's route.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.checks import check_no_overlap, expect_dtype, expect_ndim, expect_shape
from ..core.desc import TensorDesc
from ..core.device import bind_device
from ..core.dtypes import accumulator_dtype
from ..core.options import expect_int, optional
from ..core.tupledict import TupleDict
from ..core.workspace import Layout
from ..errors import PlanStateError, ValidationError
from ..relu2_moe import ReLU2MoEBackward, ReLU2MoEForward
from ..relu2_moe.contract import DTYPES
from .collectives import check_same_on_every_rank, fingerprint, group_rank_world
from .moe_routing import combine, route, send_metadata


def _describe(name: str, value) -> TensorDesc:
    if isinstance(value, torch.Tensor):
        return TensorDesc.from_tensor(value)
    if isinstance(value, TensorDesc):
        return value
    raise ValidationError(f"{name}: expected a torch.Tensor or fusedops.TensorDesc, got "
                          f"{type(value).__name__}")


def _gather_rows(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = rows[index[i]]; an unused send row (index −1) gets a copy of row 0 or, with no
    rows at all, zeros (its ids are −1: nothing reads it)."""
    if rows.shape[0]:
        torch.index_select(rows, 0, index.clamp(min=0), out=out)
    else:
        out.zero_()


def expert_capacity(tokens: int, top_k: int, world: int, factor: float = 1.25) -> int:
    """Row slots per (source, destination) rank pair for the capacity-bounded mode: ``factor``
    times the mean rows a rank sends each rank under uniform routing, tokens·min(k, W)/W,
    rounded up; at least 1 and at most ``tokens`` (which never drops a token)."""
    expect_int("tokens", tokens, minimum=1)
    expect_int("top_k", top_k, minimum=1)
    expect_int("world", world, minimum=1)
    mean = tokens * min(top_k, world) / world
    return max(1, min(tokens, -int(-(factor * mean) // 1)))


class ExpertParallelMoE:
    """Routed ReLU2 experts sharded over the ranks of ``group`` (expert parallelism), a plan:
    validated, compiled and sized once, executed into caller buffers.

    Args (tensors or TensorDescs on this rank's device):
        x: [t_max, H] bf16/fp16/fp32 (fp64: torch backend): the most tokens a call passes (the
            same on every rank); a call passes t <= t_max (0 on an empty rank).
        w_up: [E_l, I, H], w_down: [E_l, H, I]: this rank's experts, global experts
            [rank·E_l, (rank + 1)·E_l) of E = E_l·world.
        topk_ids: [t_max, k] int32 global ids (an id outside [0, E) is dropped; −1 padding),
        topk_weights: [t_max, k] fp32 (fp64 with fp64 x), e.g. from MoERouter.
        capacity: None (dropless) or C >= 1 row slots per (source, destination) rank pair (see
            docs/distributed.md for the trade-off; ``expert_capacity`` gives a default).
        group: the expert-parallel process group (None: the default group).
        weight_grad_dtype, is_inference, backend: as for ReLU2MoEForward/Backward.

    Construction is collective (every rank of the group constructs together): it checks that
    every rank planned the same E_l, I, H, k, t_max, capacity and dtypes, and raises the same
    ValidationError on every rank otherwise.

    Buffers: the received rows are bounded by R = world·t_max (dropless: each rank sends a
    token at most once to each rank) or world·C; the send rows by t_max·min(k, world) or
    world·C. ``workspace_size`` (scratch of both passes) and ``saved_size`` (forward ->
    backward: received rows, their ids and weights, the routing tables and the expert plan's
    saved bytes) hold every piece for that worst case. forward() returns TupleDict(out, saved,
    splits): splits (the host split sizes, dropless only) are handed to backward().

    Host reads: dropless reads the exchanged row counts (a synchronisation on CUDA: the
    all_to_all split sizes are host ints); capacity mode reads nothing and uses fixed split
    sizes, the condition for capturing a forward and backward in a CUDA Graph with the Triton
    backend (not yet tried on a GPU).
    The routing tables and the fp32 combine use small temporaries from torch's allocator.
    Outputs, ``saved`` and the workspace must not overlap the inputs or each other (checked);
    keep ``saved`` and the weights unchanged until backward() has run. Deterministic: bitwise
    identical results run to run at a fixed world size.
    """

    def __init__(self, x, w_up, w_down, topk_ids, topk_weights, *, capacity: int | None = None,
                 group=None, weight_grad_dtype: torch.dtype | None = None,
                 is_inference: bool = False, backend: str = "auto") -> None:
        self.rank, self.world = group_rank_world(group)
        self.group = group
        descs = {n: _describe(n, v) for n, v in dict(x=x, w_up=w_up, w_down=w_down,
                                                      topk_ids=topk_ids,
                                                      topk_weights=topk_weights).items()}
        x = descs["x"]
        expect_ndim("x", x, 2, "[t_max, H]")
        expect_dtype("x", x, DTYPES)
        t_max, H = x.shape
        if t_max < 1:
            raise ValidationError(f"x: expected t_max >= 1 in [t_max, H], got {list(x.shape)}")
        expect_ndim("w_up", descs["w_up"], 3, "[E_l, I, H]")
        E_l, I = descs["w_up"].shape[:2]
        expect_shape("w_down", descs["w_down"], (E_l, H, I), "[E_l, H, I]")
        expect_ndim("topk_ids", descs["topk_ids"], 2, "[t_max, k]")
        k = descs["topk_ids"].shape[1]
        self.capacity = optional(lambda n, v: expect_int(n, v, minimum=1))("capacity", capacity)
        self.device = bind_device("x", x.device)
        if dist.get_backend(group) == "nccl" and self.device.type != "cuda":
            raise ValidationError(f"x: expected a CUDA tensor with an NCCL process group, got one on "
                                  f"{self.device}")
        self.dtype, self.acc = x.dtype, accumulator_dtype(x.dtype)
        self.t_max, self.hidden, self.top_k, self.experts_per_rank = t_max, H, k, E_l
        self.num_experts = E_l * self.world
        W, C = self.world, self.capacity
        self.rows = W * (C if C else t_max)
        self.send_rows = W * C if C else t_max * min(k, W)
        self.meta_width = k + k * self.acc.itemsize // 4
        for name, shape, dtype in (("topk_ids", (t_max, k), torch.int32),
                                   ("topk_weights", (t_max, k), self.acc)):
            expect_dtype(name, descs[name], (dtype,))
            expect_shape(name, descs[name], shape, "[t_max, k] like x")
        rows = lambda shape, dtype: TensorDesc(shape, dtype, device=self.device)
        self._forward = ReLU2MoEForward(
            rows((self.rows, H), x.dtype), descs["w_up"], descs["w_down"],
            rows((self.rows, k), torch.int32), rows((self.rows, k), self.acc),
            is_inference=is_inference, backend=backend)
        self._backward = None if is_inference else ReLU2MoEBackward(
            rows((self.rows, H), x.dtype), descs["w_up"], descs["w_down"],
            rows((self.rows, k), torch.int32), rows((self.rows, k), self.acc),
            rows((self.rows, H), x.dtype), weight_grad_dtype=weight_grad_dtype, backend=backend)
        self.is_inference = is_inference
        self._layouts()
        facts = dict(x=("[t_max, H]", t_max, H, str(x.dtype)), w_up=("[E_l, I, H]", E_l, I),
                     topk_ids=("[t_max, k]", k), capacity=C, is_inference=is_inference,
                     weight_grad_dtype=str(weight_grad_dtype))
        self._plan_hash = fingerprint(tuple(facts.items()))
        check_same_on_every_rank(facts, group, self.device)
        self._compiled = False

    def _layouts(self) -> None:
        H, k, R, S, t = self.hidden, self.top_k, self.rows, self.send_rows, self.t_max
        kk = min(k, self.world)
        inner_saved = self._forward.saved_size if not self.is_inference else 0
        saved = [("x_recv", self.dtype, R * H), ("ids_recv", torch.int32, R * k),
                 ("w_recv", self.acc, R * k), ("src", torch.int64, S + 1),
                 ("slots", torch.int64, t * kk), ("assignment_rows", torch.int64, t * k),
                 ("inner_saved", torch.uint8, inner_saved)]
        forward = [("x_send", self.dtype, S * H), ("meta_send", torch.int32, S * self.meta_width),
                   ("meta_recv", torch.int32, R * self.meta_width), ("out_recv", self.dtype, R * H),
                   ("out_back", self.dtype, (S + 1) * H),
                   ("inner_workspace", torch.uint8, self._forward.workspace_size)]
        if self.is_inference:
            forward, saved = saved + forward, []
        self._saved = Layout(saved)
        self._forward_ws = Layout(forward)
        backward = [] if self._backward is None else [
            ("d_out_send", self.dtype, S * H), ("d_out_recv", self.dtype, R * H),
            ("d_x_recv", self.dtype, R * H), ("d_w_recv", self.acc, R * k),
            ("d_x_back", self.dtype, (S + 1) * H), ("d_w_back", self.acc, (S + 1) * k),
            ("inner_workspace", torch.uint8, self._backward.workspace_size)]
        self._backward_ws = Layout(backward)

    # -- the plan contract -----------------------------------------------------------------------
    def compile(self) -> ExpertParallelMoE:
        """Compiles the expert plans (process-wide cache). Returns the plan."""
        self._forward.compile()
        if self._backward is not None:
            self._backward.compile()
        self._compiled = True
        return self

    @property
    def selected_backend(self) -> str:
        """The expert plans' backend."""
        return self._forward.selected_backend

    @property
    def workspace_size(self) -> int:
        """Bytes of scratch forward() and backward() need (the larger of the two)."""
        return max(self._forward_ws.size, self._backward_ws.size)

    @property
    def saved_size(self) -> int:
        """Bytes the forward writes for the backward (0 with is_inference)."""
        return self._saved.size

    def allocate_workspace(self) -> torch.Tensor:
        """A uint8 tensor of ``workspace_size`` bytes on the plan's device."""
        return torch.empty(self.workspace_size, dtype=torch.uint8, device=self.device)

    def allocate_saved(self) -> torch.Tensor:
        """A uint8 tensor of ``saved_size`` bytes on the plan's device."""
        return torch.empty(self.saved_size, dtype=torch.uint8, device=self.device)

    def _piece(self, layout: Layout, buffer, name: str, shape, dtype):
        if name not in layout:
            return torch.empty(shape, dtype=dtype, device=self.device)   # a 0-byte piece
        return layout.carve(buffer, name).tensor().view(shape)

    def _check(self, name: str, tensor, rows: int, cols, dtype) -> None:
        shape = (rows, *cols)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or \
                tuple(tensor.shape) != shape or tensor.device != self.device or \
                not tensor.is_contiguous():
            got = (f"{list(tensor.shape)} {tensor.dtype} on {tensor.device}"
                   if isinstance(tensor, torch.Tensor) else type(tensor).__name__)
            raise ValidationError(f"{name}: expected a contiguous {list(shape)} {dtype} tensor on "
                                  f"{self.device}, got {got}")

    def _buffers(self, workspace, saved, layout: Layout) -> None:
        if not self._compiled:
            raise PlanStateError("ExpertParallelMoE: forward()/backward() called before compile()")
        for name, buffer, size in (("workspace", workspace, layout.size),
                                   ("saved", saved, self._saved.size)):
            if size and (not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or
                         buffer.numel() < size or buffer.device != self.device):
                raise ValidationError(f"{name}: expected a uint8 tensor of at least {size} bytes on "
                                      f"{self.device} (plan.allocate_{name}()), got {buffer!r:.80}")

    def _exchange(self, output, input, output_splits=None, input_splits=None) -> None:
        dist.all_to_all_single(output, input, output_splits, input_splits, group=self.group)

    def _counts(self, counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """Dropless: the row counts (and the plan fingerprints) exchanged, read on the host."""
        W = self.world
        mine = torch.stack([counts.cpu(), torch.full((W,), self._plan_hash, dtype=torch.int64)], 1)
        theirs = torch.empty_like(mine)
        dev = "cpu" if dist.get_backend(self.group) != "nccl" else self.device
        out = theirs.to(dev)
        self._exchange(out.view(-1), mine.to(dev).view(-1))
        table = out.cpu()
        bad = [r for r in range(W) if int(table[r, 1]) != self._plan_hash]
        if bad:
            raise ValidationError(f"ExpertParallelMoE: expected the same plan on every rank of the "
                                  f"group, got a different one on rank(s) {bad}")
        return counts.tolist(), table[:, 0].tolist()

    def forward(self, x, w_up, w_down, topk_ids, topk_weights, out, saved=None, *,
                workspace=None) -> TupleDict:
        """Dispatch, local experts, combine: writes out [t, H] (x's dtype) and ``saved``;
        returns TupleDict(out, saved, splits) (splits: (sent, received) row counts per rank,
        dropless only, for backward()). t <= t_max may differ from rank to rank."""
        self._buffers(workspace, saved, self._forward_ws)
        t = x.shape[0] if isinstance(x, torch.Tensor) and x.ndim == 2 else -1
        if not 0 <= t <= self.t_max:
            raise ValidationError(f"x: expected [t, {self.hidden}] with t <= t_max = {self.t_max}, "
                                  f"got {list(x.shape) if isinstance(x, torch.Tensor) else x!r}")
        self._check("x", x, t, (self.hidden,), self.dtype)
        self._check("topk_ids", topk_ids, t, (self.top_k,), torch.int32)
        self._check("topk_weights", topk_weights, t, (self.top_k,), self.acc)
        self._check("out", out, t, (self.hidden,), self.dtype)
        check_no_overlap(dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids,
                              topk_weights=topk_weights),
                         dict(out=out, saved=saved, workspace=workspace))
        H, k, R, S = self.hidden, self.top_k, self.rows, self.send_rows
        ws = workspace
        store = saved if not self.is_inference else workspace
        sv = self._saved if not self.is_inference else self._forward_ws
        piece = lambda name, shape, dtype, where=ws, layout=self._forward_ws: self._piece(
            layout, where, name, shape, dtype)
        kept = lambda name, shape, dtype: piece(name, shape, dtype, store, sv)
        routing = route(topk_ids, self.experts_per_rank, self.world, S, self.capacity)
        src = kept("src", (S + 1,), torch.int64)
        slots = kept("slots", (self.t_max, min(k, self.world)), torch.int64)
        src.copy_(routing.src)
        slots[:t].copy_(routing.slots)
        kept("assignment_rows", (self.t_max, k), torch.int64)[:t].copy_(routing.assignment_rows)
        if self.capacity is None:
            sent, received = self._counts(routing.counts)
            n_send, n_recv = sum(sent), sum(received)
        else:
            sent = received = None
            n_send = n_recv = S
        x_send = piece("x_send", (S, H), self.dtype)
        _gather_rows(x, src[:n_send], x_send[:n_send])
        meta_send = piece("meta_send", (S, self.meta_width), torch.int32)
        meta_send[:n_send].copy_(send_metadata(routing, topk_ids, topk_weights,
                                               self.experts_per_rank, n_send))
        x_recv = kept("x_recv", (R, H), self.dtype)
        meta_recv = piece("meta_recv", (R, self.meta_width), torch.int32)
        self._exchange(x_recv[:n_recv], x_send[:n_send], received, sent)
        self._exchange(meta_recv[:n_recv], meta_send[:n_send], received, sent)
        ids_recv, w_recv = kept("ids_recv", (R, k), torch.int32), kept("w_recv", (R, k), self.acc)
        ids_recv[:n_recv].copy_(meta_recv[:n_recv, :k])
        ids_recv[n_recv:].fill_(-1)
        w_recv.view(torch.int32).view(R, -1)[:n_recv].copy_(meta_recv[:n_recv, k:])
        w_recv[n_recv:].zero_()
        out_recv = piece("out_recv", (R, H), self.dtype)
        inner_ws = piece("inner_workspace", (self._forward.workspace_size,), torch.uint8)
        self._forward.execute(x_recv, w_up, w_down, ids_recv, w_recv, out_recv,
                              None if self.is_inference else
                              kept("inner_saved", (self._forward.saved_size,), torch.uint8),
                              workspace=inner_ws if self._forward.workspace_size else None)
        out_back = piece("out_back", (S + 1, H), self.dtype)
        self._exchange(out_back[:n_send], out_recv[:n_recv], sent, received)
        out_back[n_send:].zero_()
        combine(out_back, slots[:t], out)
        return TupleDict(out=out, saved=saved, splits=None if sent is None else (sent, received))

    def backward(self, w_up, w_down, d_out, saved, d_x, d_topk_weights, d_w_up, d_w_down, *,
                 splits=None, workspace=None) -> TupleDict:
        """The mirror of forward(): d_out [t, H] sent along the dispatch's route, the experts'
        backward on the received rows, d_x [t, H] and d_topk_weights [t, k] (fp32) sent back and
        combined; d_w_up, d_w_down (weight_grad_dtype) hold this rank's experts' gradients from
        every rank's tokens. ``splits``: forward()'s (dropless). Returns TupleDict(d_x,
        d_topk_weights, d_w_up, d_w_down)."""
        if self._backward is None:
            raise PlanStateError("ExpertParallelMoE: backward() of an is_inference plan")
        self._buffers(workspace, saved, self._backward_ws)
        t = d_out.shape[0] if isinstance(d_out, torch.Tensor) and d_out.ndim == 2 else -1
        if not 0 <= t <= self.t_max:
            raise ValidationError(f"d_out: expected [t, {self.hidden}] with t <= t_max = {self.t_max}, "
                                  f"got {list(d_out.shape) if isinstance(d_out, torch.Tensor) else d_out!r}")
        self._check("d_out", d_out, t, (self.hidden,), self.dtype)
        self._check("d_x", d_x, t, (self.hidden,), self.dtype)
        self._check("d_topk_weights", d_topk_weights, t, (self.top_k,), self.acc)
        check_no_overlap(dict(w_up=w_up, w_down=w_down, d_out=d_out, saved=saved),
                         dict(d_x=d_x, d_topk_weights=d_topk_weights, d_w_up=d_w_up,
                              d_w_down=d_w_down, workspace=workspace))
        if (splits is None) != (self.capacity is not None):
            raise ValidationError(f"splits: expected forward()'s splits (dropless) or None (capacity "
                                  f"mode), got {splits!r:.60}")
        H, k, R, S = self.hidden, self.top_k, self.rows, self.send_rows
        kept = lambda name, shape, dtype: self._piece(self._saved, saved, name, shape, dtype)
        piece = lambda name, shape, dtype: self._piece(self._backward_ws, workspace, name, shape, dtype)
        sent, received = splits if splits is not None else (None, None)
        n_send, n_recv = (sum(sent), sum(received)) if splits is not None else (S, S)
        src = kept("src", (S + 1,), torch.int64)
        d_out_send = piece("d_out_send", (S, H), self.dtype)
        _gather_rows(d_out, src[:n_send], d_out_send[:n_send])
        d_out_recv = piece("d_out_recv", (R, H), self.dtype)
        self._exchange(d_out_recv[:n_recv], d_out_send[:n_send], received, sent)
        d_out_recv[n_recv:].zero_()
        d_x_recv, d_w_recv = piece("d_x_recv", (R, H), self.dtype), piece("d_w_recv", (R, k), self.acc)
        inner_ws = piece("inner_workspace", (self._backward.workspace_size,), torch.uint8)
        self._backward.execute(
            kept("x_recv", (R, H), self.dtype), w_up, w_down, kept("ids_recv", (R, k), torch.int32),
            kept("w_recv", (R, k), self.acc), d_out_recv,
            kept("inner_saved", (self._backward.saved_size,), torch.uint8), d_x_recv, d_w_recv,
            d_w_up, d_w_down, workspace=inner_ws if self._backward.workspace_size else None)
        d_x_back = piece("d_x_back", (S + 1, H), self.dtype)
        d_w_back = piece("d_w_back", (S + 1, k), self.acc)
        self._exchange(d_x_back[:n_send], d_x_recv[:n_recv], sent, received)
        self._exchange(d_w_back[:n_send], d_w_recv[:n_recv], sent, received)
        d_x_back[n_send:].zero_()
        d_w_back[n_send:].zero_()
        combine(d_x_back, kept("slots", (self.t_max, min(k, self.world)), torch.int64)[:t], d_x)
        rows = kept("assignment_rows", (self.t_max, k), torch.int64)[:t]
        d_topk_weights.copy_(d_w_back.gather(0, rows))
        return TupleDict(d_x=d_x, d_topk_weights=d_topk_weights, d_w_up=d_w_up, d_w_down=d_w_down)
