"""The tests that take over 10 s on one CPU core, each with why it must (the house rule: no test
over 10 s unless marked here). ``tests/conftest.py`` marks them ``long``; ``pytest -m "not
long"`` leaves them out. Keys are node ids without parameters (every parametrisation)."""

LONG_TESTS = {
    "tests/test_kernel_report.py::test_every_kernel_compiles_for_every_target":
        "its module fixture compiles every production kernel for sm_80, sm_90a and sm_100a "
        "(the kernel report the other tests of the module read)",
    "tests/test_docs_and_cli.py::test_gpu_check_dry_run":
        "bench/gpu_check.sh end to end in dry mode: every benchmark at its quick shape",
    "tests/test_docs_and_cli.py::test_demo_passes":
        "the README's demonstration: every family forward and backward on every backend",
    "tests/test_docs_and_cli.py::test_memory_reads_what_transformers_writes":
        "builds transformers' NemotronH configs and counts their layers' bytes",
    "tests/test_docs_and_cli.py::test_bench_command_runs_a_benchmark":
        "a benchmark script end to end in a subprocess",
    "tests/test_layers.py::"
    "test_optimizer_steps_with_gradient_accumulation_follow_the_same_loss_curve":
        "optimiser steps of a tiny NemotronH on the Triton interpreter beside transformers'",
    "tests/test_layers.py::test_logits_and_every_parameter_gradient_match_transformers":
        "a tiny NemotronH forward and backward on the interpreter beside transformers'",
    "tests/test_layers_no_copies.py::test_forward_backward_and_decode_copy_no_activation":
        "a profiled training step and decode through the layers on the interpreter",
    "tests/mamba2_inference/test_math.py::test_stochastic_rounding_is_unbiased_and_within_one_ulp":
        "a bias bound needs many seeded rows of draws, each through the interpreted kernel",
    "tests/test_distributed.py::test_distributed_check":
        "two and four CPU processes under torch.distributed (gloo)",
    "tests/test_distributed.py::test_docs_torchrun_example_trains_on_two_cpu_processes":
        "the page's torchrun example on two CPU processes",
    "tests/test_cost_traces.py::test_modelled_traffic_equals_the_trace":
        "a family's first kernel runs the family's samples under the recorder once for all its "
        "kernels",
    "tests/test_ops.py::test_opcheck_every_op":
        "torch.library.opcheck of every op (schema, fake, autograd) on the interpreter",
    "tests/test_index_fuzz.py::test_index_fuzz":
        "drawn valid and invalid index data, each case in a guarded process",
    "tests/mamba2_scan/test_large_offsets.py::"
    "test_views_past_int32_offsets_match_contiguous_copies":
        "views past 2^31 elements, in a subprocess",
    "tests/mamba2_scan/test_plans.py::test_strided_views_go_in_and_out_without_copies":
        "every view layout through forward and backward on the interpreter",
    "tests/relu2_moe/test_plans.py::test_torch_ops_take_views_without_copies":
        "router and experts forward and backward through the torch ops on the interpreter",
    "tests/test_emulated_kernels.py::test_execute_on_compiled_code_dispatches_no_torch_op":
        "compiles a plan's kernels and runs them on the PTX emulator in a subprocess",
    "tests/test_emulated_kernels.py::test_tiles_reach_every_production_configuration":
        "compiles every tiles case for three targets in a subprocess",
    "tests/test_compat.py::test_transformers_nemotron_h_runs_on_fusedops_through_its_kernel_hooks":
        "a transformers NemotronH through its kernel hooks on the interpreter",
    "tests/mamba2_scan/test_kernels.py::test_backward_bitwise_reproducible":
        "the backward twice at a multi-tile shape on the interpreter",
    "tests/engram_gate/test_kernels.py::test_backward_bitwise_reproducible":
        "the backward twice at a multi-block shape on the interpreter",
    "tests/mamba2_scan/test_kernels.py::test_tuning_tensors_are_valid_packed_offsets":
        "times each autotune candidate once on the interpreter",
    "tests/mamba2_scan/test_kernels.py::test_kernels_read_only_the_sanitised_offsets":
        "every invalid-offset pattern through the interpreted kernels",
    "tests/mamba2_scan/test_math.py::test_valid_cu_seqlens_report_nothing_and_bits_accumulate":
        "several packed layouts through the interpreted kernels",
}
