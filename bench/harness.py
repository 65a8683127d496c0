"""The harness behind every bench/ script.

Timing: warm-up, then the median of repetitions, each timed with CUDA events after flushing the
L2 with a 256 MiB write (cold caches, as in a training step); perf_counter on CPU. Ceilings are
measured in the same run: device copy bandwidth (bytes read + written per second) and dense bf16
matmul rate. Results print as a table and can be saved as JSON and a PNG bar chart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 << 20


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 20,
            flush_l2: bool = True) -> float:
    """Median milliseconds of ``fn()`` on ``device``."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize(device)
    for start, end in zip(starts, ends):
        if flush_l2:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth, counting bytes read plus bytes written."""
    if device.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=10, flush_l2=False)
    return 2 * nbytes / ms / 1e6


def matmul_tflops(device: torch.device, size: int = 8192) -> float:
    """Measured dense bf16 matmul rate on random data (the arithmetic ceiling)."""
    if device.type != "cuda":
        size = 512
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, device, reps=10, flush_l2=False)
    return 2 * size ** 3 / ms / 1e9


def graph_time_ms(fn: Callable[[], object], device: torch.device, *, reps: int = 20,
                  flush_l2: bool = True) -> float | None:
    """Median milliseconds of replaying ``fn`` captured once in a CUDA Graph (None off CUDA):
    the time without host launch overhead."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return time_ms(graph.replay, device, reps=reps, flush_l2=flush_l2)


def roofline_ms(cost, ceilings: dict) -> float:
    """The floor time of ``cost`` (a fusedops.core.cost.Cost) at the ceilings measured in this
    run: tensor-core FLOPs at the matmul rate, bytes at the copy bandwidth."""
    compute = cost.mma_flops / (ceilings["bf16 matmul TFLOP/s"] * 1e9)
    memory = cost.bytes / (ceilings["copy GB/s"] * 1e6)
    return max(compute, memory)


def measured_ceilings(device: torch.device) -> dict:
    """The ceilings every report states: copy bandwidth and dense bf16 matmul rate, measured."""
    return {"copy GB/s": copy_bandwidth_gbs(device), "bf16 matmul TFLOP/s": matmul_tflops(device)}


def host_overhead_us(fn: Callable[[], object], device: torch.device, calls: int = 2000) -> float:
    """Host microseconds per call of ``fn`` (launches queue asynchronously on CUDA)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


@dataclass
class Report:
    """Rows of one benchmark run plus the context needed to read them later."""

    title: str
    device: str
    ceilings: dict
    rows: list = field(default_factory=list)
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())
    versions: dict = field(default_factory=dict)

    def add(self, **row) -> None:
        """One row; with ``floor_ms`` (the roofline floor of the case) and ``us``, the row also
        states ``% floor`` (floor time over measured time)."""
        floor = row.pop("floor_ms", None)
        if floor is not None and row.get("us"):
            row["% floor"] = 100 * floor * 1e3 / row["us"]
        self.rows.append(row)

    def print(self) -> None:
        print(f"\n{self.title} on {self.device}, {self.date}")
        print("ceilings: " + ", ".join(f"{k} {v:,.1f}" for k, v in self.ceilings.items()))
        print("versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()))
        if not self.rows:
            return
        columns = list(dict.fromkeys(c for row in self.rows for c in row))
        cells = [[_fmt(row.get(c)) for c in columns] for row in self.rows]
        widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
        print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
        for r in cells:
            print("  ".join(v.rjust(w) for v, w in zip(r, widths)))

    def save_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    def save_png(self, path: str, bars: list, value: str) -> None:
        """A horizontal bar chart of (label, value) pairs."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4))
        ax.barh([str(name) for name, _ in bars], [v for _, v in bars])
        ax.set_xlabel(value)
        ax.set_title(f"{self.title} — {self.device}, {self.date}")
        fig.tight_layout()
        fig.savefig(path, dpi=120)

    def finish(self, args, value: str | None = None, label=None) -> None:
        """Prints the table and saves what the command line asked for: --json, and --png (a
        bar chart of ``value`` over the rows that have it, labelled "case impl" by default)."""
        self.print()
        if args.json:
            self.save_json(args.json)
        if args.png and value:
            label = label or (lambda r: f"{r['case']} {r['impl']}")
            self.save_png(args.png, [(label(r), r[value]) for r in self.rows if value in r], value)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return "" if value is None else str(value)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", help="save the report as JSON here")
    p.add_argument("--png", help="save a bar chart here")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, not a measurement")
    return p


def versions() -> dict:
    import importlib.metadata as md
    out = {"torch": torch.__version__}
    for dist in ("triton", "nvidia-cutlass-dsl"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out
