"""`plan` prints its measured fidelity next to its prediction: the package's table is what the
committed results in bench/sizing/results give (derived, never typed), and plan picks the row of
its S-worker and bound."""
from __future__ import annotations

import importlib.util
import json
import os

from conftest import REPO, run_fastdecode

from fastdecode.sizing.fidelity import derive
from fastdecode.sizing.fidelity_table import FIDELITY

RESULTS = os.path.join(REPO, "bench", "sizing", "results")


def test_the_table_is_what_the_committed_results_give():
    assert derive(RESULTS) == FIDELITY
    spec = importlib.util.spec_from_file_location("fidelity_table_script",
                                                  os.path.join(REPO, "bench", "sizing", "fidelity_table.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with open(os.path.join(REPO, "fastdecode", "sizing", "fidelity_table.py")) as f:
        assert f.read() == script.render(derive(RESULTS))          # the file is the script's output, unedited
    # every plan-fidelity file counts, in its rows and in the per-kind totals
    files = {name.removesuffix(".json") for name in os.listdir(RESULTS)
             if "fidelity_" in name and name.endswith(".json") and not name.startswith("sim_")}
    assert set(FIDELITY[("cpu", "any")]["results"]) | set(FIDELITY[("gpu", "any")]["results"]) == files
    for kind in ("cpu", "gpu"):
        assert FIDELITY[(kind, "any")]["runs"] == sum(row["runs"] for (k, b), row in FIDELITY.items()
                                                      if k == kind and b != "any")


def test_plan_from_a_measured_profile_says_where_it_has_been_off(tmp_path):
    with open(os.path.join(RESULTS, "fidelity_devbox-2core.json")) as f:
        doc = json.load(f)
    run = doc["runs"][0]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc["profiles"][run["profile"]]))
    argv = ["plan", "--profile", str(profile), "--batch", str(run["batch"]), "--context", str(run["gen_len"]),
            "--prompt-len", str(run["prompt_len"])]
    proc = run_fastdecode([*argv, "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    row = FIDELITY[("cpu", out["bound"])]
    assert out["fidelity"] == {"s_worker": "cpu", "bound": out["bound"], "measured_profile": True, **row}
    proc = run_fastdecode(argv, timeout=120)
    last = proc.stdout.strip().splitlines()[-1]
    lo, hi = (f"{100 * x:+.0f}%" for x in row["step_latency_error"])
    assert last.startswith(f"fidelity: plans bound by {out['bound']} on a CPU S-worker have been off by {lo} to {hi} "
                           f"in step latency"), last
    assert f"{row['runs']} runs in bench/sizing/results)" in last


def test_plan_from_stated_hardware_says_its_error_is_its_own():
    proc = run_fastdecode(["plan", "--model", "llama-2-7b", "--gpu-profile", "a10", "--cpu-bw", "150",
                           "--batch", "512", "--json"], timeout=120)
    fid = json.loads(proc.stdout)["fidelity"]
    assert fid["s_worker"] == "gpu" and fid["measured_profile"] is False
    sweep = run_fastdecode(["plan", "--model", "llama-2-7b", "--gpu-profile", "a10", "--cpu-bw", "150"], timeout=120)
    last = sweep.stdout.strip().splitlines()[-1]
    assert last.startswith("at the knee (batch ") and "stated hardware adds its own error" in last, last
