"""The kernel report (``fusedops kernels``) as CI's yardstick until a GPU measures: every kernel of
every plan at the production shapes compiles for its targets, and the design rules hold from the
compiled code; every kernel of every registry sample compiles for every target as well. A rule
today's kernels break is marked xfail(strict=True) with the reason: when a kernel change fixes
it, the test turns red and the mark must come off."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fusedops.registry import FAMILIES

from helpers import compile_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("triton")

# Modelled HBM traffic of a plan over its floor (fusedops.core.cost; docs/performance.md keeps
# the same table): the bound each family's kernels must stay within, tightened as kernels land.
TRAFFIC_BOUNDS = {
    # the gate backward: its grad_weight partial rows (the re-reads of v and g by the S + 1
    # programs of a token block come from L2, a few programs apart)
    "EngramGateSavedForward": 1.00,
    "EngramGateSavedBackward": 1.02,
    # MoE: the per-assignment rows between the routed down (dgrad-up) GEMM and the sum over
    # the k experts, x and d_out gathered once per expert of a token, the shared expert's
    # weights re-read by its row groups
    "MoERouter": 1.00,
    "MoERouterBackward": 1.30,
    "ReLU2MoEForward": 1.46,
    ("ReLU2MoEForward", "moe nano t64"): 1.01,
    ("ReLU2MoEForward", "moe super t8192"): 1.32,
    "ReLU2MoEBackward": 1.25,
    ("ReLU2MoEBackward", "moe super t8192"): 1.22,
    # attention (reuse distance, 2026-12-02): the forward and dq re-read a key block's k and v
    # when the next query head of its KV group first visits it more than G programs after the
    # previous head did (causal: the late key blocks; G = 22 at d = 128 on sm_90, 11 at
    # d = 256); the backward reads q, do, lse and delta in both dk/dv and dq and o, do in the
    # delta kernel; the dk/dv programs of hkv2 d128 each load 16 heads' q, do, lse and delta
    # over all 4096 rows (34 MB), more than Hopper's usable 25 MB (G = 0.7): every program's
    # rows count (1.75 on sm_100); decode: the fp32 split partials (rows padded to bm) written
    # and read back by the combine, each split re-reading its q rows (b·h_kv programs apart)
    "GQAAttentionForward": 1.21,
    ("GQAAttentionForward", "attn hkv8 d256 causal"): 1.42,
    "GQAAttentionBackward": 1.92,
    ("GQAAttentionBackward", "attn hkv2 d128"): 16.51,
    "GQAAttentionDecode": 1.16,
    # Mamba2: C·B and the passed states written and read back; the backward's gradients of
    # the segment states (x's dtype) and C·B (fp32) passed between kernels, dy and x read by
    # the state walk, dx and the dB/dC kernel, which run a (segment, group)'s or (segment,
    # head)'s programs side by side (2026-12-02: dB/dC, d(C·B), C·B; dH1 stored in x's dtype,
    # 4.69x to 4.16x at Q128; the gate in the state walk: 3.98x; the straddling pairs in the
    # d(C·B) kernel, 2026-12-05: 3.621x; and C·B: 3.587x; dB and dC forming the d(C·B) tiles in
    # one launch: 3.00x at Q128, 3.01x at p80; C·B's diagonal tiles stored and read as their
    # lower halves: 2.98x and 2.99x, forward 1.79x at Q128; the <dH1, H0> partials in dB/dC,
    # not the walk: 2.81x both; dx's programs in the dB/dC launch: 2.28x and 2.27x);
    # decode: dt, B and C re-read by each head-dim block (h·b programs apart); the forward
    # walk (2026-12-05: states and output in one kernel, 2.45x to 1.83x at Q128) writes the
    # bf16 entering states and y before the gate for the backward and reads C·B back
    "Mamba2ChunkScanForward": 1.80,
    "Mamba2ChunkScanBackward": 2.29,
    # without z the floor loses z, dz and y before the gate while the passes between kernels
    # (dH1, C·B, the partials) and the re-reads of dy and x stay
    ("Mamba2ChunkScanBackward", "scan nemotron-h 8K"): 2.18,
    "Mamba2StateUpdate": 1.01,
    "Mamba2StateRollback": 1.00,
}
ARCHS = ("sm_80", "sm_90a", "sm_100a")      # every target `fusedops kernels` compiles for
# the targets of each kernel backend (the CuTe DSL kernels: Hopper and Blackwell only)
TARGETS = {"triton": ARCHS, "cute": ("sm_90a", "sm_100a")}
# The rules on what the kernels compute and move (no duplicated tensor-core work, traffic within
# its bound of the floor) hold for the sm_90 and sm_100 tables; sm_80's kernels are held to
# compiling without spills: its d = 256 attention forward lays its mma.sync warps along P·V's
# 256 columns (S computed 1.5 times) and its 40 MB L2 models more re-reads (docs/gqa_attention.md)
DESIGN_ARCHS = ("sm_90a", "sm_100a")

# (rule, family) pairs today's kernels break, and why.
KNOWN = {
    ("wgmma_async", "mamba2_scan"):
        "the backward state walk waits for each product: it forms both of its operands in "
        "registers (dy·silu(z) and the decay-weighted C; weighting dy·silu(z) instead spills "
        "at the 128 registers its 4 CTAs per SM need) (the forward walk weighs x, its register "
        "operand, and is asynchronous since 2026-12-04; the dB/dC launch keeps dx's products "
        "in flight at two stages since dx joined it, 2026-12-05, while dB/dC's own weigh each "
        "head's dy·xᵀ tile before the next)",
}


@pytest.fixture(scope="module")
def report():
    proc = subprocess.run([sys.executable, "-m", "fusedops", "kernels", "--json", "--arch", *ARCHS],
                          cwd=ROOT, env=compile_env(), capture_output=True, text=True,
                          timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kernels = [r for r in lines if r["kind"] == "kernel"]
    plans = [r for r in lines if r["kind"] == "plan"]
    skipped = [r for r in lines if r["kind"] == "unsupported"]
    assert kernels and plans, "the report compiled nothing"
    return kernels, plans, skipped


def _rule_params(rule):
    out = []
    for info in FAMILIES:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN[(rule, info.name)])] \
            if (rule, info.name) in KNOWN else []
        out.append(pytest.param(info.name, id=info.name, marks=marks))
    return out


def _rows(report, family):
    return [r for r in report[0] if r["family"] == family]


def test_every_kernel_compiles_for_every_target(report, aot_figures):
    """Every plan's kernels compile for each target of its backend (TARGETS), or the backend
    states why they cannot. The report compiles every kernel of a plan's program for an arch or
    fails, so a plan's rows on a target are all its kernels there; the programs may differ by
    arch (sm_80's MoE backward runs the shared expert's two weight gradients as two launches)."""
    seen = {}
    for r in report[0]:
        seen.setdefault((r["backend"], r["label"], r["plan"]), set()).add(r["arch"])
        aot_figures.append(f"{r['backend']:<6} {r['label'][:32]:<32} {r['kernel'][:32]:<32} {r['arch']:<7} "
                           f"regs {r['registers']:>3}  spill {r['spill_bytes']:>4} B  smem "
                           f"{r['shared_bytes']:>6} B  CTA/SM {r['ctas_per_sm']:>2}  mma {r['mma']}")
    excused = {(u["backend"], u["label"], u["plan"], u["arch"]) for u in report[2]}
    missing = {k: sorted(a for a in set(TARGETS[k[0]]) - archs if (*k, a) not in excused)
               for k, archs in seen.items()}
    assert not any(missing.values()), {k: v for k, v in missing.items() if v}
    assert {f["family"] for f in report[0]} == {info.name for info in FAMILIES if any(
        b in ("triton", "cute") for b in info.backends)}


@pytest.mark.parametrize("family", _rule_params("no_spills"))
def test_no_spills(report, family):
    spilling = [f"{r['backend']} {r['label']} {r['kernel']} {r['arch']}: {r['spill_bytes']} B"
                for r in _rows(report, family) if r["spill_bytes"]]
    assert not spilling, spilling


@pytest.mark.parametrize("family", _rule_params("wgmma_only"))
def test_tensor_core_kernels_use_wgmma_only_on_sm90(report, family):
    """On sm_90a every tensor-core product is a warpgroup MMA (HGMMA), none mma.sync (HMMA)."""
    offenders = [f"{r['label']} {r['kernel']}: {r['mma']}" for r in _rows(report, family)
                 if r["arch"] == "sm_90a" and r["mma"].get("mma.sync")]
    assert not offenders, offenders


@pytest.mark.parametrize("family", _rule_params("wgmma_async"))
def test_wgmma_kernels_keep_a_product_in_flight(report, family):
    """On sm_90a every warpgroup-MMA kernel overlaps its products with other work: some wait
    leaves a wgmma group in flight (the tensor cores overlap the next tiles' loads), or the
    warpgroup issues floating-point math between a product's issue and its wait (the softmax of
    one block under the tensor cores' P·V of the previous one); ``compiled.wgmma_overlap``."""
    offenders = [f"{r['label']} {r['kernel']}" for r in _rows(report, family)
                 if r["arch"] == "sm_90a" and r.get("wgmma_async") is False]
    assert not offenders, offenders


def test_wgmma_waits_are_read_from_the_sass():
    from fusedops.kernel_report.compiled import wgmma_in_flight, wgmma_overlap
    sync = "        /*10b0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;    /* 0x000080 */\n"
    overlapped = sync.replace("gsb0, 0x0", "gsb0, 0x1")
    assert wgmma_in_flight("") == 0 and wgmma_in_flight(sync) == 0
    assert wgmma_in_flight(sync + overlapped) == 1

    def line(text):
        return f"        /*0000*/                   {text} ;    /* 0x000000 */\n"
    issue = line("WARPGROUP.ARRIVE") + line("HGMMA.64x64x16.F32.BF16 R24, R128, gdesc[UR4], RZ, !UPT, gsb0")
    math = line("MUFU.EX2 R140, R140") + line("@P0 FADD R2, R3, R4") + line("IMAD R5, R6, R7, RZ")
    # math after the wait overlaps nothing; math between the issue and the wait does (the
    # integer IMAD is not counted)
    assert wgmma_overlap(issue + sync + math * 4) == 0
    assert wgmma_overlap(issue + math * 4 + sync + math) == 8


@pytest.mark.parametrize("family", _rule_params("no_duplication"))
def test_no_warpgroup_duplicates_another(report, family):
    """No warp or warpgroup computes a tensor-core product another also computes (the kernel's
    model states its duplication factor from its warp layout: a wgmma covers 64 rows, so a
    64-row score tile on two warpgroups is computed twice); on DESIGN_ARCHS."""
    offenders = [f"{r['label']} {r['kernel']} {r['arch']}: {r['mma_duplication']:.2f}x"
                 for r in _rows(report, family)
                 if r["arch"] in DESIGN_ARCHS and r.get("mma_duplication", 1.0) > 1.0]
    assert not offenders, offenders


@pytest.mark.parametrize("family", _rule_params("modelled"))
def test_every_kernel_and_plan_is_modelled(report, family):
    """Every kernel carries a FLOP/byte model and every plan a floor (fusedops.core.cost)."""
    unmodelled = sorted({f"{r['kernel']}" for r in _rows(report, family) if "flops" not in r})
    floorless = sorted({p["plan"] for p in report[1] if p["family"] == family and "floor" not in p})
    assert not unmodelled and not floorless, (unmodelled, floorless)


@pytest.mark.parametrize("family", _rule_params("traffic_bound"))
def test_modelled_traffic_within_bound_of_floor(report, family):
    """Each plan's modelled traffic over its floor within TRAFFIC_BOUNDS, on DESIGN_ARCHS."""
    over, unbounded = [], set()
    for p in report[1]:
        if p["family"] != family or p["traffic_ratio"] is None or p["arch"] not in DESIGN_ARCHS:
            continue
        bound = TRAFFIC_BOUNDS.get((p["plan"], p["label"]), TRAFFIC_BOUNDS.get(p["plan"]))
        if bound is None:
            unbounded.add(p["plan"])
        elif p["traffic_ratio"] > bound:
            over.append(f"{p['label']} {p['plan']} on {p['backend']}: {p['traffic_ratio']:.2f} x floor "
                        f"(bound {bound})")
    assert not unbounded, f"set a traffic bound for {sorted(unbounded)}"
    assert not over, over


def test_performance_page_states_the_traffic_bounds():
    """docs/performance.md's table of traffic bounds is TRAFFIC_BOUNDS, row for row."""
    text = open(os.path.join(ROOT, "docs", "performance.md")).read()
    block = re.search(r"<!-- traffic bounds -->\n(.*?)<!-- end traffic bounds -->", text, re.S)
    assert block, "docs/performance.md lacks the traffic bounds markers"
    rows = {}
    for line in block.group(1).splitlines()[2:]:
        plan, shape, bound = (cell.strip(" `") for cell in line.strip("|").split("|"))
        rows[plan if shape == "the other production shapes" else (plan, shape)] = float(bound)
    assert rows == TRAFFIC_BOUNDS


def test_performance_page_shows_the_current_report(report):
    """docs/performance.md's tables (per kernel, and per plan against the floor) are current."""
    from fusedops.kernel_report.markdown import kernel_table, model_table
    text = open(os.path.join(ROOT, "docs", "performance.md")).read()
    for name, expected in (("model table", model_table(report[1])),
                           ("kernel table", kernel_table(report[0]))):
        block = re.search(rf"<!-- {name} -->\n(.*?)<!-- end {name} -->", text, re.S)
        assert block, f"docs/performance.md lacks the {name} markers"
        assert block.group(1) == expected, \
            f"docs/performance.md's {name} is stale: python -m fusedops kernels --markdown"


@pytest.mark.matrix
def test_every_registry_sample_compiles_for_every_target():
    """``fusedops kernels --samples``: every kernel of every plan of every registry sample (each
    family's ``sample_kinds`` in each of its ``sample_dtypes``) and of the production shapes
    compiles for every target with that target's tile table (Triton: sm_80, sm_90a, sm_100a;
    CuTe: sm_90a, sm_100a), or its backend states why it cannot; a failure names the family,
    the sample, the plan, the kernel and the arch. It runs in a subprocess with the report's
    environment (``compile_env``) after the report in this file, so Triton's on-disk cache
    already holds the production specialisations the report compiled and serves them without
    compiling again; an identical specialisation of several samples compiles once per target.
    One of the long matrices (``-m matrix``): 2,520 builds, 33 minutes on two cores cold."""
    proc = subprocess.run([sys.executable, "-m", "fusedops", "kernels", "--samples", "--json"],
                          cwd=ROOT, env=compile_env(), capture_output=True, text=True,
                          timeout=5400)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    failed = [f"{r['family']} | {r['label']} | {r['plan']} | {r['kernel']} | {r['arch']}: "
              f"{r['error'].strip().splitlines()[-1]}" for r in lines if r["kind"] == "failed"]
    assert not failed, "\n".join(failed)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = next(r for r in lines if r["kind"] == "samples")
    assert summary["archs"] == ["sm_100a", "sm_80", "sm_90a"]
    kinds = {f: v["kinds"] for f, v in summary["families"].items()}
    assert kinds == {info.name: sorted({*info.sample_kinds, "production"}) for info in FAMILIES
                     if any(b in ("triton", "cute") for b in info.backends)}
