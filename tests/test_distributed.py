"""fusedops.distributed: expert-parallel MoE and context-parallel Mamba2 and attention on
torch.distributed.

On CPU, one spawned gloo group per world size (2 and 4) runs every check of
tests/distributed_checks.py (spawning a group costs seconds; each check is a test here): every
distributed operator's forward and backward against the single-process result within the
family's tolerance, on the torch backend and (world size 2) the Triton backend under the
interpreter, bitwise repeats, uneven shards, empty ranks, the layers against the single-process
model, and inconsistent metadata raising a clear error on every rank. The torchrun example of
docs/distributed.md is run as written. On a CUDA machine: world size 1 over NCCL through the
same code path.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_checks
from helpers import HAS_CUDA, requires_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
DEADLINE_S = 420
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="the gloo CPU groups run in CI; a CUDA machine runs "
                                               "the NCCL world-size-1 test")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GROUP_TIMEOUT,
                            init_method=f"tcp://127.0.0.1:{port}")
    results = {}
    for check in distributed_checks.CHECKS[world]:
        start = time.perf_counter()
        try:
            check(rank, world)
            results[check.__name__] = ["ok", time.perf_counter() - start]
        except Exception:
            results[check.__name__] = [traceback.format_exc(), time.perf_counter() - start]
        failed = torch.tensor([results[check.__name__][0] != "ok"], dtype=torch.int32)
        dist.all_reduce(failed)          # after a failure the ranks may be out of step: stop
        if failed.item():
            break
    pathlib.Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


_RESULTS: dict[int, list[dict]] = {}


def _group_results(world: int, tmp_path_factory) -> list[dict]:
    """Every rank's {check: [status, seconds]} of one spawned group (run once per session)."""
    if world not in _RESULTS:
        out = tmp_path_factory.mktemp(f"world{world}")
        context = mp.start_processes(_worker, args=(world, _free_port(), str(out)), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world {world}: the group ran past {DEADLINE_S} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        _RESULTS[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return _RESULTS[world]


CASES = [pytest.param(world, check.__name__, id=f"w{world}-{check.__name__}")
         for world, checks in distributed_checks.CHECKS.items() for check in checks]


@cpu_only
@pytest.mark.parametrize("world, name", CASES)
def test_distributed_check(world, name, tmp_path_factory):
    results = _group_results(world, tmp_path_factory)
    for rank, ranked in enumerate(results):
        assert name in ranked, f"rank {rank}: {name} did not run (an earlier check failed)"
        status, _ = ranked[name]
        assert status == "ok", f"rank {rank}:\n{status}"


def _docs_script() -> str:
    text = (ROOT / "docs" / "distributed.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
              if b.startswith("# train_distributed.py")]
    assert len(blocks) == 1, "docs/distributed.md: expected one block starting # train_distributed.py"
    return blocks[0]


@cpu_only
def test_docs_torchrun_example_trains_on_two_cpu_processes(tmp_path):
    """The command of docs/distributed.md, as written: two gloo processes train the small
    NemotronH-style model (expert-parallel MoE, context-parallel Mamba2 and attention)."""
    (tmp_path / "train_distributed.py").write_text(_docs_script())
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FUSEDOPS_EMULATE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"              # an abort prints every thread's Python stack
    script = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    torchrun = [script] if script else [sys.executable, "-m", "torch.distributed.run"]
    proc = subprocess.run([*torchrun, "--standalone", "--nproc_per_node=2", "train_distributed.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) >= 10 and losses[-1] < 0.6 * losses[0], proc.stdout


_RELEASE_SCRIPT = """
import atexit, gc, weakref
import torch
import torch.distributed as dist
held = []


def report():                # registered before fusedops is imported: runs after its handlers
    gc.collect()
    print("group alive at exit:", held[0]() is not None, flush=True)


atexit.register(report)
from fusedops.distributed import expert_parallel_relu2_moe
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
held.append(weakref.ref(dist.group.WORLD))
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 16, generator=g)
ids = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2]], dtype=torch.int32)
out = expert_parallel_relu2_moe(x, torch.randn(4, 8, 16, generator=g) / 4,
                                torch.randn(4, 16, 8, generator=g) / 4, ids,
                                torch.full((5, 2), 0.5), group=dist.group.WORLD,
                                backend="torch")
assert out.shape == (5, 16)
dist.destroy_process_group()
"""


def test_cached_expert_plans_release_their_group_before_shutdown(tmp_path):
    """The expert-parallel plan cache holds each plan's process group. It is cleared at exit,
    so a destroyed group is freed while the interpreter is whole: gloo joins its worker threads
    as the group is freed, which during finalization aborted a torchrun rank now and then after
    its last step."""
    (tmp_path / "release.py").write_text(_RELEASE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "release.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "group alive at exit: False" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@requires_cuda
@pytest.mark.gpu
def test_world_size_one_on_the_gpu_through_the_same_code_path(tmp_path):
    """NCCL with one rank: every distributed operator on the GPU (Triton backend) against the
    single-process result, bitwise repeats included."""
    from fusedops.distributed import SequenceLayout
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        checks = distributed_checks
        checks._scan(0, 1, SequenceLayout.zigzag(40, 1), 1, cu=[0, 3, 9, 9, 31, 40], backend="triton",
                     dtype=torch.float32, repeats=2, device="cuda")
        checks._attention(0, 1, SequenceLayout.zigzag(37, 1), backend="triton", dtype=torch.float32,
                          repeats=2, device="cuda")
        checks._moe(0, 1, [19], backend="triton", dtype=torch.float32, repeats=2, device="cuda")
        checks._moe(0, 1, [19], capacity=19, backend="triton", dtype=torch.float32, device="cuda")
    finally:
        dist.destroy_process_group()
