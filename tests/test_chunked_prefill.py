"""Chunked prefill (`--max-num-batched-tokens`): a step's decode rows come first, prompts are
prefilled in chunks of the budget left, and the K/V of earlier chunks stay on the S-worker until
a prompt's last chunk. Checked: the scheduler's budget (decode rows first, every prompt token
prefilled once, unsplittable requests whole); greedy tokens equal the unchunked run's at every
chunk size, chunks splitting the R-workers' 32-token pages included, in local mode and under
mpiexec; an R-worker killed in the middle of a prefill's K/V stream ends the job naming it, with
the rows finished before kept and a rerun completing them."""
from __future__ import annotations

import json
import random

import pytest
from conftest import MPIEXEC, REPO, batch_line, read_output, run_fastdecode

PROMPT_LENS = (5, 40, 100, 77, 16, 33, 64)      # around the 32-token page: whole, split, one short


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, 20000) for _ in range(n)] for n in PROMPT_LENS]


# ---------------------------------------------------------------------------- the scheduler's budget

class FifoAll:
    def admit(self, step, waiting, running, capacity):
        return len(waiting)


def make_seq(seq_id, prompt_len, max_tokens, prompt_logprobs=None):
    from fastdecode.engine.sampling_params import SamplingParams
    from fastdecode.engine.sequence import Request, Sequence
    params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=prompt_logprobs)
    req = Request(seq_id, str(seq_id), None, [1] * prompt_len, params, 0)
    seq = Sequence(seq_id, req, 0, max_tokens)
    req.sequences.append(seq)
    return seq


def scheduler(budget, max_batch=8):
    from fastdecode.rpart.base import WorkerInfo
    from fastdecode.sched.placement import Placement
    from fastdecode.sched.scheduler import Scheduler
    place = Placement([WorkerInfo(1, "h", 1, "avx2", 1 << 30, page_tokens=32)], kv_bytes_per_token=8)
    return Scheduler(FifoAll(), place, max_batch=max_batch, max_prefill_tokens=8192,
                     max_num_batched_tokens=budget)


@pytest.mark.parametrize("seed", range(4))
def test_every_step_stays_in_budget_and_every_prompt_token_is_prefilled_once(seed):
    """Simulated steps: decode rows + prompt chunk tokens <= budget (a step may exceed it only by
    an unsplittable prompt taken alone); chunks of a prompt are contiguous and cover it once."""
    from fastdecode.engine.sequence import Status
    rng = random.Random(seed)
    budget = rng.choice((8, 13, 40))
    sched = scheduler(budget)
    seqs = [make_seq(i + 1, rng.randint(1, 120), rng.randint(1, 6),
                     prompt_logprobs=1 if rng.random() < 0.2 else None) for i in range(20)]
    for s in seqs:
        sched.add(s)
    covered = {s.seq_id: 0 for s in seqs}
    for step in range(1, 2000):
        decoding = [s for s in sched.running if s.status is Status.RUNNING]
        chunks = sched.schedule_prefill(step)
        taken = 0
        for s in chunks:
            assert s.prefill_to > s.prefilled == covered[s.seq_id]     # picks up where it stopped
            taken += s.prefill_to - s.prefilled
            covered[s.seq_id] = s.prefill_to
            whole = s.request.params.prompt_logprobs is not None
            assert not whole or (s.prefilled == 0 and s.prefill_to == s.kv_len)
            assert s.status is (Status.RUNNING if s.prefill_to == s.kv_len else Status.PREFILLING)
            s.prefilled, s.prefill_to = (0 if s.status is Status.RUNNING else s.prefill_to), 0
            if s.status is Status.RUNNING:
                s.output_ids.append(0)                           # the last chunk's token
        alone = len(chunks) == 1 and chunks[0].request.params.prompt_logprobs is not None
        assert len(decoding) + taken <= budget or alone, (step, len(decoding), taken)
        for s in decoding:                                       # decode: one token each
            s.output_ids.append(0)
            if len(s.output_ids) >= s.max_tokens:
                sched.finish(s)
        sched.drop_finished()
        if not sched.has_work():
            break
    assert not sched.has_work()
    assert all(covered[s.seq_id] == s.prompt_len for s in seqs)


def test_decode_rows_come_before_new_prompt_chunks():
    from fastdecode.engine.sequence import Status
    sched = scheduler(10)
    first, second = make_seq(1, 4, 50), make_seq(2, 30, 5)
    sched.add(first)
    assert sched.schedule_prefill(1) == [first] and first.status is Status.RUNNING
    first.prefill_to, first.output_ids = 0, [0]
    sched.add(second)
    [chunk] = sched.schedule_prefill(2)
    assert chunk is second and second.prefill_to == 9 and second.status is Status.PREFILLING   # 10 - 1 decode row


