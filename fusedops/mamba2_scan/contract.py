"""The Mamba2 chunked scan's contract: its problem, constants and math (docs/mamba2_scan.md).

Per batch row (or per sequence of a packed batch, through cu_seqlens) and head h, with groups of
B/C shared by h / g heads:

    dt_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, *dt_limit)
    h_t  = exp(dt_t · A) h_{t-1} + dt_t x_t ⊗ B_t             state [p, n], fp32
    y_t  = h_t C_t + D x_t,  then y_t · silu(z_t) when z is given

softplus(u) = u above SOFTPLUS_THRESHOLD (derivative 1), else log(1 + exp(u)) (derivative
sigmoid(u)); the clamp passes the gradient at its bounds. The scan is computed per *segment*
(at most chunk_size tokens of one sequence); a sequence of length L has ceil(L / chunk_size).

Packed sequences (cu_seqlens, any values; docs/plans.md, "Index data"): the kernels use the
sanitised offsets c'[0] = clamp(c[0], 0, total), c'[i] = clamp(c[i], c'[i-1], total) (the
running maximum of max(c, 0), capped at the ``total`` packed tokens); sequence i covers tokens
[c'[i], c'[i+1]) (an empty sequence's final state is its initial state, or 0), tokens no
sequence covers get y = 0 and zero gradients, and Status.CU_SEQLENS is reported when c[0] != 0
or c' != c.

Sequence ids (seq_idx [b, l] int32, mamba_ssm's convention; not with cu_seqlens): the batch rows
stay the sequences of initial_states and final_states, and within a row the state restarts at
every token whose id differs from the previous token's. A row's initial state enters only its
leading run of tokens, and only when their id is 0 (a row starting with another id starts from
zero); final_states[r] is the state after the row's last token. Valid ids are non-negative and
non-decreasing along a row, and for them this is mamba_ssm's rule exactly. Any values are
memory-safe (ids are compared, never used as addresses): the kernels apply the rule above to
whatever the ids hold and report Status.SEQ_IDX for a row that decreases or holds a negative id.

Strided operands: x, z, y, dy, dx, dz (rows of p elements), B, C, dB, dC (rows of n) and dt,
ddt (rows of h) take views whose last dimension is contiguous when a row is a whole number of
16-byte vectors (``row_vector``): their other strides are then any multiples of 16 bytes (slices
of the in-projection or conv output go in without a copy). Otherwise they are contiguous.

The dt transform, the dt_limit check and the checks of the per-token and per-head operands are
shared with the Mamba2 inference plans (fusedops.mamba2_inference.contract).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..core.cost import Cost
from ..core.dtypes import accumulator_dtype, element_size
from ..core.checks import expect_dtype, expect_shape, row_vector  # noqa: F401  (the plans' stride unit)
from ..core.desc import TensorDesc
from ..core.index_checks import check_cu_seqlens
from ..core.options import expect_float_range
from ..core.status import STATUS_DTYPE
from ..errors import ValidationError

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CHUNK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_CHUNK_SIZE = 256
SOFTPLUS_THRESHOLD = 20.0
"""softplus(u) = u for u > 20 (and its derivative 1), as torch.nn.functional.softplus."""
DEFAULT_DT_LIMIT = (0.0, math.inf)


# -- option validators ---------------------------------------------------------------------------
def expect_chunk_size(name: str, value) -> int:
    """One of CHUNK_SIZES, as an int (bool and float refused)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value not in CHUNK_SIZES:
        raise ValidationError(f"{name}: expected one of {CHUNK_SIZES}, got {value!r}")
    return int(value)


def expect_dt_limit(name: str, value) -> tuple[float, float]:
    """The dt clamp (lo, hi): two real numbers, neither NaN, lo <= hi (infinities allowed)."""
    return expect_float_range(name, value)


# -- operand checks shared by the scan and the inference plans -----------------------------------
def check_dt(descs: dict[str, TensorDesc], x: TensorDesc, shape: tuple[int, ...], layout: str) -> None:
    """dt: x's dtype, or fp32 for 16-bit x; ``shape`` (the tokens of x, per head)."""
    dt = descs["dt"]
    expect_dtype("dt", dt, (x.dtype,) if x.dtype in (torch.float32, torch.float64)
                 else (x.dtype, torch.float32))
    expect_shape("dt", dt, shape, layout)


