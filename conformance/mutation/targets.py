"""What the mutation check mutates: each file with its operators and the tests that cover it, fastest
killers first (a run stops at the first test file that does not pass, so a mutant the first file kills
never pays for the others).

An operator joins a target where the file holds the bug class it models: comparisons and off-by-ones
wherever a count or a boundary is decided; ``skip_cow`` and ``ref_count_off_by_one`` where blocks are
shared; ``eviction_order`` where an LRU map is kept; ``copy_direction`` where block copies are planned;
``range_off_by_one`` where a shard's or a fused part's rows are cut; ``drop_guard`` where an early exit
leaves a case out. Files whose only tests spawn ranks (``refengine/parallel/executor.py``, ``workers.py``)
are left out: a mutant there costs a minute of process start-up per run.
"""

from __future__ import annotations

from dataclasses import dataclass

KERNEL_OPS = (
    "int32_offset",
    "bound_plus_one",
    "bound_minus_one",
    "drop_mask",
    "swap_dot_operands",
    "drop_inf_guard",
    "compare_boundary",
)
SUITE = "conformance/suite"
#: the cut of the weights into shards, and the fused projections it ends with (threads, no processes)
TP_TESTS = ("refengine/tests/test_tensor_parallel_shards.py", "refengine/tests/test_fused_linear.py")


@dataclass(frozen=True, slots=True)
class Target:
    """A file to mutate, its operators, and the tests that cover it (fastest killers first)."""

    path: str
    operators: tuple[str, ...]
    tests: tuple[str, ...]


