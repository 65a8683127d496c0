"""The PTX emulator's model of what runs at the same time: the skewed schedule and the race
check, asynchronous copies (cp.async, TMA) in flight until they are waited for, mbarrier phases
and transaction counts, wgmma accumulators in flight until wgmma.wait_group, deadlocks. Each
kernel here is also assembled with ptxas when it is on PATH, so the tests use real PTX."""

import numpy as np
import pytest
import torch

from fusedops.backends.ptx_emulator import (
    DataRace,
    Deadlock,
    Memory,
    Options,
    PtxFault,
    PtxProgram,
    launch,
)
from test_ptx_emulator import assemble_if_possible

HEADER = (
    ".version 8.8\n.target {arch}\n.address_size 64\n" ".extern .shared .align 1024 .b8 smem[];\n"
)
REGISTERS = (
    "\t.reg .pred %p<8>;\n\t.reg .b16 %rs<8>;\n\t.reg .b32 %r<40>;\n\t.reg .f32 %f<8>;\n"
    "\t.reg .b64 %rd<16>;\n"
)


def module(body: str, threads: int, arch: str = "sm_90a") -> str:
    """A kernel k(out, src): ``%rd1`` = out, ``%rd4`` = src, ``%r1`` = tid, ``%rd3`` = out +
    4 * tid, ``%r2`` = the shared array's address."""
    return (
        HEADER.format(arch=arch) + ".visible .entry k(.param .u64 out, .param .u64 src)\n"
        f".reqntid {threads}, 1, 1\n{{\n"
        + REGISTERS
        + "\tld.param.b64 %rd1, [out];\n\tld.param.b64 %rd4, [src];\n"
        "\tmov.u32 %r1, %tid.x;\n\tmul.wide.u32 %rd2, %r1, 4;\n\tadd.s64 %rd3, %rd1, %rd2;\n"
        "\tmov.u32 %r2, smem;\n" + body + "\n\tret;\n}\n"
    )


def run(
    body: str,
    tmp_path,
    threads: int,
    out_words: int,
    src: torch.Tensor | None = None,
    shared: int = 4096,
    options: Options = Options(),
    arch: str = "sm_90a",
) -> np.ndarray:
    ptx = module(body, threads, arch)
    assemble_if_possible(ptx, arch, tmp_path)
    out = torch.zeros(out_words, dtype=torch.int32)
    memory = Memory()
    memory.add_tensor(out, "out")
    if src is not None:
        memory.add_tensor(src, "src")
    launch(
        PtxProgram.parse(ptx),
        (1, 1, 1),
        [out.data_ptr(), 0 if src is None else src.data_ptr()],
        memory,
        dynamic_shared_bytes=shared,
        options=options,
    )
    return out.numpy().view(np.uint32)


# -- barriers: the race check and the skewed schedule ---------------------------------------------
MIRROR = (
    "\tshl.b32 %r3, %r1, 2;\n\tadd.s32 %r4, %r2, %r3;\n\tst.shared.b32 [%r4], %r1;\n"
    "{barrier}\tsub.s32 %r5, 63, %r1;\n\tshl.b32 %r6, %r5, 2;\n\tadd.s32 %r7, %r2, %r6;\n"
    "\tld.shared.b32 %r8, [%r7];\n\tst.global.b32 [%rd3], %r8;"
)


@pytest.mark.parametrize("schedule", ["lockstep", "skewed"])
def test_a_barrier_orders_shared_memory_between_warps(tmp_path, schedule):
    out = run(
        MIRROR.format(barrier="\tbar.sync 0;\n"),
        tmp_path,
        64,
        64,
        options=Options(schedule=schedule, seed=3, race_check=True),
    )
    assert (out == np.arange(63, -1, -1)).all()


def test_a_missing_barrier_is_a_race_even_in_lockstep(tmp_path):
    # in lockstep both warps write before either reads, so the values are right: the race check
    # still sees warp 0 read what warp 1 wrote with no barrier between them
    with pytest.raises(
        DataRace,
        match=r"warp 0 .* reads shared offset 252 that warps \[1\] wrote "
        r"with no barrier between them",
    ):
        run(MIRROR.format(barrier=""), tmp_path, 64, 64, options=Options(race_check=True))