def check_heads(descs: dict[str, TensorDesc], heads: int, head_dim: int,
                param_dtype: torch.dtype) -> None:
    """A [h] and the optional D ([h] or [h, p]) and dt_bias [h], all ``param_dtype``."""
    expect_dtype("A", descs["A"], (param_dtype,))
    expect_shape("A", descs["A"], (heads,), "[h]")
    if "D" in descs:
        D = descs["D"]
        expect_dtype("D", D, (param_dtype,))
        if tuple(D.shape) not in ((heads,), (heads, head_dim)):
            raise ValidationError(f"D: expected shape [h] = [{heads}] or [h, p] = [{heads}, "
                                  f"{head_dim}], got {list(D.shape)}")
    if "dt_bias" in descs:
        expect_dtype("dt_bias", descs["dt_bias"], (param_dtype,))
        expect_shape("dt_bias", descs["dt_bias"], (heads,), "[h]")


def check_gate(descs: dict[str, TensorDesc], x: TensorDesc, layout: str) -> None:
    """The optional z: x's dtype and shape."""
    if "z" in descs:
        expect_dtype("z", descs["z"], (x.dtype,))
        expect_shape("z", descs["z"], tuple(x.shape), layout)


def check_status(descs: dict[str, TensorDesc]) -> bool:
    """The optional status word: int32 [1] (fusedops.core.status). Returns whether it is given."""
    if "status" not in descs:
        return False
    expect_dtype("status", descs["status"], (STATUS_DTYPE,))
    expect_shape("status", descs["status"], (1,), "[1]")
    return True


def check_seq_idx(descs: dict[str, TensorDesc], batch: int, length: int, layout: str) -> bool:
    """The optional seq_idx: int32 [b, l] (``layout``), not with cu_seqlens. Returns whether it
    is given."""
    if "seq_idx" not in descs:
        return False
    expect_dtype("seq_idx", descs["seq_idx"], (torch.int32,))
    expect_shape("seq_idx", descs["seq_idx"], (batch, length), layout)
    if "cu_seqlens" in descs:
        raise ValidationError("seq_idx: expected None with cu_seqlens (the packed sequences are "
                              "already the boundaries), got a tensor")
    return True


def check_seq_idx_values(tensors) -> None:
    """Host check of seq_idx (check_inputs=True): non-negative and non-decreasing along every
    row."""
    ids = tensors.get("seq_idx")
    if not isinstance(ids, torch.Tensor):
        return
    rows = ids.detach().to("cpu", torch.int64).reshape(ids.shape[0], -1).tolist()
    for r, row in enumerate(rows):
        for t, value in enumerate(row):
            if value < 0:
                raise ValidationError(f"seq_idx: expected non-negative ids, got seq_idx[{r}, {t}] = "
                                      f"{value}")
            if t and value < row[t - 1]:
                raise ValidationError(f"seq_idx: expected ids non-decreasing along a row, got "
                                      f"seq_idx[{r}, {t}] = {value} < seq_idx[{r}, {t - 1}] = "
                                      f"{row[t - 1]}")


def check_cu_seqlens_values(tensors, total: int) -> None:
    """Host check of cu_seqlens (check_inputs=True): starts at 0, non-decreasing, ends at most at
    the ``total`` packed tokens."""
    cu = tensors.get("cu_seqlens")
    if isinstance(cu, torch.Tensor):
        check_cu_seqlens("cu_seqlens", cu, total)


# -- the problem ------------------------------------------------------------------------------------
def max_segments(batch: int, length: int, chunk: int, num_sequences: int | None) -> int:
    """Segments a problem can have: batch·ceil(l/Q) without cu_seqlens, else ceil(l/Q) + nseq
    (each sequence adds at most one partial segment)."""
    if num_sequences is None:
        return batch * math.ceil(length / chunk)
    return math.ceil(length / chunk) + num_sequences


