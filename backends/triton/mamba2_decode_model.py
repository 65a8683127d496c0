"""The cost model of the Mamba2 inference kernels (backends/triton/mamba2_inference.py): the
state update and the rollback, counted in waves as backends/triton/wave_model.py does
(docs/mamba2_inference.md, "Performance model")."""

from __future__ import annotations

import triton

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.target import target_arch
from fusedops.mamba2_inference.contract import UPDATE_FLOPS_PER_ELEMENT

from .wave_model import Waves, every_program, key, machine, per_arch


# CTAs per SM of the update at the block table's entry, per (rounding, snapshots, state bytes),
# and of the rollback, as ``fusedops kernels --backend triton --only decode`` / ``--only
# rollback`` report them (triton 3.9, 2026-12-01, h128 p64 n128; registers decide every one).
UPDATE_CTAS_PER_SM = {
    ("nearest", False, 4): {"sm_80": 6, "sm_90": 5, "sm_100": 6},
    ("nearest", False, 2): {"sm_80": 6, "sm_90": 5, "sm_100": 6},
    ("nearest", True, 4): {"sm_80": 4, "sm_90": 4, "sm_100": 5},
    ("nearest", True, 2): {"sm_80": 5, "sm_90": 5, "sm_100": 5},
    ("stochastic", False, 2): {"sm_80": 4, "sm_90": 4, "sm_100": 4},
    ("stochastic", True, 2): {"sm_80": 4, "sm_90": 4, "sm_100": 4},
}
ROLLBACK_CTAS_PER_SM = {"sm_80": 16, "sm_90": 16, "sm_100": 16}


def _decode_entry(problem):
    from .mamba2_inference import TILES as DECODE_TILES   # the inference module imports this one
    return DECODE_TILES[target_arch(problem.device)][0]


def update_ctas_per_sm(problem, bp: int, arch: str) -> int:
    """CTAs per SM of the update: the reported occupancy when ``bp`` is the table entry's rows
    (a variant the table does not list: its fewest for the arch); another block (an autotune
    candidate, a ``config=``) at one CTA per SM."""
    entry = _decode_entry(problem)
    rows = entry.BP_STOCHASTIC if problem.stochastic else entry.BP
    if bp != max(1, min(rows, triton.next_power_of_2(problem.head_dim))):
        return 1
    key = ("stochastic" if problem.stochastic else "nearest", problem.has_snapshots,
           element_size(problem.state_dtype))
    if key in UPDATE_CTAS_PER_SM:
        return UPDATE_CTAS_PER_SM[key][arch]
    return min(v[arch] for v in UPDATE_CTAS_PER_SM.values())


@per_arch
def update_cost(problem, bp: int) -> Cost:
    """The state update, every row valid. Order: grid (b, h, NPB), the row fastest, the
    head-dim block slowest: a wave (132 × 5 = 660 programs on sm_90 with nearest rounding, 132
    × 4 with snapshots of an fp32 state and with stochastic rounding; 148 × 4–6 on sm_100, 108 ×
    4–6 on sm_80) holds the b = 256 rows of 2–3 heads of one head-dim block; the 16 heads of a
    group run over 16·b = 4096 programs (6 waves), the NPB head-dim blocks of a head h·b
    programs apart. Reuse: the group's B and C rows of a row's T tokens (T·n·e each) are shared
    by the heads of the group in a wave: counted once per (wave, row, group), about (h·b/wave +
    g)/g = 7 times per head-dim block instead of R = 16 (b = 256, sm_90), and again by each of
    the NPB blocks (27x the floor's B and C at T = 1 with nearest rounding, 66x stochastic); the
    dt scalars (T per row and head) once per block; the slot index (4 bytes) and the seeds and
    offsets (16) once per row and wave. Alone: each program's [BP, n] state tile read and
    written once (and written as every snapshot), its x (and z) rows read and y written once.
    Every wave fits (at most 32 MB on sm_90, 44 on sm_100: T = 4 with fp32 snapshots). A, D,
    dt_bias count once. FLOPs: 5 per state element and token over the padded tile, the dt
    transform, D and the gate."""
    b, T, h, p, n = problem.batch, problem.tokens, problem.heads, problem.head_dim, problem.state
    g = problem.groups
    e, edt = element_size(problem.dtype), element_size(problem.dt_dtype)
    eb, se = element_size(problem.b_dtype), element_size(problem.state_dtype)
    npb, bn = triton.cdiv(p, bp), triton.next_power_of_2(n)
    arch = target_arch(problem.device)
    box = machine(arch)
    w = Waves((b, h, npb), box.sms * update_ctas_per_sm(problem, bp, arch), box.l2_bytes)
    row, head, ip = w.coords
    every = every_program(w)
    rows = (p - ip * bp).clamp(max=bp)
    w.load("dt", every, key((row, b), (head, h)), T * edt)
    w.load("B and C", every, key((row, b), (head // (h // g), g)), 2 * T * n * eb)
    if problem.has_indices:
        w.load("slot", every, row, 4)
    if problem.stochastic:
        w.load("seed, offset", every, row, 16)
    w.alone(every, rows * n * se + T * rows * e * (1 + problem.has_z))
    w.store(every, rows * n * se * (1 + (T + 1) * problem.has_snapshots) + T * rows * e)
    read, written, _, _ = w.count()
    params = 4 * (h + (h * p if problem.D_per_channel else h) * problem.has_D
                  + h * problem.has_dt_bias)
    flops = (UPDATE_FLOPS_PER_ELEMENT * b * T * h * npb * bp * bn + b * T * h * npb * 12
             + b * T * h * p * (2 * problem.has_D + 5 * problem.has_z))
    return Cost(flops, read + params, written)


@per_arch
def rollback_cost(problem, block: int) -> Cost:
    """The rollback, every row valid. Order: grid (b, tiles), the row fastest: a wave (132 × 16
    = 2112 programs on sm_90) holds every row's programs of about 8 tiles. Reuse: a row's
    accepted count and slot (4 bytes each) are shared by its tiles' programs: once per (wave,
    row). Alone: one snapshot tile read, the slot's tile written. Every wave fits (35 MB on
    sm_90, 28 of 40 on sm_80)."""
    se = element_size(problem.state_dtype)
    b, numel = problem.batch, problem.state_numel
    arch = target_arch(problem.device)
    box = machine(arch)
    entry = _decode_entry(problem)
    ctas = (ROLLBACK_CTAS_PER_SM[arch]
            if block == min(entry.ROLLBACK_BLOCK, triton.next_power_of_2(numel)) else 1)
    w = Waves((b, triton.cdiv(numel, block)), box.sms * ctas, box.l2_bytes)
    row, tile = w.coords
    every = every_program(w)
    width = (numel - tile * block).clamp(max=block)
    w.load("accepted", every, row, 4)
    if problem.has_indices:
        w.load("slot", every, row, 4)
    w.alone(every, width * se)
    w.store(every, width * se)
    read, written, _, _ = w.count()
    return Cost(0, read, written)
