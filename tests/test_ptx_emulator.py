"""The PTX emulator that runs the CuTe kernels on CPU: its arithmetic against known IEEE results,
its SIMT semantics (shuffles, reconvergence, barriers) and the faults it must report. Each
kernel here is also assembled with ptxas when it is on PATH, so the tests use real PTX."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

from fusedops.backends.ptx_emulator import Memory, PtxFault, PtxProgram, launch

def kernel(body: str, threads: int = 32, params: str = ".param .u64 out", arch: str = "sm_90a") -> str:
    """A one-entry PTX module; ``%rd1`` holds ``out`` and ``%rd3`` = out + 4 * thread index."""
    return (f".version 8.8\n.target {arch}\n.address_size 64\n.extern .shared .align 16 .b8 smem[];\n"
            f".visible .entry k({params})\n.reqntid {threads}, 1, 1\n{{\n"
            "\t.reg .pred %p<8>;\n\t.reg .b16 %rs<8>;\n\t.reg .b32 %r<32>;\n\t.reg .b64 %rd<8>;\n"
            "\tld.param.b64 %rd1, [out];\n\tmov.u32 %r1, %tid.x;\n"
            "\tmul.wide.u32 %rd2, %r1, 4;\n\tadd.s64 %rd3, %rd1, %rd2;\n"
            f"{body}\n\tret;\n}}\n")


def assemble_if_possible(ptx: str, arch: str, tmp_path) -> None:
    if shutil.which("ptxas") is None:
        return
    path = tmp_path / "k.ptx"
    path.write_text(ptx)
    subprocess.run(["ptxas", f"-arch={arch}", str(path), "-o", str(tmp_path / "k.cubin")],
                   check=True, capture_output=True, text=True)


def run(body: str, tmp_path, threads: int = 32, out_words: int | None = None, shared: int = 0,
        grid=(1, 1, 1), arch: str = "sm_90a") -> np.ndarray:
    ptx = kernel(body, threads, arch=arch)
    assemble_if_possible(ptx, arch, tmp_path)
    out = torch.zeros(out_words if out_words is not None else threads * grid[0], dtype=torch.int32)
    memory = Memory()
    memory.add_tensor(out, "out")
    launch(PtxProgram.parse(ptx), grid, [out.data_ptr()], memory, dynamic_shared_bytes=shared)
    return out.numpy().view(np.uint32)


def f32_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def test_fma_rounds_once(tmp_path):
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is a float32 midpoint; + 2^-80 lies just above it, so the
    # fused result rounds up, where a product rounded to float64 first would tie to even (down)
    a, c = f32_bits(1 + 2 ** -12), f32_bits(2.0 ** -80)
    out = run(f"\tmov.b32 %r2, {a};\n\tmov.b32 %r3, {c};\n\tfma.rn.f32 %r4, %r2, %r2, %r3;\n"
              "\tst.global.b32 [%rd3], %r4;", tmp_path)
    assert out[0] == f32_bits(1 + 2 ** -11) + 1


@pytest.mark.parametrize("mode,expected", [("rn", 1.0), ("rm", 1.0), ("rz", 1.0), ("rp", 1 + 2 ** -23)])
def test_fma_directed_rounding(tmp_path, mode, expected):
    out = run(f"\tmov.b32 %r2, 0f3F800000;\n\tmov.b32 %r3, {f32_bits(2.0 ** -30)};\n"
              f"\tfma.{mode}.f32 %r4, %r2, %r2, %r3;\n\tst.global.b32 [%rd3], %r4;", tmp_path)
    assert out[0] == f32_bits(expected)


def test_bf16x2_packing_rounding_and_unpacking(tmp_path):
    # cvt packs its first source into the high half; 1 + 2^-8 is a bf16 tie and rounds to even
    body = (f"\tmov.b32 %r2, {f32_bits(1 + 2 ** -8)};\n\tmov.b32 %r3, 0f40000000;\n"
            "\tcvt.rn.bf16x2.f32 %r4, %r2, %r3;\n\tmov.b32 {%rs1, %rs2}, %r4;\n"
            "\tcvt.f32.bf16 %r5, %rs1;\n\tsetp.eq.u32 %p1, %r1, 0;\n"
            "\tselp.b32 %r6, %r4, %r5, %p1;\n\tst.global.b32 [%rd3], %r6;")
    out = run(body, tmp_path)
    assert out[0] == 0x3F804000 and out[1] == f32_bits(2.0)


def test_single_bf16_conversion_rounds_to_nearest_even(tmp_path):
    # cvt.rn.bf16.f32 (one value into a 16-bit register): 1 + 2^-8 is a bf16 tie and rounds to
    # even (1.0), 1 + 3 * 2^-9 lies above the midpoint and rounds up (1 + 2^-7)
    body = (f"\tmov.b32 %r2, {f32_bits(1 + 2 ** -8)};\n\tcvt.rn.bf16.f32 %rs1, %r2;\n"
            f"\tmov.b32 %r3, {f32_bits(1 + 3 * 2 ** -9)};\n\tcvt.rn.bf16.f32 %rs2, %r3;\n"
            "\tmov.b32 %r4, {%rs1, %rs2};\n\tst.global.b32 [%rd3], %r4;")
    out = run(body, tmp_path)
    assert out[0] == 0x3F813F80


def test_single_bf16_conversion_toward_zero_truncates(tmp_path):
    # 1 + 3 * 2^-9 lies above the bf16 midpoint between 1 and 1 + 2^-7: .rz keeps 1, -x keeps -1
    body = (f"\tmov.b32 %r2, {f32_bits(1 + 3 * 2 ** -9)};\n\tcvt.rz.bf16.f32 %rs1, %r2;\n"
            f"\tmov.b32 %r3, {f32_bits(-(1 + 3 * 2 ** -9))};\n\tcvt.rz.bf16.f32 %rs2, %r3;\n"
            "\tmov.b32 %r4, {%rs1, %rs2};\n\tst.global.b32 [%rd3], %r4;")
    assert run(body, tmp_path)[0] == 0xBF803F80


def test_sm100_packed_f32x2_and_mixed_bf16_fma(tmp_path):
    # sm_100a code adds pairs of fp32 in one 64-bit register (low element first) and fma with
    # bf16 multiplicands and an fp32 addend
    body = ("\tmov.b32 %r2, 0f3FC00000;\n\tmov.b32 %r3, 0fC0000000;\n\tmov.b64 %rd4, {%r2, %r3};\n"
            "\tadd.f32x2 %rd5, %rd4, %rd4;\n\tmov.b64 {%r4, %r5}, %rd5;\n\tmov.b16 %rs1, 0x3FC0;\n"
            "\tfma.rn.f32.bf16 %r6, %rs1, %rs1, %r4;\n\tsetp.eq.u32 %p1, %r1, 0;\n"
            "\tselp.b32 %r7, %r6, %r5, %p1;\n\tst.global.b32 [%rd3], %r7;")
    out = run(body, tmp_path, arch="sm_100a")
    assert out[0] == f32_bits(2.25 + 3.0) and out[1] == f32_bits(-4.0)


def test_butterfly_and_index_shuffles(tmp_path):
    body = "\tmov.u32 %r2, %laneid;\n"
    for offset in (16, 8, 4, 2, 1):
        body += f"\tshfl.sync.bfly.b32 %r3, %r2, {offset}, 31, -1;\n\tadd.s32 %r2, %r2, %r3;\n"
    body += ("\tmov.u32 %r4, %laneid;\n\tshfl.sync.idx.b32 %r5, %r4, 5, 31, -1;\n"
             "\tmul.lo.s32 %r6, %r5, 1000;\n\tadd.s32 %r7, %r2, %r6;\n\tst.global.b32 [%rd3], %r7;")
    out = run(body, tmp_path, threads=64)
    assert (out == sum(range(32)) + 5000).all()


def test_divergent_loop_reconverges_before_a_shuffle(tmp_path):
    # lane i loops i times; the shuffle after the loop needs every lane back together
    body = ("\tmov.u32 %r2, %laneid;\n\tmov.b32 %r3, 0;\n\tmov.b32 %r4, 0;\n"
            "\tsetp.eq.u32 %p1, %r2, 0;\n\t@%p1 bra $DONE;\n"
            "$LOOP:\n\tadd.s32 %r3, %r3, %r4;\n\tadd.s32 %r4, %r4, 1;\n"
            "\tsetp.lt.u32 %p2, %r4, %r2;\n\t@%p2 bra $LOOP;\n"
            "$DONE:\n\tshfl.sync.idx.b32 %r5, %r3, 31, 31, -1;\n"
            "\tmul.lo.s32 %r6, %r5, 1000;\n\tadd.s32 %r7, %r3, %r6;\n\tst.global.b32 [%rd3], %r7;")
    out = run(body, tmp_path)
    expected = np.array([i * (i - 1) // 2 + 1000 * 465 for i in range(32)])
    assert (out == expected).all()


def test_shared_memory_and_barrier_across_warps(tmp_path):
    # each thread stores its index, the CTA syncs, each reads its mirror image
    body = ("\tmov.u32 %r2, smem;\n\tshl.b32 %r3, %r1, 2;\n\tadd.s32 %r4, %r2, %r3;\n"
            "\tst.shared.b32 [%r4], %r1;\n\tbar.sync 0;\n\tsub.s32 %r5, 63, %r1;\n"
            "\tshl.b32 %r6, %r5, 2;\n\tadd.s32 %r7, %r2, %r6;\n\tld.shared.b32 %r8, [%r7];\n"
            "\tst.global.b32 [%rd3], %r8;")
    out = run(body, tmp_path, threads=64, shared=256, grid=(2, 1, 1), out_words=64)
    assert (out == np.arange(63, -1, -1)).all()


def test_float_comparisons_with_nan(tmp_path):
    body = ("\tmov.b32 %r2, 0f7FC00000;\n\tsetp.ne.f32 %p1, %r2, %r2;\n\tsetp.neu.f32 %p2, %r2, %r2;\n"
            "\tselp.b32 %r3, 1, 0, %p1;\n\tselp.b32 %r4, 2, 0, %p2;\n\tadd.s32 %r5, %r3, %r4;\n"
            "\tst.global.b32 [%rd3], %r5;")
    assert run(body, tmp_path)[0] == 2


def test_out_of_bounds_store_faults_and_writes_nothing(tmp_path):
    body = "\tmov.b32 %r2, 7;\n\tst.global.b32 [%rd3], %r2;"
    with pytest.raises(PtxFault, match=r"out-of-bounds global store of 4 B at 0x[0-9a-f]+ by thread 16 "
                                       r"of CTA \(0, 0, 0\) in k: 'st.global.b32 \[%rd3\], %r2' "
                                       r"\(PTX line \d+\); the launch's buffers: .*out \["):
        run(body, tmp_path, out_words=16)


def test_misaligned_vector_load_faults(tmp_path):
    body = "\tld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd3];\n\tst.global.b32 [%rd3], %r2;"
    with pytest.raises(PtxFault, match=r"misaligned global load of 16 B .* by thread 1 of CTA"):
        run(body, tmp_path, out_words=64)


def test_shared_access_beyond_the_declared_size_faults(tmp_path):
    body = "\tmov.u32 %r2, smem;\n\tshl.b32 %r3, %r1, 2;\n\tadd.s32 %r4, %r2, %r3;\n\tst.shared.b32 [%r4], %r1;"
    with pytest.raises(PtxFault, match=r"shared access of 4 B at offset 64 by thread 16 .* outside the 64 B"):
        run(body, tmp_path, shared=64)


def test_shuffle_in_divergent_code_faults(tmp_path):
    body = ("\tsetp.lt.u32 %p1, %r1, 16;\n\t@%p1 bra $SKIP;\n"
            "\tshfl.sync.bfly.b32 %r2, %r1, 1, 31, -1;\n$SKIP:\n\tst.global.b32 [%rd3], %r1;")
    with pytest.raises(PtxFault, match=r"warp of thread 0 of CTA \(0, 0, 0\) executes a converged "
                                       r"collective with 16 of 32 live threads"):
        run(body, tmp_path)


def test_barrier_in_divergent_code_faults(tmp_path):
    body = ("\tsetp.lt.u32 %p1, %r1, 32;\n\t@%p1 bra $SKIP;\n\tbar.sync 0;\n"
            "$SKIP:\n\tst.global.b32 [%rd3], %r1;")
    with pytest.raises(PtxFault, match=r"completed by 32 of the 64 threads of CTA 0 .*: a divergent "
                                       r"barrier"):
        run(body, tmp_path, threads=64)


def test_unknown_instruction_is_named(tmp_path):
    body = "\tbfind.u32 %r2, %r1;\n\tst.global.b32 [%rd3], %r2;"
    with pytest.raises(PtxFault, match=r"instruction 'bfind.u32 %r2, %r1' \(PTX line \d+\) is not "
                                       r"emulated"):
        run(body, tmp_path)


def test_parameter_count_is_checked():
    program = PtxProgram.parse(kernel("", 32))
    with pytest.raises(PtxFault, match=r"k takes 1 parameters, got 2"):
        launch(program, (1, 1, 1), [0, 1], Memory())


def test_real_gate_kernel_writing_past_a_short_output_faults():
    """The gate forward's PTX launched with an output one token short: the emulator stops the
    last token's store and names the buffer."""
    pytest.importorskip("cutlass")
    from fusedops.backends.cute import compiler
    from fusedops.backends.cute.engram_gate.program import forward_kernel
    from fusedops.engram_gate import GateProblem
    n, s, d = 3, 1, 64
    problem = GateProblem(torch.float32, n, s, d, 1e-6, False, False, torch.device("cpu"))
    launch = compiler._emulated_launcher(forward_kernel(problem), "sm_90a")
    x, kv, w = torch.randn(n, s, d), torch.randn(n, (s + 1) * d), torch.randn(s, d)
    out, saved = torch.full((n - 1, s, d), 7.0), torch.empty(n, s, 4)
    with pytest.raises(PtxFault, match=r"out-of-bounds global store .* CTA \(2, 0, 0\)"):
        vec = 16 // x.element_size()          # strides go in 16-byte vectors
        launch(x, kv, w, x, out, saved, n, 1e-6, x.stride(0) // vec, x.stride(1) // vec,
               kv.stride(0) // vec, out.stride(0) // vec, out.stride(1) // vec, stream=None)
