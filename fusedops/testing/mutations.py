"""Mutations of compiled kernels that the PTX emulator must catch: each breaks one
synchronisation or asynchronous-copy contract in a real kernel's PTX (a wait that leaves
results in flight, a removed barrier, a tensor map written to the wrong place, a wrong
transaction count, a buffer reused too early) and is run on the family case whose unmutated
kernel passes its oracle. Caught means the run raised an emulator fault or missed the oracle.

Run it in a process of its own (the kernels are compiled)::

    FUSEDOPS_EMULATE=1 python -m fusedops.testing.mutations [--name NAME] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from ..backends.ptx_emulator import Options, PtxProgram, using
from ..core.cache import cache_clear
from ..plan.cache import EAGER_PLANS
from .emulated import run_cases


@dataclass(frozen=True)
class Mutation:
    """``pattern`` replaced by ``replacement`` (``re.sub`` syntax) in kernel ``kernel``'s PTX,
    at match ``occurrence`` (None: every match), run on case ``case`` of ``kind`` of
    ``family`` compiled for ``arch`` under ``schedule``; ``expect``: what catches it, for the
    record (any fault or oracle miss counts)."""

    name: str
    family: str
    arch: str
    kind: str
    case: int
    kernel: str
    pattern: str
    replacement: str
    occurrence: int | None
    expect: str
    schedule: str = "lockstep"


MUTATIONS = (
    Mutation(
        "a wgmma.wait_group with too high a count",
        "relu2_moe",
        "sm_90a",
        "small",
        1,
        "moe_gemm_kernel",
        r"wgmma\.wait_group\.sync\.aligned\s+0;",
        "wgmma.wait_group.sync.aligned 1;",
        None,
        "DataRace: an accumulator read in flight",
    ),
    Mutation(
        "a removed bar.sync under the skewed schedule",
        "relu2_moe",
        "sm_90a",
        "small",
        3,
        "moe_router_fwd_kernel",
        r"bar\.sync\s+0;",
        "",
        0,
        "DataRace: a warp reads another's shared-memory write with no barrier between",
        schedule="skewed",
    ),
    Mutation(
        "a tensor map written to the wrong global-scratch offset",
        "gqa_attention",
        "sm_90a",
        "small",
        0,
        "attn_fwd_kernel",
        r"(tensormap\.cp_fenceproxy[^\[]*\[ %rd\d+ \+ )0( \])",
        r"\g<1>128\g<2>",
        0,
        "PtxFault: the copy reads a slot no tensormap.replace built",
    ),
    Mutation(
        "an mbarrier expecting the wrong byte count",
        "gqa_attention",
        "sm_90a",
        "small",
        0,
        "attn_fwd_kernel",
        r"(mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%r\d+\], )512;",
        r"\g<1>256;",
        None,
        "Deadlock: the phase's transaction count never reaches zero",
    ),
    Mutation(
        "a buffer stage reused one iteration early",
        "relu2_moe",
        "sm_80",
        "small",
        1,
        "moe_wgrad_kernel",
        r"bar\.sync\s+0;(?=(?:(?!bar\.sync|ldmatrix|ld\.shared)[\s\S]){0,600}?cp\.async\.cg\.)",
        "",
        None,
        "DataRace: a refill overwrites a stage other warps still read",
    ),
)


@dataclass
class MutationResult:
    name: str
    applied: int  # matches replaced
    caught: bool
    how: str


@contextlib.contextmanager
def mutated(mutation: Mutation, applied: list[int]) -> Iterator[None]:
    """Within the block, the PTX of ``mutation.kernel`` is mutated as it is parsed (the count
    of replacements appended to ``applied``)."""
    original = PtxProgram.parse.__func__
    cache_clear()  # compiled programs and the plans holding their launchers
    EAGER_PLANS.clear()
    entry = re.compile(rf"\.entry\s+{re.escape(mutation.kernel)}\s*\(")
    pattern = re.compile(mutation.pattern)

    def parse(cls, ptx: str, entry_name: str | None = None):
        if entry.search(ptx):
            count = 0

            def replace(match):
                nonlocal count
                count += 1
                hit = mutation.occurrence is None or count - 1 == mutation.occurrence
                return match.expand(mutation.replacement) if hit else match.group(0)

            ptx = pattern.sub(replace, ptx)
            applied.append(
                count if mutation.occurrence is None else int(count > mutation.occurrence)
            )
        return original(cls, ptx, entry_name)

    PtxProgram.parse = classmethod(parse)
    try:
        yield
    finally:
        PtxProgram.parse = classmethod(original)
        cache_clear()
        EAGER_PLANS.clear()


def run_mutation(mutation: Mutation) -> MutationResult:
    """Runs ``mutation``'s case with the mutated kernel; caught if it faults or misses the
    oracle."""
    applied: list[int] = []
    with mutated(mutation, applied), using(Options(schedule=mutation.schedule, race_check=True)):
        [result] = run_cases(mutation.family, mutation.arch, (mutation.kind,), only={mutation.case})
    how = result.error or "; ".join(result.failures) or "passed"
    return MutationResult(mutation.name, sum(applied), not result.ok, how[:2000])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fusedops.testing.mutations", description=__doc__)
    p.add_argument("--name", action="append", help="substring of the mutations to run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    status = 0
    for mutation in MUTATIONS:
        if args.name and not any(n in mutation.name for n in args.name):
            continue
        result = run_mutation(mutation)
        status |= not (result.applied and result.caught)
        if args.json:
            print(json.dumps(asdict(result)), flush=True)
        else:
            verdict = "caught" if result.caught else "MISSED"
            print(
                f"{verdict:<7} {result.name} ({result.applied} replaced): {result.how}", flush=True
            )
    return status


if __name__ == "__main__":
    sys.exit(main())
