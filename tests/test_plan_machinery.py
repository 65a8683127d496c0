"""The shared plan machinery: TensorDesc, TupleDict, checks, streams, caches, backend choice."""

import pytest
import torch

import fusedops
from fusedops import TensorDesc, TupleDict
from fusedops._backend import select_backend, toolchain_unavailable_reason
from fusedops._cache import CompileCache
from fusedops._checks import byte_range, check_no_overlap, check_workspace
from fusedops._plan import PlanCache
from fusedops._stream import resolve_stream
from fusedops.errors import FusedOpsError, PlanStateError, UnsupportedError, ValidationError

from helpers import HAS_CUDA, requires_cuda


def test_error_hierarchy():
    assert issubclass(UnsupportedError, ValidationError) and issubclass(ValidationError, ValueError)
    assert issubclass(PlanStateError, RuntimeError)
    assert all(issubclass(e, FusedOpsError) for e in (UnsupportedError, ValidationError, PlanStateError))


def test_tensor_desc_defaults_and_contiguity():
    d = TensorDesc((2, 3, 4), torch.bfloat16)
    assert d.stride == (12, 4, 1) and d.is_contiguous() and d.device == torch.device("cuda")
    assert d.numel == 24 and d.element_size == 2 and d.nbytes == 48 and d.ndim == 3
    assert not TensorDesc((2, 3), torch.float32, stride=(1, 2), device="cpu").is_contiguous()
    assert TensorDesc((1, 3), torch.float32, stride=(99, 1), device="cpu").is_contiguous()
    t = torch.zeros(4, 6)[:, ::2]
    assert TensorDesc.from_tensor(t) == TensorDesc((4, 3), torch.float32, (6, 2), "cpu")
    assert hash(TensorDesc((2,), torch.bool, device="cpu")) == hash(TensorDesc([2], torch.bool, device="cpu"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(shape=(2, -1), dtype=torch.float32), r"TensorDesc.shape: expected non-negative sizes, got \(2, -1\)"),
    (dict(shape=(2, 3), dtype="float32"), r"TensorDesc.dtype: expected a torch.dtype, got 'float32'"),
    (dict(shape=(2, 3), dtype=torch.float32, stride=(1,)), r"TensorDesc.stride: expected 2 strides"),
])
def test_tensor_desc_errors(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        TensorDesc(**kwargs)


def test_tupledict():
    r = TupleDict(a=1, b=2)
    a, b = r
    assert (a, b) == (1, 2) and r[1] == 2 and r["a"] == 1 and r[-1] == 2 and r[:1] == (1,)
    assert r.keys() == ("a", "b") and r.values() == (1, 2) and r.items() == (("a", 1), ("b", 2))
    assert "a" in r and "c" not in r and r.get("c", 5) == 5 and len(r) == 2
    assert repr(TupleDict(t=torch.zeros(2, 3))) == "TupleDict(t=Tensor[2, 3]:float32)"


def test_byte_ranges_and_overlap():
    base = torch.zeros(64)
    a, b, c = base[:16], base[16:32], base[8:24]
    assert byte_range(a) == (base.data_ptr(), base.data_ptr() + 64)
    assert byte_range(torch.zeros(0)) == (0, 0)
    check_no_overlap({"a": a}, {"b": b})            # adjacent ranges do not overlap
    check_no_overlap({"a": a}, {"e": torch.zeros(0), "n": None})
    with pytest.raises(ValidationError, match=r"c: must not overlap a"):
        check_no_overlap({"a": a}, {"c": c})
    with pytest.raises(ValidationError, match=r"c: must not overlap b"):
        check_no_overlap({}, {"b": b, "c": c})
    strided = base.view(8, 8)[:, :2]               # touches bytes up to the last row's start + 2
    assert byte_range(strided) == (base.data_ptr(), base.data_ptr() + (7 * 8 + 2) * 4)


def test_workspace_check():
    check_workspace(None, 0, torch.device("cpu"))
    check_workspace(torch.empty(64, dtype=torch.uint8), 64, torch.device("cpu"))
    with pytest.raises(ValidationError, match=r"workspace: expected a uint8 tensor of at least 64 bytes"):
        check_workspace(None, 64, torch.device("cpu"))
    with pytest.raises(ValidationError, match=r"got uint8 of 32 bytes on cpu"):
        check_workspace(torch.empty(32, dtype=torch.uint8), 64, torch.device("cpu"))
    with pytest.raises(ValidationError, match=r"data pointer aligned to 16"):
        check_workspace(torch.empty(80, dtype=torch.uint8)[1:], 64, torch.device("cpu"))


def test_cpu_stream_must_be_none():
    assert resolve_stream(None, torch.device("cpu")) is None
    with pytest.raises(ValidationError, match=r"current_stream: expected None for a plan on cpu, got 5"):
        resolve_stream(5, torch.device("cpu"))


@requires_cuda
def test_cuda_stream_forms():
    device = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream()
    assert resolve_stream(None, device) == torch.cuda.current_stream().cuda_stream
    assert resolve_stream(s, device) == s.cuda_stream == resolve_stream(s.cuda_stream, device)
    with pytest.raises(ValidationError, match=r"current_stream: expected None, an int handle"):
        resolve_stream("stream", device)


def test_compile_cache_counts_and_clears():
    cache, builds = CompileCache(), []
    assert cache.get_or_build("k", lambda: builds.append(1) or "v") == "v"
    assert cache.get_or_build("k", lambda: builds.append(1) or "w") == "v"
    assert builds == [1] and cache.info() == (1, 1, 1)
    cache.clear()
    assert cache.info() == (0, 0, 0)
    assert isinstance(fusedops.cache_info().size, int)


def test_plan_cache_is_lru():
    class Dummy:
        made = 0

        def __init__(self, *args, **kw):
            Dummy.made += 1

        def compile(self):
            return self
    cache = PlanCache(capacity=2)
    a = cache.get(Dummy, 1)
    assert cache.get(Dummy, 1) is a and Dummy.made == 1
    cache.get(Dummy, 2)
    cache.get(Dummy, 3)                  # evicts 1
    assert cache.get(Dummy, 1) is not a and Dummy.made == 4


def test_backend_selection_reasons(monkeypatch):
    cpu = torch.device("cpu")
    impls = {"torch": "fusedops.backends.torch.engram"}
    assert select_backend("op", "auto", cpu, None, impls, ("triton", "torch"))[0] == "torch"
    with pytest.raises(UnsupportedError, match=r"backend='triton' cannot serve op on cpu: triton: op has no "
                                               r"triton implementation \(implemented by: torch\)"):
        select_backend("op", "triton", cpu, None, impls, ("triton", "torch"))
    monkeypatch.setenv("FUSEDOPS_CUTE_EMULATE", "0")
    reason = toolchain_unavailable_reason("cute", cpu)
    assert "CuTe DSL kernels run on CUDA devices" in reason or "nvidia-cutlass-dsl" in reason
    monkeypatch.setenv("FUSEDOPS_CUTE_EMULATE", "sm_100a")
    assert toolchain_unavailable_reason("cute", cpu) in (None, "nvidia-cutlass-dsl is not installed "
                                                               "(pip install 'fusedops[cute]')")
    with pytest.raises(ValidationError, match=r"backend: expected one of auto, torch, triton, cute, got 'x'"):
        toolchain_unavailable_reason("x", cpu)
    if not HAS_CUDA:
        assert "CUDA is not available" not in (toolchain_unavailable_reason("torch", cpu) or "")
