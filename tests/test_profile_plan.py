"""`fastdecode profile` under mpiexec writes a profile that `fastdecode plan` reads."""
from __future__ import annotations

import json
import re

import pytest
from conftest import run_fastdecode

from fastdecode.cli import build_parser


def test_profile_under_mpi_then_plan(tmp_path):
    prof = tmp_path / "profile.json"
    proc = run_fastdecode(["profile", "-o", str(prof), "--batches", "1,8,32", "--r-bytes", "8M",
                           "--r-seqs", "16", "--repeats", "2", "--kv-dtype", "bf16", "--prompt-lens", "16,64",
                           "--max-prefill-tokens", "256", "--device-kv"], ranks=3, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(prof.read_text())
    assert data["schema"] == "fastdecode-profile/1"
    assert data["s_worker"]["batch_grid"] == [1, 8, 32]
    assert data["s_worker"]["prefill_prompt_len"] == [16, 64]
    assert all(t > 0 for t in data["s_worker"]["prefill_token_s"])
    # chunk sizes: a quarter of the table's chunk, it, four times it, all capped at --max-prefill-tokens
    assert data["s_worker"]["prefill_chunk"] == 256
    assert data["s_worker"]["prefill_chunk_grid"] == [128, 256]
    assert all(t > 0 for t in data["s_worker"]["prefill_chunk_token_s"])
    assert all(t > 0 for t in data["s_worker"]["layer_time_s"] + data["s_worker"]["head_time_s"])
    assert [w["name"].split("@")[0] for w in data["r_workers"]] == ["rank1", "rank2"]
    assert all(w["seconds_per_kv_byte"] > 0 and w["capacity_bytes"] > 0 for w in data["r_workers"])
    # the R-part as paid inside decode steps, the kernel alone beside it
    assert all(w["kernel_seconds_per_kv_byte"] > 0 and w["call_overhead_s"] >= 0 for w in data["r_workers"])
    assert data["link"]["device_d2h_Bps"] == 0          # a CPU S-worker has no PCIe hop
    assert data["link"]["bandwidth_Bps"] > 0 and data["link"]["latency_s"] > 0   # real MPI messages
    assert 0 <= data["link"]["hop_s"] < 1.0             # chain hand-offs, measured (0 if none showed)
    link = data["link"]                                 # each R-worker's own table, the slowest heading them
    assert [n.split("@")[0] for n in link["worker_names"]] == ["rank1", "rank2"]
    assert all(len(t) == len(link["message_bytes"]) for t in link["worker_message_time_s"])
    assert link["message_time_s"] in link["worker_message_time_s"] and link["concurrent_Bps"] > 0
    assert data["kv_dtype_bytes"] == 2 and data["model"]["num_layers"] == 30
    # the CPU S-worker's own store beside the R-workers (--device-kv): kept apart, off the link
    tier = data["device_tier"]
    assert tier["kind"] == "local" and tier["capacity_bytes"] > 0 and tier["seconds_per_kv_byte"] > 0
    assert tier["kernel_seconds_per_kv_byte"] > 0
    plan = run_fastdecode(["plan", "--profile", str(prof), "--context", "128", "--batch", "32",
                           "--rworkers", "2", "--json"], timeout=120)
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)
    for key in ("rworkers_needed", "step_latency_s", "tokens_per_s", "bound", "kv_tokens_capacity",
                "tier_sequences", "rworker_sequences", "tier_split"):
        assert key in out
    assert out["bound"] in ("S", "R", "link", "capacity")
    assert out["tier_sequences"] + out["rworker_sequences"] == out["batch_run"] == 32
    assert out["device_tier"]["kind"] == "local"
    assert abs(out["tokens_per_s"] * out["step_latency_s"] - 32) < 1e-6 * 32   # B tokens per step