@dataclass(frozen=True)
class ScanProblem:
    """The plan-time facts a backend needs (shared by the forward and backward plans)."""

    dtype: torch.dtype          # x, B, C, z, y, dy
    dt_dtype: torch.dtype
    batch: int
    length: int
    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int
    num_sequences: int | None   # None: the batch rows are the sequences; else len(cu_seqlens)-1
    has_D: bool
    D_per_channel: bool
    has_z: bool
    has_dt_bias: bool
    dt_softplus: bool
    dt_limit: tuple[float, float]
    has_initial_states: bool
    recompute_states: bool
    accumulate: bool
    has_dfinal_states: bool
    device: torch.device
    has_status: bool = False    # a status word is given: the kernels report CU_SEQLENS into it
    has_seq_idx: bool = False   # seq_idx [b, l]: the state restarts where the id changes
    has_segment_states: bool = False   # the forward also writes the state entering each segment
    state_dtype: torch.dtype | None = None   # the passed states' dtype; None: x's dtype

    def __post_init__(self) -> None:
        if self.state_dtype is None:
            object.__setattr__(self, "state_dtype", self.dtype)

    @property
    def vector(self) -> int:
        """Elements per stride unit of x, z, y, dy, dx, dz (``row_vector`` of p)."""
        return row_vector(self.head_dim, self.dtype)

    @property
    def bc_vector(self) -> int:
        """Elements per stride unit of B, C, dB, dC (``row_vector`` of n)."""
        return row_vector(self.state, self.dtype)

    @property
    def dt_vector(self) -> int:
        """Elements per stride unit of dt and ddt (``row_vector`` of h)."""
        return row_vector(self.heads, self.dt_dtype)

    @property
    def sequences(self) -> int:
        return self.batch if self.num_sequences is None else self.num_sequences

    @property
    def param_dtype(self) -> torch.dtype:
        return accumulator_dtype(self.dtype)

    @property
    def max_segments(self) -> int:
        """Segments (pieces of at most ``chunk`` tokens of one sequence) the problem can have."""
        return max_segments(self.batch, self.length, self.chunk, self.num_sequences)

    @property
    def states_bytes(self) -> int:
        """The state entering every segment in state_dtype: max_segments·h·p·n·e_state bytes."""
        return (self.max_segments * self.heads * self.head_dim * self.state
                * element_size(self.state_dtype))


# -- the floor: the least any implementation moves and computes (docs/mamba2_scan.md) ----------------
def segment_lengths(problem: ScanProblem) -> list[tuple[int, int]]:
    """(length, count) of the used segments: b rows of l tokens, or with cu_seqlens the l packed
    tokens split as evenly as possible over the nseq sequences (the plan cannot know the real
    split; the tuning inputs and the benchmarks use this one). Segments of a sequence are
    ``chunk`` long but the last."""
    Q = problem.chunk
    if problem.num_sequences is None:
        lengths = [(problem.length, problem.batch)]
    else:
        base, extra = divmod(problem.length, problem.num_sequences)
        lengths = [(base + 1, extra), (base, problem.num_sequences - extra)]
    out: dict[int, int] = {}
    for length, sequences in lengths:
        if sequences and length:
            full, rest = divmod(length, Q)
            if full:
                out[Q] = out.get(Q, 0) + full * sequences
            if rest:
                out[rest] = out.get(rest, 0) + sequences
    return sorted(out.items(), reverse=True)


