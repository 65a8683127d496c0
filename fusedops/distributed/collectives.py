"""The torch.distributed pieces every distributed operator shares: the group's facts, the check
that every rank was given the same metadata, a differentiable all-gather and a tie that keeps a
rank's backward in step with the others'.

Every collective here is an ordinary ``torch.distributed`` call (NCCL on GPUs, gloo on CPU).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..core.dtypes import accumulator_dtype
from ..errors import ValidationError

# all_gather_single is the newer name of all_gather_into_tensor
gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_rank_world(group) -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size); ``group=None`` is the default group.
    Raises ValidationError when torch.distributed is not initialised or this process is not a
    member of the group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValidationError("group: expected an initialised torch.distributed process group "
                              "(torch.distributed.init_process_group), got none")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValidationError(f"group: expected a group this process belongs to, got {group!r}")
    return rank, dist.get_world_size(group)


def comm_device(group, like: torch.device) -> torch.device:
    """Where the group's collectives take their tensors: the CUDA device of ``like`` for NCCL,
    the CPU otherwise."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fingerprint(value) -> int:
    """A 64-bit signed hash of ``value``'s repr (the same on every process)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def check_same_on_every_rank(facts: Mapping[str, object], group, device: torch.device) -> None:
    """Checks that every rank of ``group`` passed the same ``facts`` (name -> value, compared by
    a 64-bit hash of their repr), with one all-gather of len(facts) int64s. Every rank learns of
    a mismatch, so every rank raises the same ValidationError naming the first differing
    argument, before any collective whose sizes depend on the facts could hang. A host read."""
    rank, world = group_rank_world(group)
    names = list(facts)
    mine = torch.tensor([fingerprint(facts[n]) for n in names], dtype=torch.int64)
    gathered = torch.empty(world * len(names), dtype=torch.int64, device=comm_device(group, device))
    gather_into(gathered, mine.to(gathered.device), group=group)
    table = gathered.view(world, len(names)).cpu()
    for i, name in enumerate(names):
        column = table[:, i]
        if bool((column != column[0]).any()):
            others = [r for r in range(world) if int(column[r]) != int(column[rank])]
            if not others:
                others = [r for r in range(world) if int(column[r]) != int(column[0])]
            raise ValidationError(
                f"{name}: expected the same value on every rank of the group, got a different one "
                f"on rank(s) {others} (rank {rank} has {facts[name]!r})")


def _zeros(shape, dtype, device) -> torch.Tensor:
    """A zero gradient of ``shape`` that allocates one element (a broadcast view)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def expect_group_device(name: str, tensor: torch.Tensor, group) -> None:
    """NCCL groups exchange CUDA tensors only: a CPU ``tensor`` is refused up front."""
    if dist.get_backend(group) == "nccl" and tensor.device.type != "cuda":
        raise ValidationError(f"{name}: expected a CUDA tensor with an NCCL process group, got one "
                              f"on {tensor.device}")


class _AllGather(torch.autograd.Function):
    """out[u] = x on rank u (out: [world, *x.shape]); backward: the reduce-scatter that is its
    adjoint, dx = sum over u of dout_u[rank], as an all_to_all and a sum in rank order (fp32;
    fp64 for fp64), rounded once."""

    @staticmethod
    def forward(ctx, x, group, *anchors):
        ctx.group = group
        ctx.anchors = [(a.shape, a.dtype, a.device) for a in anchors]
        _, world = group_rank_world(group)
        flat = x.contiguous().view(-1)
        out = flat.new_empty(world * flat.numel())
        gather_into(out, flat, group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received.view(-1), grad.view(-1), group=ctx.group)
        total = received[0].to(accumulator_dtype(grad.dtype), copy=True)
        for part in received[1:]:
            total += part
        return (total.to(grad.dtype), None, *(_zeros(*meta) for meta in ctx.anchors))


def all_gather(x: torch.Tensor, group, anchors=()) -> torch.Tensor:
    """Differentiable all-gather: [world, *x.shape] holding every rank's ``x`` (same shape and
    dtype on every rank), a new tensor. Its backward is the reduce-scatter (an all_to_all of
    the gradient slices and a sum in rank order: deterministic). ``anchors``: the operator's
    inputs that require grad; they get a zero gradient from this node, which keeps it in every
    rank's graph when ``x`` itself needs no gradient on some rank (an empty shard), so every
    rank runs the backward collective and every input gets a gradient on every rank."""
    return _AllGather.apply(x, group, *[a for a in anchors if a is not None and a.requires_grad])


class _Tie(torch.autograd.Function):
    """Returns ``out`` unchanged; the backward also sends a zero gradient to ``anchor``."""

    @staticmethod
    def forward(ctx, out, anchor):
        ctx.anchor_meta = (anchor.shape, anchor.dtype, anchor.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, _zeros(*ctx.anchor_meta)


def tie(out: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``out`` (a view) whose backward waits for, and feeds a zero gradient into, ``anchor``.

    Two uses: an output that may not depend on a collective's result on some rank (an empty
    shard) is tied to it, so every rank's backward reaches the collective; and a collective's
    input is tied to the previous collective's output, so every rank's backward runs the two
    in the same (reverse) order whatever its autograd engine finds ready first."""
    if not torch.is_grad_enabled() or not anchor.requires_grad:
        return out
    return _Tie.apply(out, anchor)