def test_plan_bad_input_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    proc = run_fastdecode(["plan", "--profile", str(bad), "--batch", "8"], timeout=60)
    assert proc.returncode == 2 and "cannot read" in proc.stderr


@pytest.fixture(scope="module")
def local_profile(tmp_path_factory):
    """A full (not --quick) profile in local mode on a tiny grid: (path, the run)."""
    prof = tmp_path_factory.mktemp("profile") / "local.json"
    proc = run_fastdecode(["profile", "-o", str(prof), "--batches", "1,8", "--r-bytes", "4M", "--r-seqs", "8",
                           "--repeats", "1", "--prompt-lens", "16", "--max-prefill-tokens", "64"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return prof, proc


def test_local_profile_has_no_link_table_and_plans(local_profile):
    """Local mode (no MPI): the R-part reads the S-part's arrays, so the link is free and
    untabulated; the profile must still be one that plan accepts."""
    prof, _ = local_profile
    data = json.loads(prof.read_text())
    link = data["link"]
    assert data["device_tier"] is None                 # -n 1 on a CPU: the in-process store is the whole R-part
    assert link["message_bytes"] == link["message_time_s"] == []
    assert link["hop_s"] == 0                           # no hand-offs between ranks
    plan = run_fastdecode(["plan", "--profile", str(prof), "--context", "32", "--batch", "8", "--json"], timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["bound"] in ("S", "R")


def test_a_device_tier_beside_local_modes_store_is_profiled_apart(tmp_path):
    """-n 1 with the GPU's tier (its torch code on this CPU): the host's store is the R-part, in
    this process (local mode: no link, no hand-offs), and the tier is timed and kept apart."""
    prof = tmp_path / "tiered.json"
    proc = run_fastdecode(["profile", "-o", str(prof), "--batches", "1,4", "--r-bytes", "2M", "--r-seqs", "4",
                           "--repeats", "1", "--prompt-lens", "16", "--max-prefill-tokens", "64",
                           "--device-kv-memory", "32M"], timeout=600, env={"FASTDECODE_DEVICE_TIER": "torch"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(prof.read_text())
    assert [w["name"].split("@")[0] for w in data["r_workers"]] == ["rank0"]
    tier = data["device_tier"]
    assert tier["kind"] == "device" and tier["name"].startswith("device") and not tier["frees_windows"]
    assert 0 < tier["capacity_bytes"] <= 32 << 20 and tier["seconds_per_kv_byte"] > 0
    assert data["link"]["message_bytes"] == [] and data["link"]["hop_s"] == 0
    assert "S-worker's own KV tier device" in proc.stderr
    plan = run_fastdecode(["plan", "--profile", str(prof), "--context", "32", "--batch", "8", "--rworkers", "0",
                           "--json"], timeout=120)
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)
    assert out["rworker_sequences"] == 0 and out["tier_sequences"] == out["batch_run"] > 0


def test_profile_keeps_to_the_rworker_memory(tmp_path):
    """A profile run with the job's small --rworker-mem times only what that memory holds, as the
    job would run it, instead of failing on a refused append. fp32 KV of smollm2-135m is
    46,080 bytes per token, so 12 MiB less a tenth holds 245 tokens: 7 one-page (32-token)
    sequences of the S-part timing (B = 8 and 64 are left out), 3 prompts of 64 tokens (the
    256-token chunk is capped at 192) and one 128-token prompt (the chunk table's prompt)."""
    prof = tmp_path / "small.json"
    proc = run_fastdecode(["profile", "-o", str(prof), "--batches", "1,8,64", "--r-bytes", "4M", "--r-seqs", "4",
                           "--repeats", "1", "--prompt-lens", "16,64", "--max-prefill-tokens", "256",
                           "--kv-dtype", "fp32", "--rworker-mem", "12M"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(prof.read_text())
    assert data["s_worker"]["batch_grid"] == [1]
    assert "B=8,64 left out" in proc.stdout + proc.stderr
    assert data["s_worker"]["prefill_chunk_grid"] == [128]
    assert "chunk=   192" in proc.stdout + proc.stderr
    assert data["r_workers"][0]["page_tokens"] == 32 and data["r_workers"][0]["capacity_bytes"] == 12 << 20
    too_small = run_fastdecode(["profile", "-o", str(tmp_path / "none.json"), "--batches", "1",
                                "--kv-dtype", "fp32", "--rworker-mem", "1M"], timeout=300)
    assert too_small.returncode == 1 and "--rworker-mem too small" in too_small.stderr
    assert not (tmp_path / "none.json").exists()


def key_paths(obj, prefix: str = "") -> set[str]:
    """Every key of a JSON document as a path (list items merged), for a schema comparison."""
    if isinstance(obj, dict):
        return set().union(*([{prefix + k} | key_paths(v, prefix + k + ".") for k, v in obj.items()] or [set()]))
    if isinstance(obj, list):
        return set().union(*([key_paths(v, prefix + "[].") for v in obj] or [set()]))
    return set()


ESTIMATE = re.compile(r"^profile: about (\d+) s to run \(S-part \d+ s, prefill \d+ s, R-workers \d+ s, link \d+ s; "
                      r"from a [\d.]+ s calibration\)", re.MULTILINE)


def test_quick_profile_has_the_full_schema_and_says_its_time_first(local_profile, tmp_path):
    """--quick on a grid smaller still (its own takes about a minute on this model here): the
    same keys as the full profile's, the estimate printed before the first timing, the time
    taken printed at the end, and the full profile printed an estimate too."""
    full, full_run = local_profile
    quick = tmp_path / "quick.json"
    proc = run_fastdecode(["profile", "--quick", "-o", str(quick), "--batches", "1,4", "--r-bytes", "4M",
                           "--prompt-lens", "16", "--max-prefill-tokens", "64"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = json.loads(quick.read_text()), json.loads(full.read_text())
    assert key_paths(got) == key_paths(want)
    assert got["s_worker"]["batch_grid"] == [1, 4] and got["s_worker"]["prefill_chunk"] == 64
    for run in (proc, full_run):
        first = ESTIMATE.search(run.stderr)
        assert first, run.stderr[-2000:]
        assert first.start() < run.stderr.index("S-part  B=")
        assert re.search(r"^profile: took \d+ s \(estimated \d+ s\)", run.stderr, re.MULTILINE), run.stderr[-2000:]
    assert "--quick takes a smaller grid" in full_run.stderr and "--quick takes" not in proc.stderr


def test_quick_settings_give_way_to_explicit_options():
    """--quick's grid and repetitions, an option given explicitly on top; without --quick the full
    profile's (None: the device's grid, resolved on rank 0)."""
    from fastdecode.sizing.profile_cli import settings_of
    args = build_parser().parse_args(["profile", "--quick", "--repeats", "2"])
    st = settings_of(args, cuda=False)
    assert (st.batches, st.prompt_lens, st.repeats, st.r_seqs) == ([1, 16, 64], [16, 128], 2, 8)
    full = settings_of(build_parser().parse_args(["profile"]), cuda=False)
    assert (full.batches, full.prompt_lens, full.repeats, full.r_seqs, full.r_bytes) == (None, None, 3, 64, 0)


def test_profile_help_lists_only_what_profile_uses():
    def options(command: str) -> set[str]:
        sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
        return {o for a in sub._actions for o in a.option_strings}

    generate_only = {"--max-batch", "--max-model-len", "--kv-reserve", "--seed", "--schedule", "--target-batch",
                     "--admit-every", "--max-gen", "--stabilize-lengths", "--quiet", "--stats-json"}
    assert generate_only <= options("generate")
    assert not generate_only & options("profile")
    assert {"--quick", "--batches", "--rworker-mem", "--max-prefill-tokens", "--pipeline-depth"} <= options("profile")
