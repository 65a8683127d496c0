"""The core and plan machinery: TensorDesc, TupleDict, checks, option validators, streams,
caches, the staged program, backend choice."""

import math

import pytest
import torch

import fusedops
from fusedops import TensorDesc, TupleDict
from fusedops.core import options
from fusedops.core.cache import CompileCache
from fusedops.core.checks import byte_range, check_no_overlap, check_workspace
from fusedops.core.program import Program, Stage, workspace_piece
from fusedops.core.stream import HandleKind, handle_kind, resolve_stream
from fusedops.core.workspace import Layout
from fusedops.errors import FusedOpsError, PlanStateError, UnsupportedError, ValidationError
from fusedops.plan import PlanCache, backend_unavailable_reason, select_backend

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
    (dict(shape=(2.0, 3), dtype=torch.float32), r"TensorDesc.shape: expected ints, got 2.0"),
    (dict(shape=(True, 3), dtype=torch.float32), r"TensorDesc.shape: expected ints, got True"),
    (dict(shape=(2, 3), dtype=torch.float32, stride=(3, 1.5)), r"TensorDesc.stride: expected ints"),
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


def test_stream_handle_kinds():
    """CUDA's special handles: 0 (NULL) and 1 (cudaStreamLegacy) are the legacy default stream,
    2 (cudaStreamPerThread) the per-thread default stream; anything else a created stream."""
    assert handle_kind(0) is HandleKind.DEFAULT and handle_kind(1) is HandleKind.DEFAULT
    assert handle_kind(2) is HandleKind.PER_THREAD
    assert handle_kind(0x7F3A_0000_1234) is HandleKind.CREATED
    with pytest.raises(ValidationError, match=r"current_stream: expected a non-negative stream handle, got -1"):
        handle_kind(-1)


@requires_cuda
@pytest.mark.gpu
def test_special_stream_handles_on_gpu():
    """Eager wrappers allocate on the stream the handle names: 0/1 map to torch's default
    stream (not an ExternalStream wrapping a null handle), 2 to the per-thread stream."""
    from fusedops.core.stream import torch_stream
    device = torch.device("cuda", torch.cuda.current_device())
    assert torch_stream(0, device) == torch.cuda.default_stream(device)
    assert torch_stream(1, device) == torch.cuda.default_stream(device)
    assert torch_stream(2, device).cuda_stream == 2
    x = torch.randn(16, 4, 64, device=device, dtype=torch.bfloat16)
    kv = torch.randn(16, 320, device=device, dtype=torch.bfloat16)
    w = torch.ones(4, 64, device=device)
    for handle in (0, 1, 2):
        out = fusedops.engram_gate_saved_forward(x, kv, w, current_stream=handle)["out"]
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all()


def test_cpu_stream_must_be_none():
    assert resolve_stream(None, torch.device("cpu")) is None
    with pytest.raises(ValidationError, match=r"current_stream: expected None for a plan on cpu, got 5"):
        resolve_stream(5, torch.device("cpu"))


@requires_cuda
@pytest.mark.gpu
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
    made = []

    def build(key):
        return lambda: made.append(key) or object()
    cache = PlanCache(capacity=2)
    a = cache.get(1, build(1))
    assert cache.get(1, build(1)) is a and made == [1]
    cache.get(2, build(2))
    cache.get(3, build(3))                  # evicts 1
    assert cache.get(1, build(1)) is not a and made == [1, 2, 3, 1]


def test_a_failed_build_is_not_cached():
    cache = PlanCache()

    def fail():
        raise ValidationError("x: bad")
    with pytest.raises(ValidationError):
        cache.get("k", fail)
    assert len(cache) == 0 and cache.get("k", lambda: "plan") == "plan"


