"""What plan says before a long job, where it used to mislead: weights past the job's GPU budget
(0.9 x the card, generate's --gpu-memory-utilization) are named as a job that would not start; the
generated length is --output-len, after the prompt, as the target line says; one --batch is planned
at its best pipeline depth, named where it is not generate's default; and a profile measured with
more ranks than cores on the node says that its plans run fast there, in the plan's header."""
from __future__ import annotations

import json
import types

from fastdecode.sizing import plan
from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile
from fastdecode.sizing.schema import MODEL_PRESETS, Profile

L70_FP8 = ["--model", "llama-3-70b", "--gpu-profile", "h100", "--quantization", "fp8", "--cpu-bw", "400",
           "--batch", "256"]
GPU_ONLY = ["--model", "llama-3-8b", "--gpu-profile", "h100", "--rworkers", "0", "--batch", "256"]


def plan_out(capsys, *argv: str) -> str:
    assert plan.main(list(argv)) == 0
    return capsys.readouterr().out


def test_weights_past_the_jobs_gpu_budget_say_the_job_would_not_start(capsys):
    out = plan_out(capsys, *L70_FP8)
    assert "72.7 GB of weights per GPU exceed the job's budget of 72 GB (0.9 x the GPU's 80 GB" in out
    assert "the job would not start" in out and "--tensor-parallel-size" in out
    assert "exceed" not in plan_out(capsys, *L70_FP8, "--tensor-parallel-size", "2")


def test_the_generated_length_is_output_len_after_the_prompt(capsys):
    out = plan_out(capsys, *GPU_ONLY, "--output-len", "512", "--prompt-len", "3584")
    assert "each sequence a 3584-token prompt, then S = 512 generated tokens" in out
    assert "vLLM's --max-model-len would be 4096" in out
    assert plan_out(capsys, *GPU_ONLY, "--context", "512", "--prompt-len", "3584") == out    # the old name stays


def test_one_batch_is_planned_at_its_best_depth_and_the_flag_is_named(capsys):
    row = json.loads(plan_out(capsys, *GPU_ONLY, "--json"))
    assert row["tokens_per_s"] >= row["tokens_per_s_depth1"]          # never the slower of the two
    assert row["pipeline_depth"] == 1 and row["tokens_per_s_depth2"] < row["tokens_per_s"]
    out = plan_out(capsys, *GPU_ONLY)
    assert f"run generate with --pipeline-depth 1: its default, 2, gives {row['tokens_per_s_depth2']:,.0f}" in out
    stated = json.loads(plan_out(capsys, *GPU_ONLY, "--pipeline-depth", "2", "--json"))
    assert stated["pipeline_depth"] == 2 and "run generate" not in plan_out(capsys, *GPU_ONLY, "--pipeline-depth", "2")


def test_a_profile_of_ranks_sharing_cores_says_its_plans_run_fast(tmp_path, capsys, monkeypatch):
    import rworker.host.threads as threads
    from fastdecode.sizing.profile import shared_cores_note
    monkeypatch.setattr(threads, "physical_cpus", lambda cpus=None: [0, 1])
    crowded, roomy = (types.SimpleNamespace(layout=(n, 1, 0)) for n in (3, 2))
    note = shared_cores_note(crowded, "devbox")
    assert note.startswith("the 3 ranks on devbox share its 2 physical cores") and "cannot measure" in note
    assert shared_cores_note(roomy, "devbox") == ""
    prof = stated_profile(GPU_PRESETS["a10"], MODEL_PRESETS["smollm2-135m"], 20, 64)
    prof.source, prof.cores_shared = "measured", note
    path = tmp_path / "profile.json"
    path.write_text(prof.to_json())
    assert Profile.from_json(path.read_text()).cores_shared == note
    assert f"warning: {note}" in plan_out(capsys, "--profile", str(path), "--batch", "16")