def causal_pairs(problem: ScanProblem) -> int:
    """Pairs (i, j <= i) of tokens of one segment, over every segment: sum of L(L+1)/2."""
    return sum(count * length * (length + 1) // 2 for length, count in segment_lengths(problem))


def _operand_bytes(problem: ScanProblem) -> tuple[float, float, float]:
    """(bytes of x-sized, per-head-token, per-sequence-state) tensors."""
    T = problem.batch * problem.length
    e = element_size(problem.dtype)
    a = element_size(problem.param_dtype)
    return (T * problem.heads * problem.head_dim * e, T * problem.heads,
            problem.sequences * problem.heads * problem.head_dim * problem.state * a)


def _parameter_bytes(problem: ScanProblem) -> float:
    """A, and D and dt_bias where given."""
    a = element_size(problem.param_dtype)
    h, p = problem.heads, problem.head_dim
    D = (h * p if problem.D_per_channel else h) if problem.has_D else 0
    return a * (h + D + (h if problem.has_dt_bias else 0))


def forward_floor(problem: ScanProblem) -> Cost:
    """The least any forward does: read x, dt, B, C, A (and z, D, dt_bias, initial_states,
    cu_seqlens, seq_idx where given) once and write y and final_states once. What a forward saves for
    its backward (states, y before the gate) is an implementation's choice, not part of the
    floor. FLOPs: the chunked algorithm's products at this chunk size, on tensor cores: each
    segment's own state (2·T·h·p·n) and the entering state's term of y (2·T·h·p·n), the causal
    C·B of every pair j <= i per group (2·n) and its use per head (2·p); on the CUDA cores the dt
    transform, the pair decay weights (4 per pair and head), D and the gate."""
    T = problem.batch * problem.length
    h, g, p, n = problem.heads, problem.groups, problem.head_dim, problem.state
    e, edt = element_size(problem.dtype), element_size(problem.dt_dtype)
    xbytes, head_tokens, states = _operand_bytes(problem)
    read = (xbytes * (1 + problem.has_z) + head_tokens * edt + 2 * T * g * n * e
            + _parameter_bytes(problem) + (states if problem.has_initial_states else 0)
            + (4 * (problem.sequences + 1) if problem.num_sequences is not None else 0)
            + 4 * T * problem.has_seq_idx)
    written = xbytes + states
    pairs = causal_pairs(problem)
    mma = 4 * T * h * p * n + pairs * (2 * h * p + 2 * g * n)
    cuda = (head_tokens * (4 + problem.has_dt_bias + 6 * problem.dt_softplus) + 4 * pairs * h
            + T * h * p * (2 * problem.has_D + 5 * problem.has_z))
    return Cost(mma + cuda, read, written, mma)


def backward_floor(problem: ScanProblem) -> Cost:
    """The least any backward does: read the forward's inputs, dy (and dfinal_states) once,
    write every gradient once (and read dA, dD, ddt_bias when accumulating). FLOPs: the
    backward's products without recomputation: dx (the end-state term 2·T·h·p·n and the causal
    pairs, 2·p per pair and head), d(C·B) = dy·x (2·p per pair and head), dB and dC (each the
    causal pairs, 2·n per pair and group, and a state term, 2·T·h·p·n) and the state gradient
    dy·C (2·T·h·p·n). Recomputing the states and C·B (a backward that was saved nothing) would
    add 2·T·h·p·n + 2·n per pair and group; like the forward's saved states it is not counted,
    so the two floors together bound either choice from below."""
    T = problem.batch * problem.length
    h, g, p, n = problem.heads, problem.groups, problem.head_dim, problem.state
    e, edt = element_size(problem.dtype), element_size(problem.dt_dtype)
    xbytes, head_tokens, states = _operand_bytes(problem)
    params = _parameter_bytes(problem)
    bc = 2 * T * g * n * e
    read = (xbytes * (2 + problem.has_z) + head_tokens * edt + bc + params
            + states * (problem.has_initial_states + problem.has_dfinal_states)
            + (4 * (problem.sequences + 1) if problem.num_sequences is not None else 0)
            + 4 * T * problem.has_seq_idx + (params if problem.accumulate else 0))
    written = (xbytes * (1 + problem.has_z) + head_tokens * edt + bc + params
               + (states if problem.has_initial_states else 0))
    pairs = causal_pairs(problem)
    mma = 8 * T * h * p * n + pairs * (4 * h * p + 4 * g * n)
    cuda = (head_tokens * (10 + 6 * problem.dt_softplus) + 8 * pairs * h
            + T * h * p * (2 * problem.has_D + 10 * problem.has_z))
    return Cost(mma + cuda, read, written, mma)