def test_a_budget_below_max_batch_is_refused():
    import torch

    from fastdecode.engine.args import EngineArgs, resolve_batch_limits
    args = EngineArgs(max_batch=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is below max_batch \(64\)"):
        resolve_batch_limits(args, torch.device("cpu"), None, torch.float32)


def test_a_budget_below_max_batch_on_the_command_line_is_a_usage_error_before_the_model_loads(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--max-batch", "8",
                           "--max-num-batched-tokens", "4"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--max-num-batched-tokens (4) is below --max-batch (8)" in proc.stderr
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------- the same tokens

@pytest.fixture(scope="module")
def unchunked():
    from fastdecode import LLM, SamplingParams
    llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", max_batch=4)
    outs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.close()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("chunk", [4, 13, 32, 45, 100])
def test_chunked_prefill_gives_the_unchunked_greedy_tokens(unchunked, chunk):
    from fastdecode import LLM, SamplingParams
    llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", max_batch=4,
              max_num_batched_tokens=chunk)
    outs = llm.generate(prompts(), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    rows, kept = llm.engine.recorder.steps, llm.engine.runner.chunk_kv
    llm.close()
    assert [o.outputs[0].token_ids for o in outs] == unchunked
    assert not kept                                   # every prompt reached its last chunk
    prefill = [r["prefill"]["tokens"] for r in rows if "prefill" in r]
    assert sum(prefill) == sum(PROMPT_LENS) and max(prefill) <= chunk     # in chunks, each token once


def test_chunked_prefill_under_mpiexec_gives_the_unchunked_tokens(tmp_path, unchunked):
    """Two R-workers: chunks continue sequences the workers already hold (PREFILL's continued ids)."""
    import subprocess
    import sys
    reqs = [{"prompt_ids": p, "params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}} for p in prompts()]
    (tmp_path / "req.json").write_text(json.dumps(reqs))
    kwargs = {"kv_dtype": "fp32", "dtype": "float32", "device": "cpu", "max_batch": 4, "max_num_batched_tokens": 13}
    proc = subprocess.run([MPIEXEC, "-n", "3", sys.executable, f"{REPO}/tests/mpi_scripts/generate_ids.py",
                           str(tmp_path / "req.json"), str(tmp_path / "out.json"), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["workers"] == 2 and [o[0] for o in got["outputs"]] == unchunked


def test_chunked_prefill_beside_the_device_tier_gives_the_unchunked_tokens(tmp_path, unchunked):
    """The GPU's tier (its torch code here) and 2 R-workers, each holding some (2 sequences' room on
    each R-worker, 3 on the tier: however the speeds measure, neither side can hold all 7): a mixed
    step's decode rows split between the tiers while prompt chunks continue in both."""
    import os
    import subprocess
    import sys
    reqs = [{"prompt_ids": p, "params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}} for p in prompts()]
    (tmp_path / "req.json").write_text(json.dumps(reqs))
    two_seqs = 2 * 64 * 45 * 1024                       # two sequences of up to 64 tokens, fp32 smollm2-135m
    kwargs = {"kv_dtype": "fp32", "dtype": "float32", "device": "cpu", "max_batch": 8, "max_num_batched_tokens": 13,
              "rworker_mem": two_seqs, "device_kv_memory": 3 * two_seqs // 2}
    proc = subprocess.run([MPIEXEC, "-n", "3", sys.executable, f"{REPO}/tests/mpi_scripts/generate_ids.py",
                           str(tmp_path / "req.json"), str(tmp_path / "out.json"), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env=dict(os.environ, FASTDECODE_DEVICE_TIER="torch"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["placed"][-1] > 0 and sum(got["placed"][:-1]) > 0, got["placed"]
    assert [o[0] for o in got["outputs"]] == unchunked


# ---------------------------------------------------------------------------- a rank dies mid-stream

def test_an_rworker_killed_mid_prefill_stream_is_named_and_nothing_finished_is_lost(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(batch_line(f"r{i}", {"prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                             for i, p in enumerate(prompts())) + "\n")
    args = ["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--max-batch", "2",
            "--max-num-batched-tokens", "16"]
    # rank 1's 4th prefill: by then at least one request has finished (its rows are in the output)
    proc = run_fastdecode(args, ranks=2, timeout=300, env={"FASTDECODE_INJECT_FAULT": "1:prefill-stream:kill:4"})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "rank 1 (R-worker pid" in proc.stderr and "killed by SIGKILL" in proc.stderr, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == 1, report
    before = {r["custom_id"]: r for r in read_output(str(out))}
    assert before and all("response" in r for r in before.values())
    proc = run_fastdecode(args + ["--quiet"], ranks=2, timeout=300)           # the rerun resumes
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = {r["custom_id"]: r for r in read_output(str(out))}
    assert sorted(after) == [f"r{i}" for i in range(len(PROMPT_LENS))]
    for cid, row in before.items():                      # kept as they were
        assert after[cid]["response"]["body"]["choices"] == row["response"]["body"]["choices"]


def test_chunked_prefill_with_preemption_gives_the_tokens_of_full_reservation():
    """--kv-reserve grow in 9 MiB of KV (three 64-token pages of fp32 SmolLM2 per layer): sequences
    are preempted and their prompt + output prefilled again, in chunks."""
    from fastdecode import LLM, SamplingParams
    prompts = ["Story number 1: once upon a time", "Story number 2: once upon a time",
               "Story number 3: once upon a time"]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    got = {}
    for policy, chunk in (("full", None), ("grow", 16)):
        llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", rworker_mem=9 * 2 ** 20,
                  kv_reserve=policy, max_batch=4, max_num_batched_tokens=chunk)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[policy] = ([o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions,
                       llm.engine.num_recomputed_tokens, llm.engine.runner.chunk_kv)
        llm.close()
    (full, _, _, _), (grow, preemptions, recomputed, kept) = got["full"], got["grow"]
    assert preemptions >= 1 and recomputed >= 64 and not kept
    assert grow == full