def test_a_missing_barrier_gives_wrong_values_under_the_skewed_schedule(tmp_path):
    # without the race check, some order of the two warps reads shared memory not yet written
    wrong = [
        seed
        for seed in range(4)
        if not (
            run(
                MIRROR.format(barrier=""),
                tmp_path,
                64,
                64,
                options=Options(schedule="skewed", seed=seed),
            )
            == np.arange(63, -1, -1)
        ).all()
    ]
    assert wrong


def test_two_warps_writing_the_same_value_is_not_a_race(tmp_path):
    body = (
        "\tst.shared.b32 [%r2], 7;\n\tbar.sync 0;\n\tld.shared.b32 %r8, [%r2];\n"
        "\tst.global.b32 [%rd3], %r8;"
    )
    assert (run(body, tmp_path, 64, 64, options=Options(race_check=True)) == 7).all()


def test_a_deadlocked_barrier_is_reported(tmp_path):
    # warp 1 waits at a named barrier for 64 threads; warp 0 never arrives
    body = "\tsetp.ge.u32 %p1, %r1, 32;\n\t@%p1 bar.sync 1, 64;\n\tst.global.b32 [%rd3], %r1;"
    with pytest.raises(Deadlock, match=r"32 threads of 1 CTAs wait \(bar\) at 'bar.sync 1, 64'"):
        run(body, tmp_path, 64, 64)


# -- cp.async -------------------------------------------------------------------------------------
CP_ASYNC = (
    "\tshl.b32 %r3, %r1, 4;\n\tadd.s32 %r4, %r2, %r3;\n\tmul.wide.u32 %rd5, %r1, 16;\n"
    "\tadd.s64 %rd6, %rd4, %rd5;\n\tcp.async.cg.shared.global [%r4], [%rd6], 16{size};\n"
    "\tcp.async.commit_group;\n{wait}\tld.shared.b32 %r5, [%r4+4];\n"
    "\tst.global.b32 [%rd3], %r5;"
)


def test_cp_async_lands_at_its_wait_group(tmp_path):
    src = torch.arange(32 * 4, dtype=torch.int32)
    out = run(CP_ASYNC.format(size="", wait="\tcp.async.wait_group 0;\n"), tmp_path, 32, 32, src)
    assert (out == np.arange(32) * 4 + 1).all()


def test_reading_a_cp_async_destination_before_its_wait_is_a_race(tmp_path):
    src = torch.arange(32 * 4, dtype=torch.int32)
    with pytest.raises(
        DataRace,
        match=r"reads shared bytes .* being written by an asynchronous "
        r"operation still in flight",
    ):
        run(CP_ASYNC.format(size="", wait=""), tmp_path, 32, 32, src)


def test_cp_async_with_no_source_bytes_reads_nothing_and_fills_zeros(tmp_path):
    # src-size 0: masked-off lanes of a Triton load point anywhere; nothing is read
    body = "\tmov.b64 %rd4, 16;\n" + CP_ASYNC.format(size=", 0", wait="\tcp.async.wait_group 0;\n")
    assert (run(body, tmp_path, 32, 32) == 0).all()


# -- mbarriers ------------------------------------------------------------------------------------
MBARRIER = (
    "\tsetp.eq.u32 %p1, %r1, 0;\n\t@%p1 mbarrier.init.shared::cta.b64 [%r2], {count};\n"
    "\tbar.sync 0;\n\t@%p1 mbarrier.arrive.shared::cta.b64 %rd5, [%r2];\n"
    "\tmov.b32 %r3, 0;\n$WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], %r3;\n"
    "\t@!%p2 bra $WAIT;\n\tst.global.b32 [%rd3], %r1;"
)


def test_an_mbarrier_phase_completes_with_its_arrivals(tmp_path):
    assert (run(MBARRIER.format(count=1), tmp_path, 64, 64) == np.arange(64)).all()


def test_an_mbarrier_waiting_for_an_arrival_that_never_comes_is_a_deadlock(tmp_path):
    with pytest.raises(
        Deadlock,
        match=r"64 threads of 1 CTAs wait \(mbarrier\) at .*the mbarriers: CTA 0 offset 0: "
        r"phase 0, 1 of 2 arrivals missing",
    ):
        run(MBARRIER.format(count=2), tmp_path, 64, 64)


