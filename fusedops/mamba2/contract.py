"""The Mamba2 chunked scan's contract: its problem, constants and math (docs/mamba2.md).

Per batch row (or per sequence of a packed batch, through cu_seqlens) and head h, with groups of
B/C shared by h / g heads:

    dt_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, *dt_limit)
    h_t  = exp(dt_t · A) h_{t-1} + dt_t x_t ⊗ B_t             state [p, n], fp32
    y_t  = h_t C_t + D x_t,  then y_t · silu(z_t) when z is given

softplus(u) = u above SOFTPLUS_THRESHOLD (derivative 1), else log(1 + exp(u)) (derivative
sigmoid(u)); the clamp passes the gradient at its bounds. The scan is computed per *segment*
(at most chunk_size tokens of one sequence); a sequence of length L has ceil(L / chunk_size).

The dt transform, the dt_limit check and the checks of the per-token and per-head operands are
shared with the Mamba2 inference plans (fusedops.mamba2_inference.contract).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..core.dtypes import accumulator_dtype

from ..core.checks import expect_dtype, expect_shape
from ..core.desc import TensorDesc
from ..core.options import expect_float_range
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
        """fp32 state at the start of every segment: max_segments·h·p·n·4 bytes."""
        return self.max_segments * self.heads * self.head_dim * self.state * 4
