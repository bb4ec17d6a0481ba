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

def test_groups_are_contiguous_and_the_larger_come_first():
    roles = Roles(5, 1, 2)
    assert [list(roles.group_ranks(g)) for g in range(2)] == [[0, 1, 2], [3, 4]]
    assert roles.leaders() == [0, 3] and [roles.group_of(r) for r in range(5)] == [0, 0, 0, 1, 1]
    assert [roles.is_rworker(r) for r in range(5)] == [False, True, True, False, True]
    assert roles.name(3) == "S-worker of group 1" and roles.name(4) == "R-worker of group 1"
    local, at = roles.local(4)
    assert (local.world, local.s_ranks, at) == (2, 1, 1)


def test_a_group_without_rworkers_holds_its_kv_and_tensor_parallel_groups_keep_their_ranks():
    two = Roles(2, 1, 2)                       # two local-mode S-workers
    assert [two.holds_kv(r) for r in range(2)] == [True, True]
    tp = Roles(6, 2, 2)                        # groups of 3: S-ranks 0-1 and 3-4, R-workers 2 and 5
    assert [tp.name(r) for r in range(6)] == [
        "S-worker of group 0", "tensor-parallel S-rank of group 0", "R-worker of group 0",
        "S-worker of group 1", "tensor-parallel S-rank of group 1", "R-worker of group 1"]
    assert [tp.holds_kv(r) for r in range(6)] == [False, False, True, False, False, True]
    one = Roles(3)                             # one group: as before
    assert one.name(0) == "S-worker" and one.name(2) == "R-worker" and list(one.rworkers) == [1, 2]


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


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_two_groups_serve_one_input_into_one_output_with_hf_greedy_text(tmp_path, hf_texts, ranks):
    """2: two local-mode S-workers; 3: group 0 with an R-worker, group 1 alone; 4: one R-worker each."""
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


def test_a_stop_reaches_both_groups_and_the_rerun_continues_them(tmp_path, hf_texts):
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = write_input(inp, copies=3)
    flags = ["generate", "-i", str(inp), "-o", str(out), "-dp", "2", *FLAGS]
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
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts = write_input(inp, copies=3)
    flags = ["generate", "-i", str(inp), "-o", str(out), "-dp", "2", *FLAGS]
    killed = run_fastdecode(flags, ranks=4, timeout=600, env={"FASTDECODE_INJECT_FAULT": "2:step:kill:40"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert "rank 2" in killed.stderr and "S-worker of group 1" in killed.stderr, killed.stderr[-3000:]
    kept = read_output(out)
    assert 0 < len(kept) < len(prompts)
    assert all(texts_by_id(kept)[r["custom_id"]] == hf_texts[prompts[int(r["custom_id"][1:])]] for r in kept)
    again = run_fastdecode(flags, ranks=4, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert texts_by_id(read_output(out)) == {f"r{i}": hf_texts[p] for i, p in enumerate(prompts)}