@pytest.mark.parametrize("check,value,match", [
    (lambda v: options.expect_int("top_k", v, 1), True, r"top_k: expected an int >= 1, got True"),
    (lambda v: options.expect_int("top_k", v, 1), 2.0, r"top_k: expected an int >= 1, got 2.0"),
    (lambda v: options.expect_int("top_k", v, 1, 8), 9, r"top_k: expected an int in \[1, 8\], got 9"),
    (lambda v: options.expect_int_choice("chunk_size", v, (64, 128)), 64.0,
     r"chunk_size: expected an int, one of \(64, 128\), got 64.0"),
    (lambda v: options.expect_bool("causal", v), 1, r"causal: expected a bool, got 1"),
    (lambda v: options.expect_float("softmax_scale", v, positive=True), True,
     r"softmax_scale: expected a finite float > 0, got True"),
    (lambda v: options.expect_float("softmax_scale", v, positive=True), math.inf,
     r"softmax_scale: expected a finite float > 0, got inf"),
    (lambda v: options.expect_float("eps", v, minimum=1e-30), "tiny", r"eps: expected a finite float >= 1e-30"),
    (lambda v: options.expect_int_pair("window_size", v, -1), (4.0, 0),
     r"window_size: expected a pair \(left, right\) of ints >= -1"),
    (lambda v: options.expect_float_range("dt_limit", v), (1.0, 0.0), r"dt_limit: expected lo <= hi"),
    (lambda v: options.expect_choice("rounding", v), "up", r"rounding: expected one of"),
])
def test_option_validators_refuse_and_name_the_argument(check, value, match):
    if "rounding" in match:
        check = lambda v: options.expect_choice("rounding", v, ("nearest", "stochastic"))  # noqa: E731
    with pytest.raises(ValidationError, match=match):
        check(value)


def test_option_validators_normalise():
    assert options.expect_int("n", 3) == 3 and options.expect_float("f", 2) == 2.0
    assert options.expect_int_pair("w", [3, -1], -1) == (3, -1)
    assert options.expect_float_range("r", [0, math.inf]) == (0.0, math.inf)
    assert options.optional(options.expect_bool)("b", None) is None


def test_staged_program_binds_by_name_and_checks_at_build():
    """Arguments take the plan tensor of their name (a trailing _ptr dropped), a workspace piece,
    or a scalar; an argument nobody provides fails when the program is built."""
    class Kernel:
        name = "k"

        def __init__(self, args):
            self.args = args

        def runtime_arg_names(self):
            return self.args

        def build_launcher(self, device):
            return lambda *args, stream: calls.append((args, stream))
    calls = []
    layout = Layout([("partials", torch.float32, 8)])
    program = Program(workspace=layout, stages=(
        Stage(Kernel(("x_ptr", "out", "partials", "N")), dict(partials=workspace_piece("partials"), N=5)),))
    launch = program.build(torch.device("cpu"), frozenset({"x", "out", "workspace"}))
    ws = torch.empty(layout.size, dtype=torch.uint8)
    x, out = torch.zeros(2), torch.zeros(2)
    launch(dict(x=x, out=out, workspace=ws), None)
    (args, stream), = calls
    assert args[0] is x and args[1] is out and args[2].offset == 0 and args[2].numel == 8 and args[3] == 5
    with pytest.raises(ValueError, match=r"argument out takes tensor 'out', which the plan does not bind"):
        program.build(torch.device("cpu"), frozenset({"x", "workspace"}))
    with pytest.raises(ValueError, match=r"bind names \['y'\], which are not runtime arguments"):
        Program(stages=(Stage(Kernel(("x",)), dict(y=1)),)).build(torch.device("cpu"), frozenset({"x"}))


