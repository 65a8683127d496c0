"""The expert-parallel experts as a differentiable function over ExpertParallelMoE plans."""

from __future__ import annotations

import atexit
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..core.desc import TensorDesc
from ..core.options import expect_int, optional
from ..errors import ValidationError
from .collectives import comm_device, group_rank_world
from .moe import ExpertParallelMoE

_PLANS: OrderedDict = OrderedDict()
_MAX_PLANS = 16
# The cached plans hold their process groups. Released before the interpreter shuts down, a
# group whose owner called destroy_process_group is freed while Python is still whole: freed
# during finalization instead, gloo's worker threads are joined as the interpreter tears down,
# which aborts the process now and then (torchrun showed it as a rank exiting with SIGABRT
# after its last step).
atexit.register(_PLANS.clear)


class _ExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w_up, w_down, topk_ids, plan):
        out = torch.empty_like(x)
        saved = plan.allocate_saved()
        result = plan.forward(x, w_up, w_down, topk_ids, topk_weights, out, saved,
                              workspace=plan.allocate_workspace())
        ctx.plan, ctx.splits = plan, result["splits"]
        ctx.save_for_backward(w_up, w_down, saved)
        return out

    @staticmethod
    def backward(ctx, d_out):
        w_up, w_down, saved = ctx.saved_tensors
        plan = ctx.plan
        d_out = d_out.contiguous()
        d_x = torch.empty_like(d_out)
        d_weights = torch.empty((d_out.shape[0], plan.top_k), dtype=plan.acc, device=d_out.device)
        d_w_up, d_w_down = torch.empty_like(w_up), torch.empty_like(w_down)
        plan.backward(w_up, w_down, d_out, saved, d_x, d_weights, d_w_up, d_w_down,
                      splits=ctx.splits, workspace=plan.allocate_workspace())
        return d_x, d_weights, d_w_up, d_w_down, None, None


def _agreed_max_tokens(tokens: int, group, device) -> int:
    """The largest token count of any rank (one all_reduce of an int64, read on the host)."""
    value = torch.tensor([tokens], dtype=torch.int64, device=comm_device(group, device))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def _plan(x, w_up, w_down, topk_ids, topk_weights, t_max, capacity, group, backend):
    key = (group, t_max, tuple(x.shape[1:]), tuple(w_up.shape), topk_ids.shape[1], x.dtype,
           topk_weights.dtype, x.device, capacity, backend)
    plan = _PLANS.get(key)
    if plan is None:
        rows = lambda t, like: TensorDesc((t_max, *like.shape[1:]), like.dtype, device=like.device)
        plan = ExpertParallelMoE(rows(t_max, x), w_up, w_down, rows(t_max, topk_ids),
                                 rows(t_max, topk_weights), capacity=capacity, group=group,
                                 weight_grad_dtype=x.dtype, backend=backend).compile()
        _PLANS[key] = plan
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    _PLANS.move_to_end(key)
    return plan


def expert_parallel_relu2_moe(x, w_up, w_down, topk_ids, topk_weights, *, group=None,
                              capacity: int | None = None, max_tokens: int | None = None,
                              backend: str = "auto") -> torch.Tensor:
    """Differentiable routed ReLU2 experts sharded over ``group`` (see ExpertParallelMoE).

    x [t, H] (this rank's tokens, t may differ from rank to rank, 0 on an empty rank),
    topk_ids [t, k] int32 global expert ids and topk_weights [t, k] fp32 (from the router, which
    every rank runs on its own tokens), w_up [E_l, I, H] and w_down [E_l, H, I] this rank's
    experts (global experts [rank·E_l, (rank + 1)·E_l)). Returns out [t, H] in x's dtype, with
    gradients for x, topk_weights (fp32) and this rank's expert weights (their dtype; summed
    over every rank's tokens, so they need no reduction across the group).

    ``max_tokens``: the most tokens any rank passes (required with ``capacity``); without it
    every call agrees on it with one all_reduce. Plans are cached per (max_tokens, shapes,
    capacity, backend). Every rank of the group must call it, and backpropagate through out.
    """
    _, world = group_rank_world(group)
    if x.ndim != 2 or topk_ids.ndim != 2:
        raise ValidationError(f"x, topk_ids: expected [t, H] and [t, k], got {list(x.shape)} and "
                              f"{list(topk_ids.shape)}")
    capacity = optional(lambda n, v: expect_int(n, v, minimum=1))("capacity", capacity)
    max_tokens = optional(lambda n, v: expect_int(n, v, minimum=1))("max_tokens", max_tokens)
    t = x.shape[0]
    if max_tokens is None:
        if capacity is not None:
            raise ValidationError("max_tokens: expected an int >= 1 with capacity (the "
                                  "capacity-bounded mode reads nothing on the host), got None")
        t_max = max(1, _agreed_max_tokens(t, group, x.device))
    elif t > max_tokens:
        raise ValidationError(f"x: expected at most max_tokens = {max_tokens} tokens, got {t}")
    else:
        t_max = max_tokens
    x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    plan = _plan(x, w_up, w_down, topk_ids, topk_weights, t_max, capacity, group, backend)
    return _ExpertParallel.apply(x, topk_weights, w_up, w_down, topk_ids, plan)
