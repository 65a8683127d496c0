"""The one-page summary that ends bench/gpu_check.sh: per benchmark case, fusedops' time against
the best peer's and its % of the roofline floor, from the reports' JSON in a directory; then the
autotune record the run left there (``fusedops_cache/autotune.json``: per tuned plan, every
candidate's time against the tile table's entry, which is candidate 0).

    python bench/summary.py bench_out
"""

from __future__ import annotations

import json
import pathlib
import sys


def rows(directory: pathlib.Path) -> list[dict]:
    out = []
    for path in sorted(directory.glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except ValueError:
            continue
        if not isinstance(report, dict) or "rows" not in report:
            continue
        cases: dict[str, list[dict]] = {}
        for row in report["rows"]:
            if row.get("us") and row.get("case"):
                cases.setdefault(row["case"], []).append(row)
        for case, entries in cases.items():
            ours = [r for r in entries if str(r.get("impl", "")).startswith("fusedops")]
            peers = [r for r in entries if r not in ours]
            if not ours:
                continue
            best = min(ours, key=lambda r: r["us"])
            peer = min(peers, key=lambda r: r["us"]) if peers else None
            out.append(dict(benchmark=report["title"], device=report["device"], case=case,
                            fusedops=best["impl"], us=best["us"], floor=best.get("% floor"),
                            peer=peer["impl"] if peer else None,
                            peer_us=peer["us"] if peer else None,
                            speedup=peer["us"] / best["us"] if peer else None))
    return out


def autotune_rows(directory: pathlib.Path) -> list[dict]:
    """Per record of ``directory/fusedops_cache/autotune.json``: the plan (op, program, backend),
    the winner's index and each candidate's repr and milliseconds; [] without a record."""
    try:
        record = json.loads((directory / "fusedops_cache" / "autotune.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for key, entry in sorted(record.items()):
        parts = key.split(" | ")
        plan = " ".join(parts[2:5]) if len(parts) > 4 else key
        names = entry.get("candidates") or [None] * len(entry.get("times_ms", []))
        out.append(dict(plan=plan, winner=entry.get("index"),
                        candidates=list(zip(names, entry.get("times_ms", [])))))
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    directory = pathlib.Path(args[0] if args else "bench_out")
    found = rows(directory)
    if not found:
        print(f"no benchmark reports in {directory}")
        return 1
    print(f"{'benchmark':<34} {'case':<28} {'fusedops':<22} {'µs':>9} {'% floor':>8} "
          f"{'best peer':<30} {'peer µs':>9} {'peer/ours':>9}")
    for r in found:
        floor = f"{r['floor']:.0f}" if r["floor"] is not None else "-"
        peer_us = f"{r['peer_us']:.1f}" if r["peer_us"] else "-"
        speedup = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        print(f"{r['benchmark'][:34]:<34} {r['case'][:28]:<28} {r['fusedops'][:22]:<22} "
              f"{r['us']:>9.1f} {floor:>8} {str(r['peer'])[:30]:<30} {peer_us:>9} {speedup:>9}")
    tuned = autotune_rows(directory)
    if tuned:
        print("\nautotune (ms per candidate; #0 is the tile table's entry, * the winner):")
    for r in tuned:
        print(f"  {r['plan']}")
        for i, (name, ms) in enumerate(r["candidates"]):
            mark = "*" if i == r["winner"] else " "
            print(f"   {mark}#{i} {ms:9.3f}  {name or '-'}")
    (directory / "summary.json").write_text(json.dumps(found, indent=1))
    (directory / "autotune_summary.json").write_text(json.dumps(tuned, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
