"""Routed ReLU2 mixture of experts (specs/moe.md): the router, and the expert path forward and
backward, as plans and eager wrappers. Nemotron 3's MoE layers: sigmoid router with a selection
bias, top-k of E non-gated experts expert(x) = W_down · relu(W_up · x)², plus a shared expert.

Router, per token (fp32):

    s      = sigmoid(logits)
    choice = s + correction_bias        (selection only; optional group-limited masking)
    ids    = top_k(choice)              descending, ties to the lower expert index
    w      = s[ids] / (sum s[ids] + 1e-20) if norm_topk_prob, then · routed_scaling_factor

Experts, per assignment (t, j) with e = ids[t, j]:

    u_tj = W_up[e] x_t     a_tj = relu(u_tj)²     out_t = sum_j w_tj · W_down[e] a_tj  (+ shared)

u and a are rounded to x's dtype (as a bf16 model computes them), y and the sum over j stay fp32
and out is rounded once. An id outside [0, E) (use -1) drops the assignment: it contributes
nothing and gets a zero routing-weight gradient (padding tokens of a captured graph, experts
held by another rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import expect_contiguous, expect_dtype, expect_ndim, expect_shape
from ._desc import TensorDesc
from ._plan import EAGER_PLANS, Plan, describe
from ._stream import allocation_stream
from ._tupledict import TupleDict
from .errors import ValidationError

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
MAX_GROUPS = 64
NORM_EPS = 1e-20
_ROUTER_IMPLEMENTATIONS = {"torch": "fusedops.backends.torch.moe_router",
                           "triton": "fusedops.backends.triton.moe_router"}
_EXPERT_IMPLEMENTATIONS = {"torch": "fusedops.backends.torch.moe",
                           "triton": "fusedops.backends.triton.moe"}


def _expect_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"{name}: expected a bool, got {value!r}")
    return value


def _expect_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValidationError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


# -- router --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RouterProblem:
    """Plan-time facts of the router (forward and backward)."""

    logits_dtype: torch.dtype
    tokens: int
    experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    has_bias: bool
    device: torch.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.logits_dtype == torch.float64 else torch.float32


class _RouterPlan(Plan):
    implementations = _ROUTER_IMPLEMENTATIONS

    def _declare_logits(self, logits):
        logits = self._declare("logits", logits)
        expect_ndim("logits", logits, 2, "[t, E]")
        expect_dtype("logits", logits, LOGIT_DTYPES)
        t, E = logits.shape
        if E < 1:
            raise ValidationError(f"logits: expected E >= 1 experts in [t, E], got {list(logits.shape)}")
        return logits, t, E

    def _declare_options(self, E, top_k, norm_topk_prob, routed_scaling_factor):
        top_k = _expect_int("top_k", top_k, 1)
        if top_k > E:
            raise ValidationError(f"top_k: expected at most E = {E} experts, got {top_k}")
        _expect_bool("norm_topk_prob", norm_topk_prob)
        try:
            scale = float(routed_scaling_factor)
        except (TypeError, ValueError):
            scale = math.nan
        if not math.isfinite(scale) or isinstance(routed_scaling_factor, bool):
            raise ValidationError(
                f"routed_scaling_factor: expected a finite float, got {routed_scaling_factor!r}")
        return top_k, scale


class MoERouter(_RouterPlan):
    """The router's selection and weights (forward).

    Args:
        logits: [t, E] fp32 (bf16/fp16 are read and computed in fp32; fp64: torch backend).
        top_k: experts per token.
        correction_bias: optional [E] fp32 (fp64 with fp64 logits), added to the scores for the
            selection only (Nemotron's e_score_correction_bias).
        n_group, topk_group: group-limited selection: the E experts form n_group equal groups;
            only the topk_group groups with the largest sum of their two best choice scores are
            eligible (ties to the lower group index). n_group = 1 disables it.
        norm_topk_prob: divide the k selected scores by their sum + 1e-20.
        routed_scaling_factor: multiplies the weights after the normalisation.

    execute(logits, topk_weights, topk_ids) writes topk_weights [t, k] fp32 (fp64 with fp64
    logits) and topk_ids [t, k] int32, in descending order of the choice score with ties to the
    lower expert index. NaN logits give unspecified ids. Deterministic; saves nothing (the
    backward reads logits and ids).
    """

    op_name = "moe_router"

    def __init__(self, logits, *, top_k: int, correction_bias=None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, backend: str = "auto") -> None:
        super().__init__(backend)
        logits, t, E = self._declare_logits(logits)
        top_k, scale = self._declare_options(E, top_k, norm_topk_prob, routed_scaling_factor)
        n_group = _expect_int("n_group", n_group, 1)
        topk_group = _expect_int("topk_group", topk_group, 1)
        if E % n_group or n_group > MAX_GROUPS or (n_group > 1 and E // n_group < 2):
            raise ValidationError(
                f"n_group: expected a divisor of E = {E} of at most {MAX_GROUPS} giving groups of "
                f">= 2 experts (1 disables grouping), got {n_group}")
        if topk_group > n_group:
            raise ValidationError(f"topk_group: expected at most n_group = {n_group}, got {topk_group}")
        if n_group > 1 and top_k > topk_group * (E // n_group):
            raise ValidationError(
                f"top_k: expected at most topk_group · E / n_group = {topk_group * (E // n_group)} "
                f"eligible experts, got {top_k}")
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        if correction_bias is not None:
            bias = self._declare("correction_bias", correction_bias)
            expect_dtype("correction_bias", bias, (compute,))
            expect_shape("correction_bias", bias, (E,), "[E]")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        grouped = n_group > 1
        self.problem = RouterProblem(logits.dtype, t, E, top_k, n_group if grouped else 1,
                                     topk_group if grouped else 1, norm_topk_prob, scale,
                                     correction_bias is not None, self.device)
        self._declare_output("topk_weights", (t, top_k), compute)
        self._declare_output("topk_ids", (t, top_k), torch.int32, alignment=4)
        self._select_backend(self.problem)

    def _build_launcher(self):
        return self._impl.forward_launcher(self.problem)

    def execute(self, logits, topk_weights, topk_ids, *, correction_bias=None,
                current_stream=None) -> TupleDict:
        """Runs the router; returns TupleDict(topk_weights, topk_ids)."""
        inputs = dict(logits=logits, correction_bias=correction_bias)
        outputs = dict(topk_weights=topk_weights, topk_ids=topk_ids)
        stream = self._prepare_execute(inputs, outputs, None, current_stream)
        self._run(dict(inputs, **outputs), stream=stream)
        return TupleDict(topk_weights=topk_weights, topk_ids=topk_ids)


class MoERouterBackward(_RouterPlan):
    """The router's backward: d_logits from d_topk_weights with the selection held fixed.

    With r = sigmoid(logits)[ids], S = sum r + 1e-20 and c = routed_scaling_factor:
    d_r_j = c · (d_w_j / S - sum_i d_w_i r_i / S²) when norm_topk_prob, else c · d_w_j; then
    d_logits[ids_j] = d_r_j · r_j (1 - r_j) and zero for every unselected expert (the hard top-k
    and the correction bias carry no gradient). d_logits has logits' dtype. Ids outside [0, E)
    are skipped. Deterministic.
    """

    op_name = "moe_router_backward"

    def __init__(self, logits, topk_ids, d_topk_weights, *, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, backend: str = "auto") -> None:
        super().__init__(backend)
        logits, t, E = self._declare_logits(logits)
        ids = self._declare("topk_ids", topk_ids, alignment=4)
        expect_ndim("topk_ids", ids, 2, "[t, k]")
        expect_dtype("topk_ids", ids, (torch.int32,))
        if ids.shape[0] != t or not 1 <= ids.shape[1] <= E:
            raise ValidationError(f"topk_ids: expected [t, k] with t = {t} like logits and 1 <= k <= "
                                  f"E = {E}, got {list(ids.shape)}")
        top_k, scale = self._declare_options(E, ids.shape[1], norm_topk_prob, routed_scaling_factor)
        compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
        dw = self._declare("d_topk_weights", d_topk_weights)
        expect_dtype("d_topk_weights", dw, (compute,))
        expect_shape("d_topk_weights", dw, (t, top_k), "[t, k] like topk_ids")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        self.problem = RouterProblem(logits.dtype, t, E, top_k, 1, 1, norm_topk_prob, scale, False,
                                     self.device)
        self._declare_output("d_logits", (t, E), logits.dtype)
        self._select_backend(self.problem)

    def _build_launcher(self):
        return self._impl.backward_launcher(self.problem)

    def execute(self, logits, topk_ids, d_topk_weights, d_logits, *, current_stream=None) -> TupleDict:
        """Runs the backward; returns TupleDict(d_logits)."""
        inputs = dict(logits=logits, topk_ids=topk_ids, d_topk_weights=d_topk_weights)
        stream = self._prepare_execute(inputs, dict(d_logits=d_logits), None, current_stream)
        self._run(dict(inputs, d_logits=d_logits), stream=stream)
        return TupleDict(d_logits=d_logits)


def moe_router(logits, top_k: int, *, correction_bias=None, n_group: int = 1, topk_group: int = 1,
               norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
               backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager router: returns TupleDict(topk_weights [t, k] fp32, topk_ids [t, k] int32).

    Example::

        weights, ids = fusedops.moe_router(x.float() @ w_router.T, 6, correction_bias=bias,
                                           routed_scaling_factor=2.5)
    """
    plan = EAGER_PLANS.get(MoERouter, describe(logits), top_k=top_k,
                           correction_bias=describe(correction_bias), n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor, backend=backend)
    with allocation_stream(current_stream, plan.device):
        weights = torch.empty(plan.desc("topk_weights").shape, dtype=plan.desc("topk_weights").dtype,
                              device=logits.device)
        ids = torch.empty(plan.desc("topk_ids").shape, dtype=torch.int32, device=logits.device)
    return plan.execute(logits, weights, ids, correction_bias=correction_bias,
                        current_stream=current_stream)


def moe_router_backward(logits, topk_ids, d_topk_weights, *, norm_topk_prob: bool = True,
                        routed_scaling_factor: float = 1.0, backend: str = "auto",
                        current_stream=None) -> TupleDict:
    """Eager router backward: returns TupleDict(d_logits [t, E], logits' dtype)."""
    plan = EAGER_PLANS.get(MoERouterBackward, describe(logits), describe(topk_ids),
                           describe(d_topk_weights), norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor, backend=backend)
    with allocation_stream(current_stream, plan.device):
        d_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return plan.execute(logits, topk_ids, d_topk_weights, d_logits, current_stream=current_stream)


# -- experts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEProblem:
    """Plan-time facts of the expert path (forward and backward)."""

    dtype: torch.dtype              # x, weights, out, d_out, d_x
    tokens: int                     # t (the plan's token count; unused tokens take id -1)
    hidden: int                     # H
    experts: int                    # E
    intermediate: int               # I
    top_k: int                      # k
    shared_intermediate: int        # I of the shared expert, 0 without one
    is_inference: bool              # forward: no saved buffer
    accumulate: bool                # backward: add weight gradients into the given buffers
    weight_grad_dtype: torch.dtype  # backward: d_w_up, d_w_down (and the shared ones)
    device: torch.device

    @property
    def assignments(self) -> int:
        return self.tokens * self.top_k

    @property
    def has_shared(self) -> bool:
        return self.shared_intermediate > 0

    @property
    def weight_dtype(self) -> torch.dtype:
        """Routing weights and their gradient: fp32 (fp64 for fp64 inputs)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32


_WEIGHT_GRADS = (("w_up", "d_w_up"), ("w_down", "d_w_down"), ("shared_w_up", "d_shared_w_up"),
                 ("shared_w_down", "d_shared_w_down"))


class _ExpertPlan(Plan):
    implementations = _EXPERT_IMPLEMENTATIONS

    def _declare_experts(self, x, w_up, w_down, topk_ids, topk_weights, shared_w_up,
                         shared_w_down) -> dict:
        x = self._declare("x", x)
        expect_ndim("x", x, 2, "[t, H]")
        expect_dtype("x", x, DTYPES)
        t, H = x.shape
        if t < 1 or H < 1:
            raise ValidationError(f"x: expected t, H >= 1 in [t, H], got {list(x.shape)}")
        w_up = self._declare("w_up", w_up)
        expect_ndim("w_up", w_up, 3, "[E, I, H]")
        expect_dtype("w_up", w_up, (x.dtype,))
        E, I = w_up.shape[0], w_up.shape[1]
        if E < 1 or I < 1 or w_up.shape[2] != H:
            raise ValidationError(
                f"w_up: expected [E, I, H] with E, I >= 1 and H = {H} like x, got {list(w_up.shape)}")
        w_down = self._declare("w_down", w_down)
        expect_dtype("w_down", w_down, (x.dtype,))
        expect_shape("w_down", w_down, (E, H, I), "[E, H, I]")
        ids = self._declare("topk_ids", topk_ids, alignment=4)
        expect_ndim("topk_ids", ids, 2, "[t, k]")
        expect_dtype("topk_ids", ids, (torch.int32,))
        k = ids.shape[1]
        if ids.shape[0] != t or k < 1:
            raise ValidationError(
                f"topk_ids: expected [t, k] with t = {t} like x and k >= 1, got {list(ids.shape)}")
        weight_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = self._declare("topk_weights", topk_weights)
        expect_dtype("topk_weights", w, (weight_dtype,))
        expect_shape("topk_weights", w, (t, k), "[t, k] like topk_ids")
        if (shared_w_up is None) != (shared_w_down is None):
            raise ValidationError(
                "shared_w_up, shared_w_down: expected both (a shared expert) or neither, got "
                f"{'shared_w_up' if shared_w_down is None else 'shared_w_down'} alone")
        shared = 0
        if shared_w_up is not None:
            su = self._declare("shared_w_up", shared_w_up)
            expect_ndim("shared_w_up", su, 2, "[I_shared, H]")
            expect_dtype("shared_w_up", su, (x.dtype,))
            shared = su.shape[0]
            if shared < 1 or su.shape[1] != H:
                raise ValidationError(
                    f"shared_w_up: expected [I_shared, H] with H = {H} like x, got {list(su.shape)}")
            sd = self._declare("shared_w_down", shared_w_down)
            expect_dtype("shared_w_down", sd, (x.dtype,))
            expect_shape("shared_w_down", sd, (H, shared), "[H, I_shared]")
        for name, desc in self._descs.items():
            expect_contiguous(name, desc)
        return dict(dtype=x.dtype, tokens=t, hidden=H, experts=E, intermediate=I, top_k=k,
                    shared_intermediate=shared, device=self.device)

    @property
    def saved_size(self) -> int:
        """Bytes of the ``saved`` buffer the forward writes and the backward reads (0 for
        is_inference plans and for the torch backend, which recomputes)."""
        return 0 if self.problem.is_inference else self._impl.saved_size(self.problem)

    def allocate_saved(self) -> torch.Tensor:
        return torch.empty(self.saved_size, dtype=torch.uint8, device=self.device)


class ReLU2MoEForward(_ExpertPlan):
    """Forward of the routed ReLU2 experts (and an optional shared expert).

    Args (tensors or TensorDescs; all contiguous):
        x: [t, H] bf16/fp16/fp32 (fp64: reference precision, torch backend only).
        w_up: [E, I, H], w_down: [E, H, I], x's dtype (transformers' NemotronHExperts layout).
        topk_ids: [t, k] int32 (ids outside [0, E) drop the assignment); topk_weights: [t, k]
            fp32 (fp64 with fp64 x), e.g. from MoERouter.
        shared_w_up: [I_s, H], shared_w_down: [H, I_s]: a shared expert applied to every token
            with weight 1 (nn.Linear layout), added into the same fp32 sum.
        is_inference: no ``saved`` buffer (no backward will follow).

    execute(...) writes out [t, H] (x's dtype; the fp32 sum over the k experts and the shared
    expert rounded once) and, unless is_inference, ``saved`` (``saved_size`` bytes: the
    dispatch and u, see docs/moe.md for the byte formula). The dispatch runs on the device:
    no host synchronisation, so the plan is CUDA-graph capturable for any routing.
    """

    op_name = "relu2_moe_forward"

    def __init__(self, x, w_up, w_down, topk_ids, topk_weights, *, shared_w_up=None,
                 shared_w_down=None, is_inference: bool = False, backend: str = "auto") -> None:
        super().__init__(backend)
        facts = self._declare_experts(x, w_up, w_down, topk_ids, topk_weights, shared_w_up,
                                      shared_w_down)
        _expect_bool("is_inference", is_inference)
        self.problem = MoEProblem(**facts, is_inference=is_inference, accumulate=False,
                                  weight_grad_dtype=torch.float32)
        self._declare_output("out", (self.problem.tokens, self.problem.hidden), self.problem.dtype)
        self._select_backend(self.problem)
        if not is_inference:
            self._declare_output("saved", (self.saved_size,), torch.uint8)
        self._workspace_bytes = self._impl.forward_workspace_size(self.problem)

    def _build_launcher(self):
        return self._impl.forward_launcher(self.problem)

    def execute(self, x, w_up, w_down, topk_ids, topk_weights, out, saved=None, *,
                shared_w_up=None, shared_w_down=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the forward; returns TupleDict(out, saved) (saved is None for is_inference)."""
        inputs = dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights,
                      shared_w_up=shared_w_up, shared_w_down=shared_w_down)
        outputs = dict(out=out, saved=saved)
        stream = self._prepare_execute(inputs, outputs, workspace, current_stream)
        self._run(dict(inputs, **outputs, workspace=workspace), stream=stream)
        return TupleDict(out=out, saved=saved)