def test_triton_descriptor_scratch_comes_from_the_workspace():
    """A spec whose programs make tensor descriptors takes the ``global_scratch`` workspace piece
    (bound by default), sized descriptors x 128 bytes x programs and shared by a program's
    stages; Triton's allocator then answers that region for the launch and refuses a larger
    request, and a compiled kernel using more scratch than its spec declares is refused."""
    pytest.importorskip("triton")
    from types import SimpleNamespace
    from fusedops.backends.triton.gqa_attention import program as kernels
    from fusedops.backends.triton.runtime import _ScratchRegion, _scratch, check_scratch
    from fusedops.core.program import SCRATCH
    from fusedops.core.target import compiling_for
    q = TensorDesc((2, 300, 4, 64), torch.bfloat16, device="cpu")
    kv = TensorDesc((2, 300, 2, 64), torch.bfloat16, device="cpu")
    problem = fusedops.GQAAttentionForward(q, kv, kv, causal=True, backend="torch").problem
    for arch, descriptors in (("sm_90", 3), ("sm_80", 0)):
        with compiling_for(arch):
            program = kernels.forward_program(problem)
        spec = program.stages[-1].kernel
        programs = spec.grid[0] * spec.grid[1] * spec.grid[2]
        assert spec.descriptors == descriptors and spec.scratch_bytes == descriptors * 128 * programs
        assert (spec.runtime_arg_names()[-1] == SCRATCH.name) == bool(descriptors)
        assert (SCRATCH.name in program.workspace) == bool(descriptors)
        if descriptors:
            assert program.workspace.offsets[SCRATCH.name][2] == spec.scratch_bytes
    with compiling_for("sm_90"):
        spec = kernels.forward_program(problem).stages[-1].kernel
        specs = kernels.backward_specs(problem)
        workspace = kernels.backward_workspace(problem)
    assert workspace.offsets[SCRATCH.name][2] == max(s.scratch_bytes for s in specs.values())
    raw = torch.empty(4096 + 128, dtype=torch.uint8)
    buffer = raw[-raw.data_ptr() % 128:]                   # 128-byte aligned, as CUDA's are
    region = Layout([("global_scratch", torch.uint8, 1024)]).carve(buffer, "global_scratch")
    from triton.runtime import _allocation
    before = _allocation._allocator.get()
    with _scratch(_allocation._allocator, spec, region):
        allocator = _allocation._allocator.get()
        assert allocator(1024, 128, None).data_ptr() == buffer.data_ptr()
        with pytest.raises(RuntimeError, match="asks for 2048 bytes of global scratch"):
            allocator(2048, 128, None)
    assert _allocation._allocator.get() is before
    check_scratch(spec, SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=384)))
    with pytest.raises(RuntimeError, match="declares 3 tensor descriptors"):
        check_scratch(spec, SimpleNamespace(metadata=SimpleNamespace(global_scratch_size=512)))
    assert isinstance(allocator, _ScratchRegion)


def test_backend_selection_reasons(monkeypatch):
    cpu = torch.device("cpu")
    assert select_backend("op", "auto", cpu, None, "engram_gate.program", ("torch",), ("triton", "torch"))[0] == "torch"
    with pytest.raises(UnsupportedError, match=r"backend='triton' cannot serve op on cpu: triton: op has no "
                                               r"triton implementation \(implemented by: torch\)"):
        select_backend("op", "triton", cpu, None, "engram_gate.program", ("torch",), ("triton", "torch"))
    monkeypatch.setenv("FUSEDOPS_EMULATE", "0")
    reason = backend_unavailable_reason("cute", cpu)
    assert "CuTe DSL kernels run on CUDA devices" in reason or "nvidia-cutlass-dsl" in reason
    monkeypatch.setenv("FUSEDOPS_EMULATE", "1")
    monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", "sm_100a")
    assert backend_unavailable_reason("cute", cpu) in (None, "nvidia-cutlass-dsl is not installed "
                                                             "(pip install 'fusedops[cute]')")
    with pytest.raises(ValidationError, match=r"backend: expected one of auto, torch, triton, cute, got 'x'"):
        backend_unavailable_reason("x", cpu)
    with pytest.raises(ValidationError, match=r"backend: expected a string, got int"):
        select_backend("op", 3, cpu, None, "engram_gate.program", ("torch",), ("torch",))
    if not HAS_CUDA:
        assert backend_unavailable_reason("torch", cpu) is None


def _bytes_of(t):
    import itertools
    e, base, out = t.element_size(), t.data_ptr(), set()
    for index in itertools.product(*[range(n) for n in t.shape]):
        offset = sum(i * s for i, s in zip(index, t.stride())) * e
        out.update(range(base + offset, base + offset + e))
    return out


