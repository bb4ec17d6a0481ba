"""Shared prompt prefixes (issue 32), the S-worker's side: prompts that start with whole KV pages a
running sequence holds are placed on its R-worker, fork those pages there and prefill only the rest.

Checked: the S-side bookkeeping over random arrivals, stops and preemptions (tests/prefix_sim.py:
every sequence's pages hold its tokens, pages in use fit what placement reserves, nothing is left
at the end); which prompts share what; and on the embedded model, greedy tokens equal to a run
without sharing for a shared system prompt with varied questions and n samples, when the donor
ends before or after its members fork, under preemption, with chunked prefill, under mpiexec, and
through `generate` (the summary counts the hits; a resumed job shares too)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from conftest import MPIEXEC, REPO, batch_line, read_output, run_fastdecode
from prefix_sim import PAGE, PrefixSim, family_prompts

# ---------------------------------------------------------------------------- bookkeeping, no model


@pytest.mark.parametrize("seed", range(24))
def test_random_arrivals_stops_and_preemptions_keep_pages_tokens_and_reservations_consistent(seed):
    rng = random.Random(seed)
    grow = seed % 2 == 1
    sim = PrefixSim(rng, workers=1 + seed % 3, capacity_tokens=rng.choice((64, 96)) if grow else 4096,
                    policy="grow" if grow else "full", budget=rng.choice((None, 8, 20)),
                    budget_tokens=rng.choice((8, 64, 256)), max_batch=rng.choice((4, 16)))
    for prompt in family_prompts(rng, rng.randint(1, 3), 30):
        sim.add(prompt, rng.randint(1, 30), n=rng.choice((1, 1, 3)),
                prompt_logprobs=1 if rng.random() < 0.05 else None)
    sim.run(stop_p=0.03)                 # checks after every step
    sim.assert_empty()
    assert sim.prefix.hits == sim.forks and sim.prefix.hits > 0
    assert sim.kept_peak <= sim.prefix.budget


def test_the_grow_runs_preempt_sharing_sequences():
    """The property test above is only as good as what it reaches: preemption while sharing."""
    preempted = hits = 0
    for seed in range(1, 24, 2):
        rng = random.Random(seed)
        sim = PrefixSim(rng, workers=1 + seed % 3, capacity_tokens=rng.choice((64, 96)), policy="grow",
                        budget=rng.choice((None, 8, 20)), budget_tokens=rng.choice((8, 64, 256)),
                        max_batch=rng.choice((4, 16)))
        for prompt in family_prompts(rng, rng.randint(1, 3), 30):
            sim.add(prompt, rng.randint(1, 30), n=rng.choice((1, 1, 3)))
        sim.run(stop_p=0.03)
        preempted += sim.sched.num_preemptions
        hits += sim.prefix.hits
    assert preempted >= 20 and hits >= 100, (preempted, hits)


def test_what_a_prompt_shares():
    """Whole pages only, at least one token left to prefill, nothing for prompt_logprobs or a prompt
    within a page and a token; a pending prefix holds later members back one step; n samples share."""
    rng = random.Random(0)
    sim = PrefixSim(rng)
    head = [rng.randrange(10, 900) for _ in range(3 * PAGE)]
    sim.add(head + [1, 2], 20)                           # the donor
    sim.add(head + [3], 20)                              # 3 pages and a token: shares 3 pages
    sim.add(head[:2 * PAGE] + [4] * 5, 20)               # shares 2
    sim.add(list(head), 20)                              # exactly the head: 2 pages (one token must stay)
    sim.add(head[:PAGE], 20)                             # a page: nothing
    sim.add(head + [5], 20, prompt_logprobs=1)           # asks prompt_logprobs: nothing
    sim.add(head[:PAGE] + [6], 20, n=3)                  # n samples of a page and a token: one page each
    sim.step(stop_p=0)
    assert [s.seq_id for s in sim.sched.running] == [1]              # the others wait for its prefix
    sim.step(stop_p=0)
    shared = {s.seq_id: sim.placement.shared_tokens(s) for s in sim.sched.running}
    assert shared == {1: 0, 2: 3 * PAGE, 3: 2 * PAGE, 4: 2 * PAGE, 5: 0, 6: 0, 7: PAGE, 8: PAGE, 9: PAGE}
    sim.run(stop_p=0)
    sim.assert_empty()


def test_the_kept_kv_budget_bounds_what_the_s_worker_keeps():
    rng = random.Random(1)
    sim = PrefixSim(rng, budget_tokens=2 * PAGE)
    heads = [[rng.randrange(10, 900) for _ in range(3 * PAGE)] for _ in range(3)]
    for h in heads:
        for i in range(3):
            sim.add(h + [i + 1], 8)
    sim.run(stop_p=0)
    sim.assert_empty()
    assert 0 < sim.kept_peak <= 2 * PAGE and sim.prefix.hits > 0


def test_kept_kv_is_dropped_once_no_waiting_prompt_shares_it():
    """n samples: the prefix K/V lives one step, while the samples wait for it; the entry itself
    (pages charged, holders counted) lives until they end. A later prompt prefills in full and
    donates again."""
    rng = random.Random(2)
    sim = PrefixSim(rng)
    head = [rng.randrange(10, 900) for _ in range(3 * PAGE)]
    sim.add(head + [1], 30, n=4)
    sim.step(stop_p=0)
    assert sim.prefix.kept_tokens == 3 * PAGE and len(sim.sched.running) == 1
    sim.step(stop_p=0)
    assert sim.prefix.kept_tokens == 0 and len(sim.prefix.entries) == 1 and sim.prefix.hits == 3
    sim.add(head + [2], 30)
    sim.add(head + [3], 30)
    sim.step(stop_p=0)
    assert [sim.placement.shared_tokens(s) for s in sim.sched.running] == [0, 3 * PAGE, 3 * PAGE, 3 * PAGE, 0]
    sim.step(stop_p=0)
    assert sim.prefix.hits == 4 and len(sim.prefix.entries) == 2
    sim.run(stop_p=0)
    sim.assert_empty()


# ---------------------------------------------------------------------------- the embedded model

SYSTEM = ("You are a patient tutor for a class of curious students who are twelve years old. Answer each "
          "question in two or three short sentences, with one concrete example from everyday life, and say so "
          "plainly when you are not sure of something. Never use lists or headings, keep every answer "
          "friendly and precise, and end with a short question that invites the student to think further."
          "\n\nQuestion: ")
QUESTIONS = ["Why does ice float on water?", "What makes a rainbow appear?", "How do plants drink?",
             "Why do cats purr?", "What is an echo?", "How does a magnet work?"]
NEW = 10


def workload(tok) -> tuple[list[list[int]], list]:
    """A 2-3 page system prompt before varied questions, a question asked with n = 3 greedy samples
    and one with n = 4 seeded samples; and a prompt that shares nothing."""
    from fastdecode import SamplingParams
    prompts = [tok.encode(SYSTEM + q) for q in QUESTIONS] + [tok.encode("Tell me a story about a fox.")]
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    params = [greedy] * len(prompts)
    params[1] = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, n=3)
    params[2] = SamplingParams(max_tokens=NEW, temperature=0.8, seed=7, ignore_eos=True, n=4)
    return prompts, params


def generate(prompts=None, params=None, **kwargs):
    """-> (token ids per request and sample, the engine's prefix summary, peak R-side KV bytes, the
    LLM, closed): kwargs go to LLM."""
    from fastdecode import LLM
    llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", **{"max_batch": 16, **kwargs})
    if prompts is None:
        prompts, params = workload(llm.engine.tokenizer)
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    kv_peak = max(r["kv_bytes"][0] for r in eng.recorder.steps if "kv_bytes" in r)
    llm.close()
    return [[c.token_ids for c in o.outputs] for o in outs], eng.prefix_summary(), kv_peak, llm


@pytest.fixture(scope="module")
def unshared():
    tokens, summary, kv_peak, llm = generate(prefix_sharing=False)
    assert llm.engine.prefix is None and summary["prefix_hits"] == 0 and not summary["prefix_sharing"]
    return tokens, kv_peak


def assert_nothing_left(llm) -> None:
    eng = llm.engine
    p = eng.prefix
    assert not p.entries and p.kept_tokens == 0 and not p.cover and not p.interest and not p.joined
    assert not eng.runner.chunk_kv and eng.placement.reserved == [0] * len(eng.placement.reserved)
    assert eng.backend.store.num_seqs() == 0


def test_a_shared_system_prompt_and_n_samples_give_the_unshared_tokens_in_less_kv(unshared):
    tokens, summary, kv_peak, llm = generate()
    assert tokens == unshared[0]
    prompt_pages = len(llm.engine.tokenizer.encode(SYSTEM)) // 32
    assert prompt_pages >= 2
    sharing = len(QUESTIONS) + 2 + 3                       # the questions' sequences (n = 3 and n = 4 among them)
    assert summary["prefix_hits"] == sharing - 1            # every one but the first, the donor
    assert summary["prefix_shared_tokens"] >= summary["prefix_hits"] * prompt_pages * 32
    assert summary["prefix_kv_bytes_saved"] == summary["prefix_shared_tokens"] * llm.engine.kv_bytes_per_token
    assert kv_peak < unshared[1] - summary["prefix_kv_bytes_saved"] // 2       # the R-worker holds less
    saved = [r["kv_saved_bytes"][0] for r in llm.engine.recorder.steps if "kv_saved_bytes" in r]
    assert saved and max(saved) > 0                                           # and says so
    assert_nothing_left(llm)


@pytest.mark.parametrize("donor_tokens,hits", [(1, len(QUESTIONS) - 2), (3, len(QUESTIONS) - 1)])
def test_a_donor_ending_before_or_after_its_members_fork_leaves_their_tokens_unchanged(donor_tokens, hits):
    """1: the donor stops at its first token, before any member forks: its prefix is dropped and the
    next prompt donates again. 3: the donor stops while its members decode from its pages; a member
    placed later forks from another member, and prompts waiting for a slot (max_batch 5) take the
    pages the donor frees."""
    from fastdecode import LLM, SamplingParams
    texts = [SYSTEM + q for q in QUESTIONS] + ["A story about a fox:", "A poem about the sea:"]
    params = [SamplingParams(max_tokens=donor_tokens, temperature=0, ignore_eos=True)]
    params += [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)] * (len(texts) - 1)
    got = {}
    for share in (False, True):
        llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", max_batch=5, prefix_sharing=share)
        outs = llm.generate([llm.engine.tokenizer.encode(t) for t in texts], params, use_tqdm=False)
        got[share] = [o.outputs[0].token_ids for o in outs], llm.engine.prefix_summary()["prefix_hits"]
        llm.close()
    assert got[True][0] == got[False][0]
    assert got[True][1] == hits
    assert_nothing_left(llm)


def test_preempted_donors_and_members_under_grow_give_the_tokens_of_full_reservation():
    """--kv-reserve grow in 9 MiB (about 200 tokens of fp32 SmolLM2): members are preempted and
    prefilled again (prompt + output) while the others read the shared pages."""
    from fastdecode import LLM, SamplingParams
    texts = [SYSTEM + q for q in QUESTIONS[:4]]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    got = {}
    for policy, share in (("full", False), ("grow", True)):
        llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", rworker_mem=9 * 2 ** 20,
                  kv_reserve=policy, max_batch=4, prefix_sharing=share)
        outs = llm.generate([llm.engine.tokenizer.encode(t) for t in texts], params, use_tqdm=False)
        got[policy] = ([o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions,
                       llm.engine.prefix_summary()["prefix_hits"])
        llm.close()
    (full, _, _), (grow, preemptions, hits) = got["full"], got["grow"]
    assert grow == full
    assert preemptions >= 2 and hits >= len(texts) - 1
    assert_nothing_left(llm)


def test_chunked_prefill_with_shared_prefixes_gives_the_unshared_tokens(unshared):
    tokens, summary, _, llm = generate(max_batch=8, max_num_batched_tokens=24)
    assert tokens == unshared[0]
    assert summary["prefix_hits"] >= len(QUESTIONS) + 2 + 3 - 1
    assert_nothing_left(llm)


def test_a_request_asking_prompt_logprobs_prefills_in_full_and_gets_the_same_logprobs():
    from fastdecode import SamplingParams
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    params = [plain, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2), plain]
    got = {}
    for share in (False, True):
        from fastdecode import LLM
        llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", prefix_sharing=share)
        outs = llm.generate([llm.engine.tokenizer.encode(SYSTEM + q) for q in QUESTIONS[:3]], params,
                            use_tqdm=False)
        got[share] = ([o.outputs[0].token_ids for o in outs], outs[1].prompt_logprobs,
                      llm.engine.prefix_summary()["prefix_hits"])
        llm.close()
    assert got[True][0] == got[False][0]
    shared, plain = got[True][1], got[False][1]                # the batch around it differs: fp32 rounding
    assert len(shared) == len(plain) and shared[0] is None
    for a, b in zip(shared[1:], plain[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    assert got[True][2] == 1                                   # only the third shared


def mpi_requests() -> list[dict]:
    greedy = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    reqs = [{"prompt": SYSTEM + q, "params": dict(greedy)} for q in QUESTIONS]
    reqs.append({"prompt": "Tell me a story about a fox.", "params": dict(greedy)})
    reqs[1]["params"]["n"] = 3
    reqs[2]["params"] = {**greedy, "temperature": 0.8, "seed": 7, "n": 4}
    return reqs


@pytest.mark.parametrize("ranks", [2, 3])
def test_shared_prefixes_under_mpiexec_give_the_unshared_tokens(tmp_path, unshared, ranks):
    """One R-worker (all members on it) and two (a member goes where the load stays lowest: a hot
    prefix is donated once per worker); the forks travel in the PREFILL messages."""
    (tmp_path / "req.json").write_text(json.dumps(mpi_requests()))
    kwargs = {"kv_dtype": "fp32", "dtype": "float32", "device": "cpu", "max_batch": 16, "quiet": True}
    proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, f"{REPO}/tests/mpi_scripts/generate_ids.py",
                           str(tmp_path / "req.json"), str(tmp_path / "out.json"), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["workers"] == ranks - 1 and got["outputs"] == unshared[0]
    sharing = len(QUESTIONS) + 2 + 3
    assert got["prefix"]["prefix_hits"] == sharing - (ranks - 1)           # one donor per worker
    assert all(b > 0 for b in got["kv_saved_bytes_peak"][:ranks - 1])     # as each R-worker reports


def write_input(path, questions) -> None:
    path.write_text("".join(batch_line(f"q{i}", {"prompt": SYSTEM + q, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}) + "\n" for i, q in enumerate(questions)))


def test_generate_reports_hits_and_a_resumed_job_still_shares(tmp_path):
    """--stats-json's summary counts the hits (zero with --no-prefix-sharing, same rows: in float32,
    where a prefix prefilled apart gives the tokens of the whole prompt prefilled); a job stopped
    after two lines and run again serves the rest sharing their system prompt."""
    inp = tmp_path / "in.jsonl"
    write_input(inp, QUESTIONS)
    summaries, rows = {}, {}
    for name, extra in (("shared", []), ("plain", ["--no-prefix-sharing"])):
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.stats.json"
        proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--dtype", "float32", "--kv-dtype", "fp32",
                               "--quiet", "--stats-json", str(stats)] + extra, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        summaries[name] = json.loads(stats.read_text())["summary"]
        rows[name] = [r["response"]["body"]["choices"] for r in read_output(str(out))]
    assert rows["shared"] == rows["plain"]
    assert summaries["shared"]["prefix_hits"] == len(QUESTIONS) - 1 and summaries["plain"]["prefix_hits"] == 0
    assert summaries["shared"]["prefix_kv_bytes_saved"] > 0 and not summaries["plain"]["prefix_sharing"]
    # the same input file, first with its two first lines (a job stopped there), then whole: resumed
    grown, out, stats = tmp_path / "grown.jsonl", tmp_path / "resumed.jsonl", tmp_path / "resumed.stats.json"
    for questions, extra in ((QUESTIONS[:2], []), (QUESTIONS, ["--stats-json", str(stats)])):
        write_input(grown, questions)
        proc = run_fastdecode(["generate", "-i", str(grown), "-o", str(out), "--dtype", "float32", "--kv-dtype", "fp32",
                               "--quiet"] + extra, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(stats.read_text())["summary"]["prefix_hits"] == len(QUESTIONS) - 3
    assert [r["response"]["body"]["choices"] for r in read_output(str(out))] == rows["shared"]


def test_shared_prefixes_in_the_device_tier_give_the_unshared_tokens(tmp_path, unshared):
    """The GPU's tier (its torch code here) holding every sequence (local mode's store gets 1 byte):
    members fork whole pages of the tier's own, which it refcounts, and read them once."""
    (tmp_path / "req.json").write_text(json.dumps(mpi_requests()))
    kwargs = {"kv_dtype": "fp32", "dtype": "float32", "device": "cpu", "max_batch": 16, "quiet": True,
              "rworker_mem": 1, "device_kv_memory": 256 << 20}
    env = dict(os.environ, FASTDECODE_DEVICE_TIER="torch")
    proc = subprocess.run([sys.executable, f"{REPO}/tests/mpi_scripts/generate_ids.py", str(tmp_path / "req.json"),
                           str(tmp_path / "out.json"), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=300, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["placed"][0] == 0 and got["placed"][-1] > 0 and got["outputs"] == unshared[0]
    assert got["prefix"]["prefix_hits"] == len(QUESTIONS) + 2 + 3 - 1          # one donor, in the tier
    assert got["kv_saved_bytes_peak"][-1] > 0                                  # the tier's shared pages
