"""Engram saved-state gate: the plans' contract. Construction and validation errors naming the argument, options,
views and strides, the status word, host checks, eager wrappers and torch ops, CUDA Graph capture.
"""

from __future__ import annotations

import math

import pytest
import torch

import fusedops
from fusedops import EngramGateSavedBackward, EngramGateSavedForward, TensorDesc
from fusedops.engram_gate import GateProblem
from fusedops.errors import UnsupportedError, ValidationError

from helpers import BACKENDS, DEVICE, GPU_BACKENDS, HAS_CUDA, requires_cuda

from .support import EPS, _compiled_pair, make_inputs, run_plans


# -- 4. validation errors ------------------------------------------------------------------------
def _fwd_args(**overrides):
    t = make_inputs(8, 4, 64, torch.bfloat16, seed=1)
    args = dict(x=t["x"], kv=t["kv"], weight=t["weight"], mask=t["mask"])
    args.update(overrides)
    return args


def _aligned_offset_view(like: torch.Tensor, offset_elems: int) -> torch.Tensor:
    buffer = torch.empty(like.numel() + offset_elems, dtype=like.dtype, device=like.device)
    return buffer[offset_elems:].view(like.shape)


@pytest.mark.parametrize("overrides,match", [
    (dict(x=torch.zeros(8, 4, 64, dtype=torch.int32)), r"x: expected dtype bfloat16.*got int32"),
    (dict(kv=torch.zeros(8, 320, dtype=torch.float16)), r"kv: expected dtype bfloat16, got float16"),
    (dict(weight=torch.zeros(4, 64, dtype=torch.bfloat16)), r"weight: expected dtype float32"),
    (dict(mask=torch.ones(8, dtype=torch.uint8)), r"mask: expected dtype bool, got uint8"),
    (dict(x=torch.zeros(8, 256, dtype=torch.bfloat16)), r"x: expected a 3-d tensor \[N, S, D\]"),
    (dict(kv=torch.zeros(8, 256, dtype=torch.bfloat16)), r"kv: expected shape \[N, \(S\+1\)\*D\] = \[8, 320\], got \[8, 256\]"),
    (dict(weight=torch.zeros(4, 32)), r"weight: expected shape \[S, D\] = \[4, 64\]"),
    (dict(mask=torch.ones(7, dtype=torch.bool)), r"mask: expected shape \[N\] = \[8\], got \[7\]"),
    (dict(x=torch.zeros(0, 4, 64, dtype=torch.bfloat16), kv=torch.zeros(0, 320, dtype=torch.bfloat16),
          mask=None), r"x: expected N, S and D >= 1"),
    (dict(x=torch.zeros(8, 4, 4, dtype=torch.bfloat16), kv=torch.zeros(8, 20, dtype=torch.bfloat16),
          weight=torch.zeros(4, 4)), r"x: expected rows of a multiple of 16 bytes.*D = 4"),
    (dict(x=torch.zeros(8, 64, 4, dtype=torch.bfloat16).transpose(1, 2)), r"x: expected the last dimension contiguous"),
    (dict(kv=torch.zeros(8, 640, dtype=torch.bfloat16)[:, ::2]), r"kv: expected the last dimension contiguous"),
    (dict(x=_aligned_offset_view(torch.zeros(8, 4, 64, dtype=torch.bfloat16), 1)),
     r"x: expected a data pointer aligned to 16 bytes"),
    (dict(kv=TensorDesc((8, 320), torch.bfloat16, device="meta")), r"kv: expected device cpu"),
    (dict(x=[1, 2]), r"x: expected a torch.Tensor or fusedops.TensorDesc, got list"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_forward_construction_errors(overrides, match):
    args = _fwd_args(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in overrides.items()})
    with pytest.raises(ValidationError, match=match.replace("cpu", str(DEVICE))):
        EngramGateSavedForward(**args, backend="torch")


@pytest.mark.parametrize("eps", [float("nan"), 0.0, -1e-6, float("inf"), 1e-45, "tiny"])
def test_eps_must_be_finite_positive_normal_fp32(eps):
    with pytest.raises(ValidationError, match=r"eps: expected a finite float"):
        EngramGateSavedForward(**_fwd_args(), eps=eps)


def test_backend_errors(monkeypatch):
    with pytest.raises(ValidationError, match=r"backend: expected one of auto, torch, triton, cute, got 'cudnn'"):
        EngramGateSavedForward(**_fwd_args(), backend="cudnn")
    if not HAS_CUDA:
        monkeypatch.setenv("FUSEDOPS_EMULATE", "0")
        with pytest.raises(UnsupportedError, match=r"cute: (CuTe DSL kernels run on CUDA devices, not on cpu; "
                                                   r"on cpu only under the PTX emulator \(FUSEDOPS_EMULATE=1\)"
                                                   r"|nvidia-cutlass-dsl is not installed)"):
            EngramGateSavedForward(**_fwd_args(), backend="cute")
        monkeypatch.setenv("FUSEDOPS_EMULATE", "1")
        monkeypatch.setenv("FUSEDOPS_TARGET_ARCH", "sm_80")
        with pytest.raises(UnsupportedError, match=r"the cute kernels are built for sm_90a and sm_100a; the "
                                                   r"emulated target is sm_80|nvidia-cutlass-dsl is not installed"):
            EngramGateSavedForward(**_fwd_args(), backend="cute")
        monkeypatch.delenv("FUSEDOPS_TARGET_ARCH")
    t = make_inputs(2, 1, 8, torch.float64)
    with pytest.raises(UnsupportedError, match=r"triton: the Triton gate kernels take bf16/fp16/fp32"):
        EngramGateSavedForward(t["x"], t["kv"], t["weight"], None, backend="triton")
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        monkeypatch.setenv("FUSEDOPS_EMULATE", "0")
        with pytest.raises(UnsupportedError, match=r"Triton kernels run on CUDA devices; on cpu only "
                                                   r"under the Triton interpreter .* or the PTX "
                                                   r"emulator \(FUSEDOPS_EMULATE=1\)"):
            EngramGateSavedForward(**_fwd_args(), backend="triton")
        assert EngramGateSavedForward(**_fwd_args()).selected_backend == "torch"


def test_cuda_declaration_without_cuda():
    if HAS_CUDA:
        pytest.skip("CUDA is available here")
    with pytest.raises(UnsupportedError, match=r"x: declared on cuda, but CUDA is not available"):
        EngramGateSavedForward(TensorDesc((8, 4, 64), torch.bfloat16), TensorDesc((8, 320), torch.bfloat16),
                               TensorDesc((4, 64), torch.float32))


def test_workspace_formula():
    """Backward workspace = 4 * S * D * blocks bytes, blocks = ceil(N / tokens_per_block) with
    at least 4 tokens per block and at most 640 // ((S + 1) * chunks) blocks."""
    pytest.importorskip("triton")
    from fusedops.backends.triton.engram_gate.program import backward_workspace
    from fusedops.backends.triton.engram_gate.tiles import backward_blocks
    for n, expected_blocks in ((1, 1), (64, 16), (512, 128), (8192, 128), (100_000, 128)):
        problem = GateProblem(torch.bfloat16, n, 4, 5120, EPS, False, False, DEVICE)
        per_block, blocks = backward_blocks(problem)
        assert blocks == expected_blocks == math.ceil(n / per_block) and per_block >= 4
        assert backward_workspace(problem).size == 4 * 4 * 5120 * blocks
    if "triton" in BACKENDS:
        t = make_inputs(64, 4, 64, torch.bfloat16)
        bwd = EngramGateSavedBackward(t["x"], t["kv"], t["weight"], torch.empty(64, 4, 4, device=DEVICE),
                                      t["grad_out"], backend="triton")
        assert bwd.workspace_size == 4 * 4 * 64 * 16 == bwd.allocate_workspace().numel()


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_execute_does_not_sync_or_allocate(backend):
    t, fwd, bwd, out, saved, g = _compiled_pair(backend, n=2048)
    args_f = (t["x"], t["kv"], t["weight"], t["mask"], out, saved)
    args_b = (t["x"], t["kv"], t["weight"], saved, t["grad_out"], g["grad_x"], g["grad_kv"], g["grad_weight"], g["workspace"])
    fwd.execute(*args_f)
    bwd.execute(*args_b)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fwd.execute(*args_f)
            bwd.execute(*args_b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "allocated_bytes.all.allocated", "segment.all.allocated"):
        assert after.get(key, 0) == before.get(key, 0), key


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_new_token_count_reuses_compiled_kernels(backend):
    _compiled_pair(backend, n=512)
    misses = fusedops.cache_info().misses
    _compiled_pair(backend, n=777)
    assert fusedops.cache_info().misses == misses


def _in_wider(t: torch.Tensor, pad: int, fill=0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): ``t`` as a view of the first columns of a buffer ``pad`` columns wider."""
    buffer = torch.full((*t.shape[:-1], t.shape[-1] + pad), fill, dtype=t.dtype, device=t.device)
    view = buffer[..., :t.shape[-1]]
    view.copy_(t)
    return buffer, view


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_go_in_and_out_without_copies(backend):
    """x, kv and grad_out as views of wider buffers, out, grad_x and grad_kv written straight
    into views of wider buffers: the same bits as contiguous tensors, nothing written beside."""
    t = make_inputs(11, 3, 64, torch.bfloat16, seed=17)
    reference = run_plans(t, backend)
    _, x = _in_wider(t["x"], 16)
    _, kv = _in_wider(t["kv"], 8)
    _, g = _in_wider(t["grad_out"], 24)
    fwd = EngramGateSavedForward(x, kv, t["weight"], t["mask"], backend=backend).compile()
    out_buffer, out = _in_wider(torch.empty_like(t["x"]), 8, float("nan"))
    saved = torch.empty(11, 3, 4, device=DEVICE)
    fwd.execute(x, kv, t["weight"], t["mask"], out, saved)
    bwd = EngramGateSavedBackward(x, kv, t["weight"], saved, g, backend=backend).compile()
    gx_buffer, gx = _in_wider(torch.empty_like(t["x"]), 16, float("nan"))
    gkv_buffer, gkv = _in_wider(torch.empty_like(t["kv"]), 8, float("nan"))
    gw = torch.empty_like(t["weight"])
    bwd.execute(x, kv, t["weight"], saved, g, gx, gkv, gw, bwd.allocate_workspace())
    for name, value in dict(out=out, saved=saved, grad_x=gx, grad_kv=gkv, grad_weight=gw).items():
        assert torch.equal(value, reference[name]), name
    for buffer, width in ((out_buffer, 64), (gx_buffer, 64), (gkv_buffer, 256)):
        assert torch.isnan(buffer[..., width:].float()).all()


def test_strides_must_keep_rows_aligned():
    t = make_inputs(4, 2, 64, torch.bfloat16)
    x = torch.zeros(4, 2, 67, dtype=torch.bfloat16)[..., :64]        # rows 134 bytes apart
    with pytest.raises(ValidationError, match=r"x: expected strides of multiples of 16 bytes"):
        EngramGateSavedForward(x, t["kv"], t["weight"], t["mask"])
    with pytest.raises(ValidationError, match=r"x: expected the last dimension contiguous"):
        EngramGateSavedForward(torch.zeros(4, 64, 2, dtype=torch.bfloat16).transpose(1, 2),
                               t["kv"], t["weight"], t["mask"])
    plan = EngramGateSavedForward(t["x"], t["kv"], t["weight"], t["mask"]).compile()
    out = torch.zeros(4, 2, 67, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(ValidationError, match=r"out: expected the last dimension contiguous and the other strides multiples of 16 bytes"):
        plan.execute(t["x"], t["kv"], t["weight"], t["mask"], out, torch.empty(4, 2, 4))
