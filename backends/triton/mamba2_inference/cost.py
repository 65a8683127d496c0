"""The cost model of the Mamba2 inference kernels (backends/triton/mamba2_inference/program.py): the
state update and the rollback, their re-reads counted by reuse distance
(backends/triton/l2_reuse.py; docs/mamba2_inference.md, "Performance model")."""

from __future__ import annotations

import triton

from fusedops.core.cost import Cost
from fusedops.core.dtypes import element_size
from fusedops.core.machines import machine
from fusedops.core.target import target_arch
from fusedops.mamba2_inference.contract import UPDATE_FLOPS_PER_ELEMENT

from ..l2_reuse import Programs, every_program, key, per_arch


@per_arch
def update_cost(problem, bp: int) -> Cost:
    """The state update, every row valid. Order: grid (b, h, NPB), the row fastest, the
    head-dim block slowest: the R heads of a group follow one another b programs apart, the NPB
    head-dim blocks of a head h·b programs apart. Reuse: the group's B and C rows of a row's T
    tokens (T·n·e each) are shared by the heads of the group, the dt scalars (T per row and
    head) and B and C by the NPB blocks; the slot index (4 bytes) and the seeds and offsets (16)
    by every program of the row. A program moves 5-60 KB at the production shapes (its [BP, n]
    state tile read and written, and written as every snapshot, with its x, z and y rows):
    G = 0.5 · L2 / that is 418-5,344 on sm_90 (b = 256, h = 128: b <= G < h·b), so B and C
    count once per head-dim block (NPB = 4 times the floor's with nearest rounding, 8
    stochastic), dt NPB times, the slot and seeds once. Alone: each program's state tile read
    and written once (and written as every snapshot), its x (and z) rows read and y written
    once. A, D, dt_bias count once. FLOPs: 5 per state element and token over the padded tile,
    the dt transform, D and the gate."""
    b, T, h, p, n = problem.batch, problem.tokens, problem.heads, problem.head_dim, problem.state
    g = problem.groups
    e, edt = element_size(problem.dtype), element_size(problem.dt_dtype)
    eb, se = element_size(problem.b_dtype), element_size(problem.state_dtype)
    npb, bn = triton.cdiv(p, bp), triton.next_power_of_2(n)
    w = Programs((b, h, npb), machine(target_arch(problem.device)).l2_bytes)
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
    read, written = w.count()
    params = 4 * (h + (h * p if problem.D_per_channel else h) * problem.has_D
                  + h * problem.has_dt_bias)
    flops = (UPDATE_FLOPS_PER_ELEMENT * b * T * h * npb * bp * bn + b * T * h * npb * 12
             + b * T * h * p * (2 * problem.has_D + 5 * problem.has_z))
    return Cost(flops, read + params, written)


@per_arch
def rollback_cost(problem, block: int) -> Cost:
    """The rollback, every row valid. Order: grid (b, tiles), the row fastest. Reuse: a row's
    accepted count and slot (4 bytes each) are shared by its tiles' programs, b programs apart;
    a program moves one snapshot tile read and the slot's tile written (16 KiB at 4096 fp16
    values): G = 1,525 on sm_90 >= b = 256, so they count once per row."""
    se = element_size(problem.state_dtype)
    b, numel = problem.batch, problem.state_numel
    w = Programs((b, triton.cdiv(numel, block)), machine(target_arch(problem.device)).l2_bytes)
    row, tile = w.coords
    every = every_program(w)
    width = (numel - tile * block).clamp(max=block)
    w.load("accepted", every, row, 4)
    if problem.has_indices:
        w.load("slot", every, row, 4)
    w.alone(every, width * se)
    w.store(every, width * se)
    read, written = w.count()
    return Cost(0, read, written)