def test_overlap_is_exact_for_strided_views():
    """Slices of one fused buffer whose elements never meet are not refused; views that share a
    byte are; drawn strided views agree with a byte-by-byte count."""
    import random
    from fusedops.core.overlap import shares_bytes
    qkv = torch.zeros(2, 5, 3 * 64)
    q, k, v = qkv[..., :64], qkv[..., 64:128], qkv[..., 128:]
    check_no_overlap({"q": q, "k": k}, {"v": v})
    with pytest.raises(ValidationError, match=r"o: must not overlap k; they share bytes"):
        check_no_overlap({"q": q, "k": k}, {"o": qkv[..., 100:164]})
    assert not shares_bytes(qkv[:, ::2], qkv[:, 1::2])
    assert shares_bytes(qkv.view(torch.uint8)[..., 3:5], qkv[..., :1])
    rng = random.Random(7)
    storage = torch.zeros(1200)
    for _ in range(400):
        views = []
        for _ in range(2):
            dtype = rng.choice([torch.float32, torch.float16, torch.uint8])
            flat = storage.view(dtype)
            shape = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
            strides = [rng.choice([1, 2, 3, 7, 16, 40]) for _ in shape]
            extent = sum((n - 1) * s for n, s in zip(shape, strides))
            views.append(flat.as_strided(shape, strides, rng.randint(0, min(80, flat.numel() - 1 - extent))))
        a, b = views
        assert shares_bytes(a, b) == bool(_bytes_of(a) & _bytes_of(b)), (a.stride(), b.stride())


def test_extents_meet_only_where_a_written_range_meets_another():
    from fusedops.core.overlap import extents_meet
    assert not extents_meet([(0, 8, False), (4, 12, False), (12, 16, True)])    # reads may meet
    assert extents_meet([(0, 8, False), (4, 12, True)])
    assert extents_meet([(4, 12, False), (0, 8, True)])
    assert extents_meet([(0, 4, True), (0, 4, True)])
    assert not extents_meet([(0, 4, True), (4, 8, True), (8, 12, False)])      # adjacent
    assert extents_meet([(0, 100, True), (10, 20, False), (30, 40, False)])


def test_execute_checks_decide_once_per_signature_and_overlap_every_call(monkeypatch):
    """ExecuteChecks runs the per-tensor checks on a signature's first call only (fresh tensors
    of the same layouts skip them) and checks overlap on every call, exactly: slices of one
    fused buffer that never meet pass, ones that meet are refused with check_no_overlap's
    message; anything else that changes runs the full checks again."""
    import fusedops.core.checks as checks
    cpu = torch.device("cpu")
    view = TensorDesc((2, 5, 64), torch.float32, (5 * 192, 192, 1), cpu)
    run = checks.ExecuteChecks([(n, view, 16, True, n.startswith("d")) for n in
                                ("q", "k", "dq", "dk")] + [("mask", None, 1, False, False)],
                               (0, cpu, 16))

    def fused():
        qkv, grads = torch.zeros(2, 5, 192), torch.zeros(2, 5, 192)
        return qkv, grads, dict(q=qkv[..., :64], k=qkv[..., 64:128], dq=grads[..., :64],
                                dk=grads[..., 64:128], workspace=None)
    qkv, grads, args = fused()
    run(args)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the per-tensor checks ran again")
    with monkeypatch.context() as patched:
        patched.setattr(checks, "check_execute_tensor", refuse)
        run(fused()[2])                                  # fresh buffers, the same signature
        for change in (dict(dk=grads[..., 32:96]), dict(dq=qkv[..., :64], dk=qkv[..., 64:128])):
            bad = {**args, **change}
            with pytest.raises(ValidationError, match="must not overlap") as hit:
                run(bad)
            with pytest.raises(ValidationError) as full:
                check_no_overlap({n: bad[n] for n in ("q", "k")},
                                 {n: bad[n] for n in ("dq", "dk")})
            assert str(hit.value) == str(full.value)
    for change, match in ((dict(q=torch.zeros(2, 5, 128)[..., ::2]), r"^q: expected the last"),
                          (dict(k=qkv[..., 1:65]), r"^k: expected a data pointer aligned"),
                          (dict(mask=torch.ones(2)), r"^mask: this plan was built without"),
                          (dict(workspace=torch.zeros(1)), r"^workspace: expected a contiguous")):
        with pytest.raises(ValidationError, match=match):
            run({**args, **change})
    run(args)


