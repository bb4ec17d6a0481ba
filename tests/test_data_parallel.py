"""Data-parallel S-worker groups (`--data-parallel-size D`): the ranks' groups and names, the flag's
checks, and one input served into one output by two groups under mpiexec: greedy text equal to HF
transformers' (float32), each line answered exactly once, both groups serving; a stop reaches
both groups and the rerun continues their sequences; a group's S-worker killed mid-job loses no
written row and the rerun completes the job."""
from __future__ import annotations

import json

import pytest
from conftest import MPIEXEC, batch_line, hf_greedy, read_output, run_fastdecode, stop_after_rows

from fastdecode.launch.groups import group_error
from fastdecode.launch.ranks import Roles

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):\n", "Once upon a time",
           "The best way to learn is", "My favourite food is", "In 1969, the first", "Water boils at"]
MAX_TOKENS = 16
FLAGS = ["--quiet", "--dtype", "float32", "--kv-dtype", "fp32", "--max-batch", "2"]


# ---------------------------------------------------------------------------- roles (no MPI)

def test_the_s_workers_come_first_then_each_group_s_block_of_rworkers():
    roles = Roles(5, 1, 2)                     # S-workers 0 and 1; R-workers 2, 3 (group 0) and 4 (group 1)
    assert [roles.group_ranks(g) for g in range(2)] == [[0, 2, 3], [1, 4]]
    assert roles.leaders() == [0, 1] and [roles.group_of(r) for r in range(5)] == [0, 1, 0, 0, 1]
    assert [roles.is_rworker(r) for r in range(5)] == [False, False, True, True, True]
    assert roles.name(1) == "S-worker of group 1" and roles.name(4) == "R-worker of group 1"
    local, at = roles.local(4)
    assert (local.world, local.s_ranks, at) == (2, 1, 1)
    assert roles.rworkers == [2, 3]            # group 0's


def test_a_group_without_rworkers_holds_its_kv_and_tensor_parallel_groups_keep_their_ranks():
    two = Roles(2, 1, 2)                       # two local-mode S-workers
    assert [two.holds_kv(r) for r in range(2)] == [True, True]
    tp = Roles(6, 2, 2)                        # S-ranks 0-1 (group 0) and 2-3 (group 1); R-workers 4 and 5
    assert [tp.name(r) for r in range(6)] == [
        "S-worker of group 0", "tensor-parallel S-rank of group 0", "S-worker of group 1",
        "tensor-parallel S-rank of group 1", "R-worker of group 0", "R-worker of group 1"]
    assert [tp.holds_kv(r) for r in range(6)] == [False, False, False, False, True, True]
    assert tp.group_ranks(1) == [2, 3, 5] and tp.local(5) == (Roles(3, 2), 2)
    one = Roles(3)                             # one group: as before
    assert one.name(0) == "S-worker" and one.name(2) == "R-worker" and one.rworkers == [1, 2]


def test_too_few_ranks_for_the_groups_is_named():
    assert group_error(1, 1, 1) is None and group_error(2, 1, 2) is None and group_error(2, 2, 4) is None
    error = group_error(2, 2, 3)
    assert "--data-parallel-size 2 needs at least 4 MPI ranks" in error and "this job has 3" in error


