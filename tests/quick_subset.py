"""The quick subset (`pytest -m quick`): the unit tests, which start no process and load no
model, and one end-to-end run per launcher (local mode, MPICH's or Open MPI's mpiexec, srun
where SLURM is installed); a few minutes on 2 cores where the whole suite takes hours. CI runs
everything. A new file of unit tests joins by its name here; a test of one that starts a job
does not belong in it.
"""
from __future__ import annotations

import os

import pytest

# files whose every test is a unit test (seconds in all, no `mpiexec`, no engine)
UNIT_FILES = (
    "test_attn_variants_plumbing.py", "test_balance.py", "test_cpu_defaults.py", "test_eta.py", "test_families_gguf.py",
    "test_logits_refine.py",
    "test_families_spart.py", "test_fp8.py", "test_fused_ops.py", "test_inflight_kv.py", "test_int8_kernel.py",
    "test_int8_kernel_inputs.py", "test_kv_cap_line.py", "test_kv_export.py", "test_kv_extents.py", "test_kv_tiers.py",
    "test_kv_transfer.py", "test_kvstore.py", "test_kvstore_limits.py", "test_layout.py", "test_length_model.py",
    "test_moe.py", "test_packed_weights.py", "test_shm_link.py",
    "test_plan_balance.py", "test_prefix_store.py", "test_prompt_kernel.py", "test_request_memory.py", "test_runner.py",
    "test_simulate.py", "test_simulate_cli.py", "test_simulate_tiers.py", "test_sizing.py",
    "test_sizing_families.py", "test_sizing_link.py", "test_sizing_sharing.py", "test_sizing_tiers.py",
    "test_window_placement.py", "test_window_store.py",
)
# one end-to-end run per launcher: the same input served in local mode, under mpiexec -n 2 and -n 3
# (one module fixture, three jobs), and a real job under srun (skipped without SLURM)
END_TO_END = (
    "test_cli.py::test_every_line_answered_in_input_order",
    "test_cli.py::test_bad_lines_get_400_and_good_lines_are_served",
    "test_cli.py::test_same_output_with_one_or_two_rworkers_and_local",
    "test_slurm.py::test_single_one_node_srun_pmi2_real_fastdecode",
)


def is_quick(nodeid: str) -> bool:
    path, _, name = nodeid.partition("::")
    file = os.path.basename(path)
    return file in UNIT_FILES or f"{file}::{name.split('[')[0]}" in END_TO_END


def mark(items) -> None:
    for item in items:
        if is_quick(item.nodeid):
            item.add_marker(pytest.mark.quick)