def test_kernel_specs_take_their_arguments_from_the_jit_signature():
    """KernelSpec.make reads the order and the compile-time parameters from the kernel's
    signature: runtime arguments default to i32, None compiles an operand out, and a name the
    kernel lacks, a constexpr without a value or a runtime argument given as one is refused."""
    pytest.importorskip("triton")
    import triton
    import triton.language as tl
    from fusedops.backends.triton.runtime import KernelSpec

    @triton.jit
    def probe(x_ptr, y_ptr, N, stride_x, scale, BLOCK: tl.constexpr, HAS_Y: tl.constexpr):
        pass

    spec = KernelSpec.make(probe, {"x_ptr": "*bf16", "y_ptr": None, "scale": "fp32"},
                           dict(BLOCK=64, HAS_Y=False), (4,))
    assert spec.signature == (("x_ptr", "*bf16"), ("y_ptr", "constexpr"), ("N", "i32"),
                              ("stride_x", "i32"), ("scale", "fp32"), ("BLOCK", "constexpr"),
                              ("HAS_Y", "constexpr"))
    assert spec.runtime_arg_names() == ("x_ptr", "N", "stride_x", "scale")
    assert spec.aligned == ("x_ptr",) and spec.grid == (4, 1, 1)
    with pytest.raises(ValueError, match=r"KernelSpec of probe: unknown argument 'z_ptr'; "
                                         r"no value for tl.constexpr 'HAS_Y'"):
        KernelSpec.make(probe, {"z_ptr": "*fp32"}, dict(BLOCK=64), (1,))
    with pytest.raises(ValueError, match=r"'BLOCK' is a tl.constexpr parameter, not a runtime "
                                         r"argument; 'N' is a runtime parameter, not a tl.constexpr"):
        KernelSpec.make(probe, {"BLOCK": "i32"}, dict(N=3, HAS_Y=True), (1,))
    # a pointer left to the i32 default is refused when the program binds it to a buffer
    forgotten = KernelSpec.make(probe, {"y_ptr": None, "scale": "fp32"},
                                dict(BLOCK=64, HAS_Y=False), (4,))
    stage = Stage(forgotten, dict(N=4, stride_x=1, scale=1.0))
    with pytest.raises(ValueError, match=r"argument x_ptr is a scalar in the kernel's spec but "
                                         r"takes a buffer \('x'\): give its pointer type"):
        Program(stages=(stage,))._getters(stage, frozenset({"x"}))
    assert len(Program(stages=(Stage(spec, dict(N=4, stride_x=1, scale=1.0)),))._getters(
        Stage(spec, dict(N=4, stride_x=1, scale=1.0)), frozenset({"x"}))) == 4


def test_eager_plans_are_found_by_the_call_signature_after_one_validated_call(monkeypatch):
    """A repeated eager call with fresh tensors of the same dtypes, shapes, strides and device
    and the same options finds its plan without validating again; an option equal in value but
    of another type (1 for True) is validated (and refused) as on a first call."""
    from fusedops.engram_gate import EngramGateSavedBackward
    x, kv, weight = torch.randn(3, 2, 16), torch.randn(3, 48), torch.randn(2, 16)
    saved, grad = torch.randn(3, 2, 4), torch.randn(3, 2, 16)
    tensors = dict(x=x, kv=kv, weight=weight, saved=saved, grad_out=grad)
    plan = EngramGateSavedBackward.cached(tensors, backend="torch", accumulate=True)
    fresh = {k: v.clone() for k, v in tensors.items()}

    def validated(*args, **kwargs):
        raise AssertionError("validated again")

    with monkeypatch.context() as m:
        m.setattr(EngramGateSavedBackward, "normalise_options", classmethod(validated))
        assert EngramGateSavedBackward.cached(fresh, backend="torch", accumulate=True) is plan
    with pytest.raises(ValidationError, match=r"^accumulate: expected a bool"):
        EngramGateSavedBackward.cached(fresh, backend="torch", accumulate=1)
    wider = dict(fresh, x=torch.randn(4, 2, 16))
    with pytest.raises(ValidationError, match=r"kv: expected shape"):
        EngramGateSavedBackward.cached(wider, backend="torch", accumulate=True)