def test_a_singleton_with_two_groups_exits_2_naming_the_ranks(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o.jsonl"), "-dp", "2"], timeout=300)
    assert proc.returncode == 2 and "--data-parallel-size 2 needs at least 2 MPI ranks" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------- two groups under mpiexec

def write_input(path, copies: int = 2) -> list[str]:
    """The prompts `copies` times over (distinct custom_ids); -> the prompts by line."""
    prompts = PROMPTS * copies
    path.write_text("".join(batch_line(f"r{i}", {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}) + "\n"
                            for i, p in enumerate(prompts)))
    return prompts


@pytest.fixture(scope="module")
def hf_texts(hf_smollm):
    tok, model = hf_smollm
    out = {}
    for p in PROMPTS:
        ids = hf_greedy(model, tok(p)["input_ids"], MAX_TOKENS, [tok.eos_token_id])
        out[p] = tok.decode(ids, skip_special_tokens=True)
    return out


def texts_by_id(rows) -> dict[str, str]:
    ids = [r["custom_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a line answered twice"
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows}


@pytest.mark.parametrize("ranks", [2, 3, 4], ids=["two_local", "local_and_rworker", "each_with_an_rworker"])
def test_two_groups_serve_one_input_into_one_output_with_hf_greedy_text(tmp_path, hf_texts, ranks):
    """2: two local-mode S-workers; 3: group 0 with an R-worker (rank 2), group 1 alone; 4: one R-worker
    each (ranks 2 and 3)."""
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = write_input(inp)
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "-dp", "2", *FLAGS], ranks=ranks, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = texts_by_id(read_output(out))
    assert got == {f"r{i}": hf_texts[p] for i, p in enumerate(prompts)}
    assert [r["custom_id"] for r in read_output(out)] == [f"r{i}" for i in range(len(prompts))]   # input order
    run = json.loads((tmp_path / "out.jsonl.summary.json").read_text())["this_run"]
    groups = run["data_parallel_groups"]
    assert [g["group"] for g in groups] == [0, 1] and all(g["requests"] > 0 for g in groups), groups
    assert sum(g["requests"] for g in groups) == run["requests"] == len(prompts)
    assert sum(g["output_tokens"] for g in groups) == run["output_tokens"] == MAX_TOKENS * len(prompts)


def two_group_job(tmp_path) -> tuple[list[str], object, list[str]]:
    """A 24-line input for two groups: (its prompts by line, the output's path, generate's argv)."""
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = write_input(inp, copies=3)
    return prompts, out, ["generate", "-i", str(inp), "-o", str(out), "-dp", "2", *FLAGS]


def test_a_stop_reaches_both_groups_and_the_rerun_continues_them(tmp_path, hf_texts):
    prompts, out, flags = two_group_job(tmp_path)
    code, err = stop_after_rows(flags, 4, out, 3)       # rank 0 relays the stop to group 1
    assert code == 75, err[-3000:]
    assert "sequence(s) in flight" in err, err[-3000:]
    done_before = len(read_output(out))
    assert done_before < len(prompts)
    again = run_fastdecode(flags, ranks=4, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert texts_by_id(read_output(out)) == {f"r{i}": hf_texts[p] for i, p in enumerate(prompts)}
    run = json.loads((tmp_path / "out.jsonl.summary.json").read_text())["this_run"]
    assert run["continued_sequences"] > 0 and run["requests"] == len(prompts) - done_before


def test_a_group_killed_mid_job_loses_no_row_and_the_rerun_completes(tmp_path, hf_texts):
    prompts, out, flags = two_group_job(tmp_path)
    killed = run_fastdecode(flags, ranks=4, timeout=600, env={"FASTDECODE_INJECT_FAULT": "1:step:kill:40"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert "rank 1 (S-worker of group 1" in killed.stderr, killed.stderr[-3000:]
    kept = read_output(out)
    assert 0 < len(kept) < len(prompts)
    assert all(texts_by_id(kept)[r["custom_id"]] == hf_texts[prompts[int(r["custom_id"][1:])]] for r in kept)
    again = run_fastdecode(flags, ranks=4, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert texts_by_id(read_output(out)) == {f"r{i}": hf_texts[p] for i, p in enumerate(prompts)}


def test_groups_on_one_node_share_its_cpus_and_gpus():
    from fastdecode.launch.groups import cpu_share, gpu_share
    assert [cpu_share([0, 1, 2, 3, 4], at, 2) for at in range(2)] == [[0, 1], [2, 3, 4]]
    assert [cpu_share([0, 1], at, 3) for at in range(3)] == [[0], [1], [1]]      # more groups than CPUs
    assert [gpu_share(["0", "1", "2", "3"], at, 2) for at in range(2)] == [["0", "1"], ["2", "3"]]
    assert gpu_share(["4", "5"], 1, 1) == ["5"] and gpu_share(["0"], 1, 1) == ["0"]


# ---------------------------------------------------------------------------- plan and simulate

def test_plan_gives_the_job_of_d_groups():
    from fastdecode.sizing.plan import main as plan_main
    import contextlib
    import io
    flags = ["--gpu-profile", "h100", "--model", "llama-3-8b", "--cpu-bw", "150", "--rworkers", "4", "--json",
             "--batch", "512"]
    outs = []
    for d in ("1", "3"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert plan_main(flags + ["--data-parallel-size", d]) == 0
        outs.append(json.loads(buf.getvalue()))
    one, three = outs
    assert three["tokens_per_s"] == one["tokens_per_s"]                  # each group is the plan
    assert three["job_tokens_per_s"] == round(3 * one["tokens_per_s"], 1) and three["job_rworkers"] == 12


def test_simulate_deals_the_requests_to_d_groups_and_ends_with_the_last():
    from fastdecode.sim.cli import simulate_args
    from fastdecode.sim.cli import add_parser
    import argparse
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    flags = ["simulate", "--gpu-profile", "h100", "--model", "llama-3-8b", "--cpu-bw", "150", "--rworkers", "2",
             "--requests", "301", "--output-len", "uniform:32:256", "--seed", "3"]
    one = simulate_args(parser.parse_args(flags))["summary"]
    two = simulate_args(parser.parse_args(flags + ["-dp", "2"]))["summary"]
    groups = two["data_parallel_groups"]
    assert [g["requests"] for g in groups] == [151, 150]
    assert two["requests"] == one["requests"] == 301 and two["output_tokens"] == one["output_tokens"]
    assert two["wall_s"] == max(g["wall_s"] for g in groups) < one["wall_s"]
    assert two["output_tokens_per_s"] == round(two["output_tokens"] / two["wall_s"], 3)


def test_the_python_api_refuses_several_groups_naming_the_command_that_serves_them():
    from fastdecode import LLM
    with pytest.raises(ValueError, match="data_parallel_size=2 is not supported by fastdecode: the Python API serves "
                                         "one S-worker group; `fastdecode generate --data-parallel-size D`"):
        LLM("smollm2-135m", data_parallel_size=2)


def test_two_tensor_parallel_groups_give_one_rank_s_greedy_text(tmp_path_factory, tmp_path):
    """D = 2, T = 2 (mpiexec -n 4: S-ranks 0-1 and 2-3, each group's KV in its own tier) on a tiny
    random Llama whose heads split in two: the texts of T = 1 in local mode (itself held to HF's
    by test_tensor_parallel and test_hf_parity)."""
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    from family_cases import save_tokenizer
    from test_tensor_parallel import build_llama
    model, _ = build_llama(tmp_path_factory.mktemp("dp-tp"), "llama", vocab=512)
    save_tokenizer(model)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": f"{p} {i}", "max_tokens": 10, "temperature": 0,
                                                "ignore_eos": True}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    common = ["generate", "-m", str(model), "-i", str(inp), "--quiet", "--dtype", "float32", "--kv-dtype", "fp32",
              "--max-batch", "2"]
    one = run_fastdecode(common + ["-o", str(tmp_path / "one.jsonl")], timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    four = run_fastdecode(common + ["-o", str(tmp_path / "dp.jsonl"), "-dp", "2", "-tp", "2"], ranks=4, timeout=600)
    assert four.returncode == 0, four.stderr[-3000:]
    assert texts_by_id(read_output(tmp_path / "dp.jsonl")) == texts_by_id(read_output(tmp_path / "one.jsonl"))
    groups = json.loads((tmp_path / "dp.jsonl.summary.json").read_text())["this_run"]["data_parallel_groups"]
    assert all(g["requests"] > 0 for g in groups), groups


def test_a_silent_rworker_of_group_1_is_named_by_its_world_rank(tmp_path):
    """Ranks inside a group are numbered as in a job of its own; what the job says names world ranks:
    group 1's R-worker (rank 3 of -n 4) hangs at its first decode, found silent within --timeout."""
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(inp)
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "-dp", "2", *FLAGS, "--timeout", "5"], ranks=4,
                          timeout=600, env={"FASTDECODE_INJECT_FAULT": "3:decode:hang"})
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "rank 3 (R-worker of group 1" in proc.stderr, proc.stderr[-3000:]
