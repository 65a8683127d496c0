"""The kernel report as the markdown tables of docs/performance.md (from the report's JSON rows,
so the test that keeps the page current compares what one report run produced)."""

from __future__ import annotations


def mma_text(row: dict, sep: str = " ") -> str:
    """A kernel's tensor-core instructions by kind ("wgmma 4 async, mma.sync 32"): a wgmma kernel
    says whether its products overlap other work (async: a wait leaves a group in flight, or
    float math issues under one, ``compiled.Compiled.wgmma_async``) or not (sync); "-" without
    MMA."""
    def one(kind, n):
        mode = {True: " async", False: " sync"}.get(row.get("wgmma_async")) if kind == "wgmma" else ""
        return f"{kind}{sep}{n}{mode or ''}"
    return ", ".join(one(k, n) for k, n in sorted(row["mma"].items())) or "-"


def _gb(x) -> str:
    return f"{x / 1e9:.3f}"


def _gflop(cost) -> str:
    return f"{cost['flops'] / 1e9:.1f}" if cost else "-"


def model_table(plans: list[dict]) -> str:
    """Per plan and backend on sm_90a: modelled HBM traffic and FLOPs against the floor, and the
    roofline times on the modelled Hopper GPUs."""
    lines = ["| shape | plan | backend | modelled GB | floor GB | traffic / floor | GFLOP (floor) "
             "| H200 µs modelled / floor |", "|---|---|---|---|---|---|---|---|"]
    for p in plans:
        if p["arch"] != "sm_90a":
            continue
        m, f = p.get("modelled"), p.get("floor")
        ratio = "-" if p["traffic_ratio"] is None else f"{p['traffic_ratio']:.2f}"
        h200 = f"{m['floor_us']['H200 SXM']:.1f} / {f['floor_us']['H200 SXM']:.1f}" if m and f else "-"
        lines.append(f"| {p['label']} | {p['plan']} | {p['backend']} | {_gb(m['bytes']) if m else '-'} "
                     f"| {_gb(f['bytes']) if f else '-'} | {ratio} | "
                     f"{_gflop(f)} | {h200} |")
    return "\n".join(lines) + "\n"


def kernel_table(kernels: list[dict]) -> str:
    """Per kernel on sm_90a: registers, spills, shared memory, warps, occupancy and waves, MMA
    kind, TMA loads, barriers, modelled traffic and roofline time on H200."""
    lines = ["| shape | kernel | backend | regs | spill B | smem KiB | warps | CTAs/SM (limit) | waves "
             "| MMA | TMA | barriers | MB | H200 floor µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in kernels:
        if r["arch"] != "sm_90a":
            continue
        mma = mma_text(r)
        mb = f"{(r['bytes_read'] + r['bytes_written']) / 1e6:.1f}" if "flops" in r else "-"
        floor = f"{r['floor_us']['H200 SXM']:.1f}" if "floor_us" in r else "-"
        lines.append(f"| {r['label']} | {r['kernel']} | {r['backend']} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['shared_bytes'] / 1024:.1f} | {r['warps']} | "
                     f"{r['ctas_per_sm']} ({r['occupancy_limited_by']}) | {r['waves']:.2f} | {mma} | "
                     f"{r['copies'].get('tma load', 0)} | {r['barriers']} | {mb} | {floor} |")
    return "\n".join(lines) + "\n"
