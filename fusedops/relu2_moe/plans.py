"""Routed ReLU2 MoE: the router and the expert path, as plans and eager wrappers (the math:
``contract``). Nemotron 3's MoE layers: sigmoid router with a selection bias, top-k of E
non-gated experts expert(x) = W_down · relu(W_up · x)², plus a shared expert."""

from __future__ import annotations

import torch

from ..core.checks import expect_dtype, expect_ndim, expect_shape
from ..core.index_checks import check_range
from ..core.status import STATUS_DTYPE
from ..core.dtypes import accumulator_dtype, dtype_name
from ..core.options import (Option, expect_bool, expect_dtype_choice, expect_float, expect_int,
                            optional)
from ..core.tupledict import TupleDict
from ..errors import ValidationError
from ..plan import Plan, indices, inputs, outputs, saved_buffer, status_word
from ..plan.layouts import check_activation_layouts
from .contract import (DTYPES, LOGIT_DTYPES, MAX_GROUPS, MoEProblem, RouterProblem, backward_floor,
                       forward_floor, router_backward_floor, router_forward_floor, row_vector,
                       weight_grad_dtypes)


def _positive_int(name: str, value) -> int:
    return expect_int(name, value, minimum=1)


def _weight_grad_dtype(name: str, value) -> torch.dtype:
    return expect_dtype_choice(name, value, DTYPES)


def _activations(plan, vector: int) -> dict[str, int]:
    """Every activation operand of ``plan`` (those it declares strided) -> the ``row_vector``
    of its rows (one width per plan: H, or E for the router's logits)."""
    return {o.name: vector for o in type(plan).operands if o.strided}


_SCALE = Option("routed_scaling_factor", expect_float, 1.0)
_NORM = Option("norm_topk_prob", expect_bool, True)


def _has_status(descs) -> bool:
    """Checks the optional status word (int32 [1]); whether the plan has one."""
    if "status" not in descs:
        return False
    expect_dtype("status", descs["status"], (STATUS_DTYPE,))
    expect_shape("status", descs["status"], (1,), "[1]")
    return True


def _uniform_routing(problem, device) -> dict[str, torch.Tensor]:
    """Index data for timing autotune candidates: topk_ids with k distinct experts per token
    drawn uniformly (fixed seed: the production shapes' routing, about t·k / E rows per expert)
    and topk_weights in [0.1, 1.1)."""
    gen = torch.Generator(device=device).manual_seed(0)
    t, E, k = problem.tokens, problem.experts, problem.top_k
    scores = torch.rand(t, E, generator=gen, device=device)
    ids = scores.argsort(dim=1)[:, :k].to(torch.int32).contiguous()
    weights = torch.rand(t, k, generator=gen, device=device) + 0.1
    dtype = problem.weight_dtype if isinstance(problem, MoEProblem) else problem.compute_dtype
    return dict(topk_ids=ids, topk_weights=weights.to(dtype))


def _check_expert_ids(tensors, experts: int) -> None:
    """Host check of topk_ids (check_inputs): every id in [0, E) or -1 (padding)."""
    ids = tensors.get("topk_ids")
    if ids is not None:
        check_range("topk_ids", ids, 0, experts, allowed=(-1,), meaning=" (padding)")


# -- router ----------------------------------------------------------------------------------------
class _RouterPlan(Plan):
    backend_module = "relu2_moe.router"
    backends = ("torch", "triton")
    auto_order = ("triton", "torch")

    def _validate_logits(self, descs) -> tuple[int, int]:
        logits = descs["logits"]
        expect_ndim("logits", logits, 2, "[t, E]")
        expect_dtype("logits", logits, LOGIT_DTYPES)
        t, E = logits.shape
        if E < 1:
            raise ValidationError(f"logits: expected E >= 1 experts in [t, E], got {list(logits.shape)}")
        return t, E

    @staticmethod
    def _check_top_k(E: int, top_k: int) -> None:
        if top_k > E:
            raise ValidationError(f"top_k: expected at most E = {E} experts, got {top_k}")