# -- wgmma ----------------------------------------------------------------------------------------
def _core_matrix_image(matrix: np.ndarray, lbo: int, sbo: int) -> np.ndarray:
    """A [rows, 16] bf16 matrix in the K-major layout without swizzle: 8 x 16-byte core
    matrices, the two K halves ``lbo`` bytes apart, groups of 8 rows ``sbo`` bytes apart."""
    rows = matrix.shape[0]
    image = np.zeros(max(sbo * (rows // 8), lbo + 128), dtype=np.uint8)
    bits = torch.from_numpy(matrix).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    for r in range(rows):
        for k in range(16):
            offset = (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 + (k % 8) * 2
            image[offset : offset + 2] = np.frombuffer(bits[r, k].tobytes(), dtype=np.uint8)
    return image


def _descriptor(address: int, lbo: int, sbo: int) -> int:
    return (address >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32)


WGMMA = (
    "\tshl.b32 %r3, %r1, 4;\n\tadd.s32 %r4, %r2, %r3;\n\tmul.wide.u32 %rd5, %r1, 16;\n"
    "\tadd.s64 %rd6, %rd4, %rd5;\n\tld.global.v4.b32 {{%r10, %r11, %r12, %r13}}, [%rd6];\n"
    "\tst.shared.v4.b32 [%r4], {{%r10, %r11, %r12, %r13}};\n"
    "\tsetp.lt.u32 %p1, %r1, 16;\n"
    "\t@%p1 ld.global.v4.b32 {{%r10, %r11, %r12, %r13}}, [%rd6+2048];\n"
    "\t@%p1 st.shared.v4.b32 [%r4+2048], {{%r10, %r11, %r12, %r13}};\n"
    "\tbar.sync 0;\n\tfence.proxy.async.shared::cta;\n\twgmma.fence.sync.aligned;\n"
    "\tmov.b64 %rd7, {desc_a};\n\tmov.b64 %rd8, {desc_b};\n"
    "\twgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {{%f1, %f2, %f3, %f4}}, %rd7, %rd8, "
    "0, 1, 1, 0, 0;\n\twgmma.commit_group.sync.aligned;\n{wait}"
    "\tmul.wide.u32 %rd9, %r1, 16;\n\tadd.s64 %rd10, %rd1, %rd9;\n"
    "\tst.global.v4.f32 [%rd10], {{%f1, %f2, %f3, %f4}};"
)


def _wgmma_case(wait: str, tmp_path):
    gen = np.random.default_rng(0)
    a = gen.standard_normal((64, 16)).astype(np.float32)
    b = gen.standard_normal((8, 16)).astype(np.float32)
    image = np.concatenate([_core_matrix_image(a, 128, 256), _core_matrix_image(b, 128, 256)])
    src = torch.from_numpy(image.copy()).view(torch.int32)
    body = WGMMA.format(
        desc_a=_descriptor(0, 128, 256), desc_b=_descriptor(2048, 128, 256), wait=wait
    )
    out = run(body, tmp_path, 128, 512, src).view(np.float32).reshape(128, 4)
    bf = lambda x: torch.from_numpy(x).to(torch.bfloat16).double().numpy()  # noqa: E731
    return out, bf(a) @ bf(b).T


def test_wgmma_computes_the_warpgroup_product(tmp_path):
    out, expected = _wgmma_case("\twgmma.wait_group.sync.aligned 0;\n", tmp_path)
    lane = np.arange(128)
    w, g, t = lane // 32, (lane % 32) // 4, lane % 4
    for reg, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
        np.testing.assert_allclose(out[:, reg], expected[16 * w + g + dr, 2 * t + dc], rtol=1e-6)


def test_reading_a_wgmma_accumulator_before_its_wait_is_a_race(tmp_path):
    with pytest.raises(DataRace, match=r"register %f1 .* is read while a wgmma is in flight"):
        _wgmma_case("", tmp_path)


def test_a_wgmma_needs_its_whole_warpgroup(tmp_path):
    body = (
        "\tsetp.lt.u32 %p3, %r1, 64;\n\t@%p3 bra $SKIP;\n" + "\twgmma.fence.sync.aligned;\n"
        "$SKIP:\n\tst.global.b32 [%rd3], %r1;"
    )
    with pytest.raises(
        PtxFault,
        match=r"warpgroup of thread 0 .* executes a converged collective "
        r"with 64 of 128 live threads",
    ):
        run(body, tmp_path, 128, 128)