class ReLU2MoEBackward(_ExpertPlan):
    """Backward of the routed ReLU2 experts (specs/moe.md).

    Takes the forward's inputs (the same shared expert and backend), d_out [t, H] (x's dtype)
    and the forward's ``saved`` buffer. Writes d_x [t, H] (x's dtype: the fp32 sum over the k
    experts and the shared expert rounded once), d_topk_weights [t, k] fp32 (<d_out_t, y_tj>;
    zero for dropped assignments), and d_w_up [E, I, H], d_w_down [E, H, I] (and
    d_shared_w_up, d_shared_w_down) in ``weight_grad_dtype`` (default fp32 main-grad buffers, fp64
    for fp64 inputs; or the weights' dtype), summed over each expert's tokens in fp32 in a fixed order; with
    ``accumulate=True`` added to the buffers' contents. Deterministic: no float atomics.
    """

    op_name = "relu2_moe_backward"

    def __init__(self, x, w_up, w_down, topk_ids, topk_weights, d_out, *, shared_w_up=None,
                 shared_w_down=None, accumulate: bool = False,
                 weight_grad_dtype: torch.dtype | None = None, backend: str = "auto") -> None:
        super().__init__(backend)
        facts = self._declare_experts(x, w_up, w_down, topk_ids, topk_weights, shared_w_up,
                                      shared_w_down)
        _expect_bool("accumulate", accumulate)
        allowed = tuple(dict.fromkeys((torch.float64,) if facts["dtype"] == torch.float64
                                      else (torch.float32, facts["dtype"])))
        weight_grad_dtype = allowed[0] if weight_grad_dtype is None else weight_grad_dtype
        if weight_grad_dtype not in allowed:
            names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValidationError(f"weight_grad_dtype: expected {names}, got {weight_grad_dtype!r}")
        d_out = self._declare("d_out", d_out)
        expect_dtype("d_out", d_out, (facts["dtype"],))
        expect_shape("d_out", d_out, (facts["tokens"], facts["hidden"]), "[t, H] like x")
        expect_contiguous("d_out", d_out)
        self.problem = MoEProblem(**facts, is_inference=False, accumulate=accumulate,
                                  weight_grad_dtype=weight_grad_dtype)
        pr = self.problem
        self._select_backend(pr)
        self._declare("saved", TensorDesc((self.saved_size,), torch.uint8, device=self.device))
        self._declare_output("d_x", (pr.tokens, pr.hidden), pr.dtype)
        self._declare_output("d_topk_weights", (pr.tokens, pr.top_k), pr.weight_dtype)
        for weight, grad in _WEIGHT_GRADS:
            if weight in self._descs:
                self._declare_output(grad, self._descs[weight].shape, weight_grad_dtype)
        self._workspace_bytes = self._impl.backward_workspace_size(pr)

    @property
    def gradient_names(self) -> tuple[str, ...]:
        """The gradients execute() writes, in TupleDict order."""
        return ("d_x", "d_topk_weights") + tuple(g for w, g in _WEIGHT_GRADS if w in self._descs)

    def _build_launcher(self):
        return self._impl.backward_launcher(self.problem)

    def execute(self, x, w_up, w_down, topk_ids, topk_weights, d_out, saved, d_x, d_topk_weights,
                d_w_up, d_w_down, *, shared_w_up=None, shared_w_down=None, d_shared_w_up=None,
                d_shared_w_down=None, workspace=None, current_stream=None) -> TupleDict:
        """Runs the backward; returns a TupleDict of the gradients (``gradient_names``)."""
        inputs = dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights,
                      d_out=d_out, saved=saved, shared_w_up=shared_w_up,
                      shared_w_down=shared_w_down)
        grads = dict(d_x=d_x, d_topk_weights=d_topk_weights, d_w_up=d_w_up, d_w_down=d_w_down,
                     d_shared_w_up=d_shared_w_up, d_shared_w_down=d_shared_w_down)
        stream = self._prepare_execute(inputs, grads, workspace, current_stream)
        self._run(dict(inputs, **grads, workspace=workspace), stream=stream)
        return TupleDict(**{k: grads[k] for k in self.gradient_names})