class MoERouter(_RouterPlan):
    """The router's selection and weights (forward).

    Args:
        logits: [t, E] fp32 (bf16/fp16 are read and computed in fp32; fp64: torch backend); a
            view (the last dimension contiguous, rows a multiple of 16 bytes apart, e.g. the
            router's columns of a fused projection) where a row of E is a whole number of
            16-byte vectors, else contiguous (docs/relu2_moe.md, "Strided activations").
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
    lower expert index (both contiguous). Deterministic; no workspace; saves nothing (the
    backward reads logits and ids). The outputs must not overlap the inputs.

    NaN: for the selection a NaN choice score (a NaN logit or bias) ranks below every number,
    as -inf, ties to the lower expert index (a NaN group score likewise, ties to the lower
    group index), so topk_ids always holds k distinct experts in [0, E), of eligible groups.
    The weights are garbage in, garbage out: a selected expert with a NaN score gets a NaN
    weight (with norm_topk_prob, so does every weight of its token).
    """

    op_name = "moe_router"
    program_name = "forward"
    operands = (*inputs("logits", strided=True), *outputs("topk_weights"),
                *outputs("topk_ids", alignment=4), *inputs("correction_bias", optional=True))
    options = (Option("top_k", _positive_int), Option("n_group", _positive_int, 1),
               Option("topk_group", _positive_int, 1), _NORM, _SCALE)
    returns = ("topk_weights", "topk_ids")

    def __init__(self, logits, *, top_k: int, correction_bias=None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, backend: str = "auto") -> None:
        super().__init__(dict(logits=logits, correction_bias=correction_bias),
                         dict(top_k=top_k, n_group=n_group, topk_group=topk_group,
                              norm_topk_prob=norm_topk_prob,
                              routed_scaling_factor=routed_scaling_factor), backend)

    def _validate(self, descs, *, top_k, n_group, topk_group, norm_topk_prob,
                  routed_scaling_factor) -> RouterProblem:
        t, E = self._validate_logits(descs)
        self._check_top_k(E, top_k)
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
        logits_dtype = descs["logits"].dtype
        compute = accumulator_dtype(logits_dtype)
        if "correction_bias" in descs:
            expect_dtype("correction_bias", descs["correction_bias"], (compute,))
            expect_shape("correction_bias", descs["correction_bias"], (E,), "[E]")
        check_activation_layouts(self, descs, _activations(self, row_vector(E, logits_dtype)))
        self._plan_tensor("topk_weights", (t, top_k), compute)
        self._plan_tensor("topk_ids", (t, top_k), torch.int32)
        grouped = n_group > 1
        return RouterProblem(logits_dtype, t, E, top_k, n_group if grouped else 1,
                             topk_group if grouped else 1, norm_topk_prob, routed_scaling_factor,
                             "correction_bias" in descs, self.device)

    def floor(self):
        return router_forward_floor(self.problem)

    def execute(self, logits, topk_weights, topk_ids, *, correction_bias=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the router; returns TupleDict(topk_weights, topk_ids)."""
        return self._execute(dict(logits=logits, topk_weights=topk_weights, topk_ids=topk_ids,
                                  correction_bias=correction_bias, workspace=workspace,
                                  current_stream=current_stream))


class MoERouterBackward(_RouterPlan):
    """The router's backward: d_logits from d_topk_weights with the selection held fixed.

    Args: logits [t, E] as in the forward (a view likewise); topk_ids [t, k] int32 (1 <= k <= E)
    from it; d_topk_weights [t, k] fp32 (fp64 with fp64 logits); norm_topk_prob and
    routed_scaling_factor as in the forward; status: optional int32 [1] status word (a tensor
    or TensorDesc; docs/plans.md, "Index data").

    With r = sigmoid(logits)[ids], S = sum r + 1e-20 and c = routed_scaling_factor:
    d_r_j = c · (d_w_j / S - sum_i d_w_i r_i / S²) when norm_topk_prob, else c · d_w_j; then
    execute(logits, topk_ids, d_topk_weights, d_logits) writes d_logits [t, E] (logits' dtype;
    a view as logits may be) = d_r_j · r_j (1 - r_j) at ids_j (a repeated id: the sum, in slot order) and zero for every
    unselected expert (the hard top-k and the correction bias carry no gradient). An id outside
    [0, E) is dropped: it contributes nothing (its r_j counts 0 in S and its d_w_j is not read);
    unless it is -1 (padding) it sets Status.EXPERT_ID in ``status``. Deterministic; no
    workspace.
    """

    op_name = "moe_router_backward"
    program_name = "backward"
    operands = (*inputs("logits", strided=True), *indices("topk_ids"), *inputs("d_topk_weights"),
                *outputs("d_logits", strided=True), *status_word())
    options = (_NORM, _SCALE)
    returns = ("d_logits",)

    def __init__(self, logits, topk_ids, d_topk_weights, *, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, status=None, backend: str = "auto") -> None:
        super().__init__(dict(logits=logits, topk_ids=topk_ids, d_topk_weights=d_topk_weights,
                              status=status),
                         dict(norm_topk_prob=norm_topk_prob,
                              routed_scaling_factor=routed_scaling_factor), backend)

    def _check_index_values(self, tensors) -> None:
        _check_expert_ids(tensors, self.problem.experts)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """A uniform routing's topk_ids (the candidates are timed on valid ids)."""
        return dict(topk_ids=_uniform_routing(self.problem, self.device)["topk_ids"])

    def floor(self):
        return router_backward_floor(self.problem)

    def _validate(self, descs, *, norm_topk_prob, routed_scaling_factor) -> RouterProblem:
        t, E = self._validate_logits(descs)
        ids = descs["topk_ids"]
        expect_ndim("topk_ids", ids, 2, "[t, k]")
        expect_dtype("topk_ids", ids, (torch.int32,))
        if ids.shape[0] != t or not 1 <= ids.shape[1] <= E:
            raise ValidationError(f"topk_ids: expected [t, k] with t = {t} like logits and 1 <= k <= "
                                  f"E = {E}, got {list(ids.shape)}")
        top_k = ids.shape[1]
        logits_dtype = descs["logits"].dtype
        compute = accumulator_dtype(logits_dtype)
        expect_dtype("d_topk_weights", descs["d_topk_weights"], (compute,))
        expect_shape("d_topk_weights", descs["d_topk_weights"], (t, top_k), "[t, k] like topk_ids")
        check_activation_layouts(self, descs, _activations(self, row_vector(E, logits_dtype)))
        has_status = _has_status(descs)
        self._plan_tensor("d_logits", (t, E), logits_dtype)
        return RouterProblem(logits_dtype, t, E, top_k, 1, 1, norm_topk_prob,
                             routed_scaling_factor, False, self.device, has_status)

    def execute(self, logits, topk_ids, d_topk_weights, d_logits, *, status=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the backward; returns TupleDict(d_logits)."""
        return self._execute(dict(logits=logits, topk_ids=topk_ids, d_topk_weights=d_topk_weights,
                                  d_logits=d_logits, status=status, workspace=workspace,
                                  current_stream=current_stream))


def moe_router(logits, top_k: int, *, correction_bias=None, n_group: int = 1, topk_group: int = 1,
               norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
               backend: str = "auto", current_stream=None) -> TupleDict:
    """Eager router: returns TupleDict(topk_weights [t, k] fp32, topk_ids [t, k] int32).

    Example::

        weights, ids = fusedops.moe_router(x.float() @ w_router.T, 6, correction_bias=bias,
                                           routed_scaling_factor=2.5)
    """
    return MoERouter.eager(dict(logits=logits, correction_bias=correction_bias), top_k=top_k,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                           routed_scaling_factor=routed_scaling_factor, backend=backend,
                           current_stream=current_stream)


def moe_router_backward(logits, topk_ids, d_topk_weights, *, norm_topk_prob: bool = True,
                        routed_scaling_factor: float = 1.0, status=None, backend: str = "auto",
                        current_stream=None, check_inputs: bool | None = None) -> TupleDict:
    """Eager router backward: returns TupleDict(d_logits [t, E], logits' dtype). ``status``: an
    optional int32 [1] status word; ``check_inputs`` (default: FUSEDOPS_CHECK_INPUTS) checks
    topk_ids on the host first (a synchronisation) and raises naming the first bad entry."""
    return MoERouterBackward.eager(
        dict(logits=logits, topk_ids=topk_ids, d_topk_weights=d_topk_weights, status=status),
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
        backend=backend, current_stream=current_stream, check_inputs=check_inputs)


# -- experts ---------------------------------------------------------------------------------------
_WEIGHT_GRADS = (("w_up", "d_w_up"), ("w_down", "d_w_down"), ("shared_w_up", "d_shared_w_up"),
                 ("shared_w_down", "d_shared_w_down"))
_EXPERT_INPUTS = (*inputs("x", strided=True), *inputs("w_up", "w_down"), *indices("topk_ids"),
                  *inputs("topk_weights"))
_SHARED_INPUTS = inputs("shared_w_up", "shared_w_down", optional=True)
_STATUS = status_word()


class _ExpertPlan(Plan):
    backend_module = "relu2_moe.program"
    backends = ("torch", "triton")
    auto_order = ("triton", "torch")

    def _check_index_values(self, tensors) -> None:
        _check_expert_ids(tensors, self.problem.experts)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """A uniform routing (topk_ids, topk_weights): the candidates are timed on the
        production shapes' routing, not on zeros (every token to expert 0)."""
        return _uniform_routing(self.problem, self.device)

    def _validate_experts(self, descs) -> dict:
        """The checks shared by the forward and the backward; returns the problem's shape facts."""
        x = descs["x"]
        expect_ndim("x", x, 2, "[t, H]")
        expect_dtype("x", x, DTYPES)
        t, H = x.shape
        if t < 1 or H < 1:
            raise ValidationError(f"x: expected t, H >= 1 in [t, H], got {list(x.shape)}")
        w_up = descs["w_up"]
        expect_ndim("w_up", w_up, 3, "[E, I, H]")
        expect_dtype("w_up", w_up, (x.dtype,))
        E, I = w_up.shape[0], w_up.shape[1]
        if E < 1 or I < 1 or w_up.shape[2] != H:
            raise ValidationError(
                f"w_up: expected [E, I, H] with E, I >= 1 and H = {H} like x, got {list(w_up.shape)}")
        expect_dtype("w_down", descs["w_down"], (x.dtype,))
        expect_shape("w_down", descs["w_down"], (E, H, I), "[E, H, I]")
        ids = descs["topk_ids"]
        expect_ndim("topk_ids", ids, 2, "[t, k]")
        expect_dtype("topk_ids", ids, (torch.int32,))
        k = ids.shape[1]
        if ids.shape[0] != t or k < 1:
            raise ValidationError(
                f"topk_ids: expected [t, k] with t = {t} like x and k >= 1, got {list(ids.shape)}")
        expect_dtype("topk_weights", descs["topk_weights"], (accumulator_dtype(x.dtype),))
        expect_shape("topk_weights", descs["topk_weights"], (t, k), "[t, k] like topk_ids")
        if ("shared_w_up" in descs) != ("shared_w_down" in descs):
            alone = "shared_w_up" if "shared_w_up" in descs else "shared_w_down"
            raise ValidationError(
                f"shared_w_up, shared_w_down: expected both (a shared expert) or neither, got {alone} alone")
        shared = 0
        if "shared_w_up" in descs:
            su = descs["shared_w_up"]
            expect_ndim("shared_w_up", su, 2, "[I_shared, H]")
            expect_dtype("shared_w_up", su, (x.dtype,))
            shared = su.shape[0]
            if shared < 1 or su.shape[1] != H:
                raise ValidationError(
                    f"shared_w_up: expected [I_shared, H] with H = {H} like x, got {list(su.shape)}")
            expect_dtype("shared_w_down", descs["shared_w_down"], (x.dtype,))
            expect_shape("shared_w_down", descs["shared_w_down"], (H, shared), "[H, I_shared]")
        return dict(dtype=x.dtype, tokens=t, hidden=H, experts=E, intermediate=I, top_k=k,
                    shared_intermediate=shared, device=self.device,
                    has_status=_has_status(descs))


class ReLU2MoEForward(_ExpertPlan):
    """Forward of the routed ReLU2 experts (and an optional shared expert).

    Args (tensors or TensorDescs):
        x: [t, H] bf16/fp16/fp32 (fp64: reference precision, torch backend only); a view (the
            last dimension contiguous, rows a multiple of 16 bytes apart, e.g. a slice of an
            in-projection) where a row of H is a whole number of 16-byte vectors, else
            contiguous (docs/relu2_moe.md, "Strided activations"). Every other tensor is contiguous.
        w_up: [E, I, H], w_down: [E, H, I], x's dtype (transformers' NemotronHExperts layout).
        topk_ids: [t, k] int32 (an id outside [0, E) drops the assignment; -1 is padding);
            topk_weights: [t, k] fp32 (fp64 with fp64 x), e.g. from MoERouter (a dropped
            assignment's weight is never read).
        shared_w_up: [I_s, H], shared_w_down: [H, I_s]: a shared expert applied to every token
            with weight 1 (nn.Linear layout), added into the same fp32 sum.
        status: optional int32 [1] status word: an id outside [0, E) other than -1 sets
            Status.EXPERT_ID (docs/plans.md, "Index data").
        is_inference: no ``saved`` buffer (no backward will follow).

    execute(...) writes out [t, H] (x's dtype, a view as x may be; the fp32 sum over the k
    experts and the shared expert rounded once) and, unless is_inference, ``saved``
    (``saved_size`` bytes: the dispatch and u, see docs/relu2_moe.md for the byte formula; 0 bytes on
    the torch backend, whose backward recomputes). ``workspace_size`` bytes of workspace. Keep the inputs and saved
    unchanged until the backward has run. The dispatch runs on the device: no host
    synchronisation, so the plan is CUDA-graph capturable for any routing.
    """

    op_name = "relu2_moe_forward"
    program_name = "forward"
    operands = (*_EXPERT_INPUTS, *outputs("out", strided=True), *saved_buffer("out", optional=True),
                *_SHARED_INPUTS, *_STATUS)
    options = (Option("is_inference", expect_bool, False),)
    returns = ("out", "saved")

    def __init__(self, x, w_up, w_down, topk_ids, topk_weights, *, shared_w_up=None,
                 shared_w_down=None, is_inference: bool = False, status=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids,
                              topk_weights=topk_weights, shared_w_up=shared_w_up,
                              shared_w_down=shared_w_down, status=status),
                         dict(is_inference=is_inference), backend)

    def _validate(self, descs, *, is_inference) -> MoEProblem:
        facts = self._validate_experts(descs)
        check_activation_layouts(self, descs,
                                 _activations(self, row_vector(facts["hidden"], facts["dtype"])))
        self._plan_tensor("out", (facts["tokens"], facts["hidden"]), facts["dtype"])
        return MoEProblem(**facts, is_inference=is_inference, accumulate=False,
                          weight_grad_dtype=torch.float32)

    def _declare_program_buffers(self) -> None:
        if not self.is_inference:       # an inference plan has no saved buffer at all
            super()._declare_program_buffers()

    def floor(self):
        return forward_floor(self.problem)

    def _result(self, binding) -> TupleDict:
        return TupleDict(out=binding["out"], saved=binding.get("saved"))

    def execute(self, x, w_up, w_down, topk_ids, topk_weights, out, saved=None, *,
                shared_w_up=None, shared_w_down=None, status=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the forward; returns TupleDict(out, saved) (saved is None for is_inference)."""
        return self._execute(dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids,
                                  topk_weights=topk_weights, out=out, saved=saved,
                                  shared_w_up=shared_w_up, shared_w_down=shared_w_down,
                                  status=status, workspace=workspace,
                                  current_stream=current_stream))


class ReLU2MoEBackward(_ExpertPlan):
    """Backward of the routed ReLU2 experts (docs/relu2_moe.md).

    Takes the forward's inputs (the same topk_ids, shared expert and backend: the saved buffer
    holds the dispatch of those ids), d_out [t, H] (x's dtype; a view as x may be, row stride 0
    included), the forward's ``saved`` buffer and an optional ``status`` word (as the
    forward's). Writes d_x [t, H] (x's dtype, a view as x may be: the fp32 sum over the k
    experts and the shared expert rounded once), d_topk_weights [t, k] fp32
    (<d_out_t, y_tj>; zero for dropped assignments, ids outside [0, E)), and d_w_up [E, I, H],
    d_w_down [E, H, I] (and d_shared_w_up, d_shared_w_down) in ``weight_grad_dtype`` (default
    fp32 main-grad buffers, fp64 for fp64 inputs; or the weights' dtype), summed over each
    expert's tokens in fp32 in a fixed order; with ``accumulate=True`` added to the buffers'
    contents. ``workspace_size`` bytes of workspace. Deterministic: no float atomics.
    """

    op_name = "relu2_moe_backward"
    program_name = "backward"
    operands = (*_EXPERT_INPUTS, *inputs("d_out", strided=True), *saved_buffer("in"),
                *outputs("d_x", strided=True), *outputs("d_topk_weights", "d_w_up", "d_w_down"),
                *_SHARED_INPUTS,
                *outputs("d_shared_w_up", "d_shared_w_down", optional=True), *_STATUS)
    options = (Option("accumulate", expect_bool, False),
               Option("weight_grad_dtype", optional(_weight_grad_dtype), None))
    returns = ("d_x", "d_topk_weights", "d_w_up", "d_w_down", "d_shared_w_up", "d_shared_w_down")

    def __init__(self, x, w_up, w_down, topk_ids, topk_weights, d_out, *, shared_w_up=None,
                 shared_w_down=None, accumulate: bool = False,
                 weight_grad_dtype: torch.dtype | None = None, status=None,
                 backend: str = "auto") -> None:
        super().__init__(dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids,
                              topk_weights=topk_weights, d_out=d_out, shared_w_up=shared_w_up,
                              shared_w_down=shared_w_down, status=status),
                         dict(accumulate=accumulate, weight_grad_dtype=weight_grad_dtype), backend)

    def _validate(self, descs, *, accumulate, weight_grad_dtype) -> MoEProblem:
        facts = self._validate_experts(descs)
        allowed = weight_grad_dtypes(facts["dtype"])
        grad_dtype = allowed[0] if weight_grad_dtype is None else weight_grad_dtype
        if grad_dtype not in allowed:
            names = " or ".join(dtype_name(d) for d in allowed)
            raise ValidationError(f"weight_grad_dtype: expected {names}, got {weight_grad_dtype!r}")
        t, H = facts["tokens"], facts["hidden"]
        expect_dtype("d_out", descs["d_out"], (facts["dtype"],))
        expect_shape("d_out", descs["d_out"], (t, H), "[t, H] like x")
        check_activation_layouts(self, descs, _activations(self, row_vector(H, facts["dtype"])))
        self._plan_tensor("d_x", (t, H), facts["dtype"])
        self._plan_tensor("d_topk_weights", (t, facts["top_k"]), accumulator_dtype(facts["dtype"]))
        for weight, grad in _WEIGHT_GRADS:
            if weight in descs:
                self._plan_tensor(grad, descs[weight].shape, grad_dtype)
        return MoEProblem(**facts, is_inference=False, accumulate=accumulate,
                          weight_grad_dtype=grad_dtype)

    def floor(self):
        return backward_floor(self.problem)

    def _tuning_tensors(self) -> dict[str, torch.Tensor]:
        """A uniform routing, random inputs and the ``saved`` buffer a forward on the same
        backend writes for them (the dispatch the backward reads), so candidates are timed on
        the production shapes' routing."""
        tensors = _uniform_routing(self.problem, self.device)
        gen = torch.Generator(device=self.device).manual_seed(1)
        for name in ("x", "w_up", "w_down", "shared_w_up", "shared_w_down"):
            if name in self._descs:
                desc = self._descs[name]
                tensors[name] = (0.1 * torch.randn(desc.shape, generator=gen, device=self.device)
                                 ).to(desc.dtype)
        names = ("x", "w_up", "w_down", "topk_ids", "topk_weights")
        shared = {n: tensors.get(n) for n in ("shared_w_up", "shared_w_down")}
        forward = ReLU2MoEForward(*(tensors[n] for n in names), **shared,
                                  backend=self.selected_backend).compile(autotune=False)
        saved = forward.allocate_saved()
        forward.execute(*(tensors[n] for n in names), torch.empty_like(tensors["x"]), saved,
                        **shared, workspace=forward.allocate_workspace())
        tensors["saved"] = saved
        return tensors

    @property
    def gradient_names(self) -> tuple[str, ...]:
        """The gradients execute() writes, in TupleDict order."""
        return ("d_x", "d_topk_weights") + tuple(g for w, g in _WEIGHT_GRADS if w in self._descs)

    def execute(self, x, w_up, w_down, topk_ids, topk_weights, d_out, saved, d_x, d_topk_weights,
                d_w_up, d_w_down, *, shared_w_up=None, shared_w_down=None, d_shared_w_up=None,
                d_shared_w_down=None, status=None, workspace=None,
                current_stream=None) -> TupleDict:
        """Runs the backward; returns a TupleDict of the gradients (``gradient_names``)."""
        return self._execute(dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids,
                                  topk_weights=topk_weights, d_out=d_out, saved=saved, d_x=d_x,
                                  d_topk_weights=d_topk_weights, d_w_up=d_w_up, d_w_down=d_w_down,
                                  shared_w_up=shared_w_up, shared_w_down=shared_w_down,
                                  d_shared_w_up=d_shared_w_up, d_shared_w_down=d_shared_w_down,
                                  status=status, workspace=workspace,
                                  current_stream=current_stream))


def relu2_moe_forward(x, w_up, w_down, topk_ids, topk_weights, *, shared_w_up=None,
                      shared_w_down=None, is_inference: bool = False, status=None,
                      backend: str = "auto", current_stream=None,
                      check_inputs: bool | None = None) -> TupleDict:
    """Eager forward: returns TupleDict(out, saved) (saved is None with is_inference=True).
    Pass ``saved`` to ``relu2_moe_backward``. ``status``: an optional int32 [1] status word;
    ``check_inputs`` (default: FUSEDOPS_CHECK_INPUTS) checks topk_ids on the host first (a
    synchronisation) and raises naming the first bad entry.

    Example::

        out, saved = fusedops.relu2_moe_forward(x, w_up, w_down, ids, weights)
    """
    return ReLU2MoEForward.eager(
        dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights,
             shared_w_up=shared_w_up, shared_w_down=shared_w_down, status=status),
        is_inference=is_inference, backend=backend, current_stream=current_stream,
        check_inputs=check_inputs)


def relu2_moe_backward(x, w_up, w_down, topk_ids, topk_weights, d_out, saved, *, shared_w_up=None,
                       shared_w_down=None, weight_grad_dtype: torch.dtype | None = None,
                       status=None, backend: str = "auto", current_stream=None,
                       check_inputs: bool | None = None) -> TupleDict:
    """Eager backward: allocates the gradients; returns TupleDict(d_x, d_topk_weights, d_w_up,
    d_w_down[, d_shared_w_up, d_shared_w_down]). ``status`` and ``check_inputs`` as in
    ``relu2_moe_forward``."""
    return ReLU2MoEBackward.eager(
        dict(x=x, w_up=w_up, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights,
             d_out=d_out, saved=saved, shared_w_up=shared_w_up, shared_w_down=shared_w_down,
             status=status),
        weight_grad_dtype=weight_grad_dtype, backend=backend, current_stream=current_stream,
        check_inputs=check_inputs)