TARGETS = (
    Target(
        "kernels/attention_kernels.py",
        KERNEL_OPS,
        (  # the fast files first: most mutants die there, before the large modules are collected; the
            # guarded-memory checks before the rest, so an access out of bounds fails an assertion there
            # rather than crashing a test that does not guard its tensors
            "kernels/tests/test_reads_in_bounds.py",
            f"{SUITE}/test_int64_offsets.py",
            "kernels/tests/test_extreme_values.py",
            "kernels/tests/test_prefill_window_tiles.py",
            f"{SUITE}/test_decode.py",
            f"{SUITE}/test_prefill.py",
            "kernels/tests/test_decode_plan.py",  # forces 3 splits, which the suite's short cases clamp to 2
            "kernels/tests/test_dot_path.py",
            f"{SUITE}/test_fp8_kv.py",
            f"{SUITE}/test_strided_layouts.py",
            f"{SUITE}/test_batch_positions.py",
            f"{SUITE}/test_layer_packed_cache.py",
        ),
    ),
    Target(
        "kernels/cache_kernels.py",
        KERNEL_OPS,
        (
            "kernels/tests/test_reads_in_bounds.py",
            f"{SUITE}/test_cache_ops.py",
            f"{SUITE}/test_int64_offsets.py",
            "kernels/tests/test_cache_tiles.py",
            f"{SUITE}/test_copy_on_write_data.py",
            f"{SUITE}/test_fp8_kv.py",
            "kernels/tests/test_fp8_inputs.py",
            f"{SUITE}/test_strided_layouts.py",
            f"{SUITE}/test_layer_packed_cache.py",
        ),
    ),
    Target(
        "kernels/attention.py",
        ("launch_arg_plus_one", "grid_minus_one", "stride_assumed_dense"),
        (
            "kernels/tests/test_reads_in_bounds.py",
            f"{SUITE}/test_decode.py",
            f"{SUITE}/test_prefill.py",
            "kernels/tests/test_decode_plan.py",
            f"{SUITE}/test_strided_layouts.py",
            f"{SUITE}/test_batch_positions.py",
        ),
    ),
    Target(
        "kernels/cache_ops.py",
        ("launch_arg_plus_one", "grid_minus_one", "stride_assumed_dense"),
        (
            "kernels/tests/test_reads_in_bounds.py",
            f"{SUITE}/test_cache_ops.py",
            "kernels/tests/test_cache_tiles.py",
            f"{SUITE}/test_copy_on_write_data.py",
            f"{SUITE}/test_strided_layouts.py",
        ),
    ),
    *(Target(
        path,
        operators,
        (
            f"{SUITE}/test_block_manager.py",
            f"{SUITE}/test_block_manager_scenarios.py",
            f"{SUITE}/test_copy_on_write_data.py",
            f"{SUITE}/test_block_manager_stateful.py",
            "refengine/tests/test_block_manager_fast_paths.py",
            "refengine/tests/test_can_ever_allocate.py",
        ),
    ) for path, operators in (
        ("refengine/kv/block_manager.py", ("compare_boundary", "const_off_by_one", "skip_cow", "ref_count_off_by_one")),
        ("refengine/kv/table_growth.py", ("compare_boundary", "const_off_by_one", "skip_cow", "ref_count_off_by_one")),
        ("refengine/kv/prefix_cache.py", ("compare_boundary", "const_off_by_one")),
        ("refengine/kv/token_checks.py", ("compare_boundary", "const_off_by_one")),
    )),
    Target(
        "refengine/kv/decode_rounds.py",
        ("compare_boundary", "const_off_by_one"),
        ("refengine/tests/test_block_manager_fast_paths.py", "bench/tests/test_sim_fast_forward.py"),
    ),
    *(Target(path, operators, ("refengine/tests/test_scheduler.py", "refengine/tests/test_engine.py"))
      for path, operators in (
          ("refengine/engine/scheduler.py", ("compare_boundary", "preempt_oldest", "budget_not_charged")),
          # recording a step: its comparisons (planning's preemption and budget live in scheduler.py)
          ("refengine/engine/step_update.py", ("compare_boundary",)),
      )),
    Target(
        "refengine/model/sampling.py",
        ("compare_boundary", "const_off_by_one", "sampler_arith"),
        ("refengine/tests/test_sampler.py", "refengine/tests/test_penalties.py"),
    ),
    # the prefix cache's host tier: its LRU map and pins, the manager's two-tier lookup, the step's copies
    *(Target(
        path,
        operators,
        (
            "refengine/tests/test_host_tier_boundaries.py",
            "refengine/tests/test_prefix_offload.py",
            "refengine/tests/test_prefix_offload_faults.py",
            "refengine/tests/test_prefix_offload_stateful.py",
        ),
    ) for path, operators in (
        ("refengine/kv/host_tier.py", ("compare_boundary", "drop_guard", "eviction_order", "copy_direction")),
        ("refengine/kv/prefix_offload.py", ("const_off_by_one", "ref_count_off_by_one", "drop_guard",
                                            "range_off_by_one")),
        ("refengine/engine/prefix_offload_steps.py", ("drop_guard", "copy_direction")),
    )),
    # swap preemption: the host pool's allocator, the tables' swap-out and swap-in, the scheduler's side
    *(Target(
        path,
        operators,
        (
            "refengine/tests/test_host_tier_boundaries.py",
            "refengine/tests/test_swap_scheduling.py",
            "refengine/tests/test_swap_preemption.py",
            f"{SUITE}/test_host_block_copy.py",
            "refengine/tests/test_prefix_offload.py",
        ),
    ) for path, operators in (
        ("refengine/kv/host_pool.py", ("compare_boundary",)),
        # the host pools' size checks (torch-free, so the CLI runs them before loading)
        ("refengine/engine/host_memory_arguments.py", ("compare_boundary",)),
        ("refengine/kv/swap_tables.py", ("compare_boundary", "ref_count_off_by_one")),
        ("refengine/engine/swap_preemption.py", ("compare_boundary", "budget_not_charged", "drop_guard",
                                                 "copy_direction")),
    )),
    # tensor parallelism's cut of the weights, and the fusion of q/k/v and gate/up
    *(Target(path, operators, tests) for path, operators, tests in (
        ("refengine/parallel/linear.py", ("const_off_by_one", "range_off_by_one"), TP_TESTS),
        ("refengine/model/fused_linear.py", ("drop_guard", "range_off_by_one"), TP_TESTS[::-1]),
    )),
)