def relu2_moe_forward(x, w_up, w_down, topk_ids, topk_weights, *, shared_w_up=None,
                      shared_w_down=None, is_inference: bool = False, backend: str = "auto",
                      current_stream=None) -> TupleDict:
    """Eager forward: returns TupleDict(out, saved) (saved is None with is_inference=True).
    Pass ``saved`` to ``relu2_moe_backward``.

    Example::

        out, saved = fusedops.relu2_moe_forward(x, w_up, w_down, ids, weights)
    """
    plan = EAGER_PLANS.get(ReLU2MoEForward, describe(x), describe(w_up), describe(w_down),
                           describe(topk_ids), describe(topk_weights),
                           shared_w_up=describe(shared_w_up), shared_w_down=describe(shared_w_down),
                           is_inference=is_inference, backend=backend)
    with allocation_stream(current_stream, plan.device):
        out = torch.empty(plan.desc("out").shape, dtype=x.dtype, device=x.device)
        saved = None if is_inference else plan.allocate_saved()
        workspace = plan.allocate_workspace()
    return plan.execute(x, w_up, w_down, topk_ids, topk_weights, out, saved,
                        shared_w_up=shared_w_up, shared_w_down=shared_w_down, workspace=workspace,
                        current_stream=current_stream)


def relu2_moe_backward(x, w_up, w_down, topk_ids, topk_weights, d_out, saved, *, shared_w_up=None,
                       shared_w_down=None, weight_grad_dtype: torch.dtype | None = None,
                       backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager backward: allocates the gradients; returns TupleDict(d_x, d_topk_weights, d_w_up,
    d_w_down[, d_shared_w_up, d_shared_w_down])."""
    plan = EAGER_PLANS.get(ReLU2MoEBackward, describe(x), describe(w_up), describe(w_down),
                           describe(topk_ids), describe(topk_weights), describe(d_out),
                           shared_w_up=describe(shared_w_up), shared_w_down=describe(shared_w_down),
                           weight_grad_dtype=weight_grad_dtype, backend=backend)
    with allocation_stream(current_stream, plan.device):
        grads = {name: torch.empty(plan.desc(name).shape, dtype=plan.desc(name).dtype,
                                   device=x.device) for name in plan.gradient_names}
        workspace = plan.allocate_workspace()
    return plan.execute(x, w_up, w_down, topk_ids, topk_weights, d_out, saved, **grads,
                        shared_w_up=shared_w_up, shared_w_down=shared_w_down, workspace=workspace,
                        current_stream=current_stream)
