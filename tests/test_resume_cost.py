"""A resume costs about the work left: sequences continued from a stop's save (and preempted ones)
are re-prefilled in chunks beside the running sequences' decode rows, never in one serial prefill
before decode, and they wait ahead of fresh prompts, the fewest tokens to recompute first. The
continued text stays the uninterrupted run's (fp32, token for token). The time it saves on a
whole job is bench/e2e/resume_bench.py's."""
from __future__ import annotations

import pytest
from conftest import batch_line, read_output
from inprocess import generate
from test_chunked_prefill import make_seq, scheduler

from fastdecode.engine.sequence import Status
from fastdecode.sched.scheduler import RECOMPUTE_SHARE


def continued(seq_id: int, prompt_len: int, generated: int, max_tokens: int = 50):
    seq = make_seq(seq_id, prompt_len, max_tokens)
    seq.output_ids = [7] * generated
    return seq


def test_recomputed_sequences_wait_ahead_of_fresh_prompts_fewest_tokens_first():
    sched = scheduler(None)
    fresh, long_one, short_one = make_seq(1, 10, 5), continued(2, 10, 40), continued(3, 10, 5)
    for s in (fresh, long_one, short_one):
        sched.add(s)
    assert list(sched.waiting) == [short_one, long_one, fresh]


def test_recompute_is_chunked_beside_decode_without_a_token_budget():
    """No --max-num-batched-tokens: decode goes on every step while saved sequences are
    re-prefilled, max_prefill_tokens / RECOMPUTE_SHARE tokens a step, each picking up where its
    last chunk stopped; fresh prompts come after, and once nothing is left to recompute, whole
    prompts are prefilled before decode as before."""
    sched = scheduler(None, max_batch=16)
    sched.max_prefill_tokens = 40 * RECOMPUTE_SHARE                 # a 40-token recompute chunk
    runners = [make_seq(i, 6, 200) for i in (1, 2, 3)]
    for s in runners:
        sched.add(s)
    assert sched.schedule_prefill(1) == runners                     # nothing to recompute: whole prompts
    for s in runners:
        s.prefill_to, s.output_ids = 0, [0]
    saved = [continued(10 + i, 20, n) for i, n in enumerate((90, 30, 61))]
    fresh = make_seq(20, 30, 5)
    for s in saved + [fresh]:
        sched.add(s)
    covered = {s.seq_id: 0 for s in saved}
    for step in range(2, 60):
        decoding = [s for s in sched.running if s.status is Status.RUNNING]
        assert sched.step_budget() == len(decoding) + 40
        chunks = sched.schedule_prefill(step)
        assert runners[0] in decoding                                # decode never waits for it
        assert sum(s.prefill_to - s.prefilled for s in chunks) <= 40, step
        if fresh in chunks:                                          # after every saved one
            assert all(covered[s.seq_id] == s.kv_len for s in saved if s not in chunks)
        for s in chunks:
            assert s.prefilled == covered.get(s.seq_id, 0)
            covered[s.seq_id] = s.prefill_to
            s.prefilled, s.prefill_to = (0 if s.status is Status.RUNNING else s.prefill_to), 0
        for s in runners:                                            # (the others' lengths stay put)
            s.output_ids.append(0)
        if fresh.status is Status.RUNNING:
            break
    else:
        pytest.fail("the fresh prompt was never prefilled")
    assert covered == {s.seq_id: s.kv_len for s in saved + [fresh]}
    assert sched.step_budget() is None                              # recompute done: whole prompts again


LINES = [batch_line(f"r{i}", {"prompt": f"Item {i}: a short story about " + "the sea " * (i % 3),
                              "max_tokens": 24, "temperature": 0.8, "seed": i, "ignore_eos": True})
         for i in range(8)]


def test_a_rerun_decodes_while_it_recomputes_and_continues_the_same_text(llm, tmp_path):
    eng = llm.engine
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    ref, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    assert generate(eng, ["-i", str(inp), "-o", str(ref)])[2] == 0
    # the KV not saved (--save-kv-on-stop never): the rerun recomputes it (a reload: test_kv_reload.py)
    _, rep, code = generate(eng, ["-i", str(inp), "-o", str(out), "--save-kv-on-stop", "never"], stop_at=12)
    assert code == 75 and rep["this_run"]["saved_in_flight_tokens"] >= 8 * 10

    steps = []                              # per engine step: (decode rows, recomputed prompt rows)
    runner, prefill_limit = eng.runner, eng.scheduler.max_prefill_tokens

    def recomputing(seqs):
        return sum((s.prefill_to or s.kv_len) - s.prefilled for s in seqs if s.output_ids)

    def prefill(new):
        steps.append((0, recomputing(new)))
        return type(runner).prefill(runner, new)

    def mixed(running, new):
        steps.append((len(running), recomputing(new)))
        return type(runner).mixed(runner, running, new)
    runner.prefill, runner.mixed = prefill, mixed
    recomputed_before = eng.num_recomputed_tokens
    eng.scheduler.max_prefill_tokens = 16 * RECOMPUTE_SHARE         # 16-token chunks for this small job
    try:
        _, rep, code = generate(eng, ["-i", str(inp), "-o", str(out)])
    finally:
        del runner.prefill, runner.mixed
        eng.scheduler.max_prefill_tokens = prefill_limit
    assert code == 0 and rep["this_run"]["continued_sequences"] == 8
    recompute_steps = [(d, r) for d, r in steps if r]
    assert sum(r for _, r in recompute_steps) == eng.num_recomputed_tokens - recomputed_before > 16
    assert all(r <= 16 for _, r in recompute_steps), steps          # never one serial prefill of it all
    alone = [i for i, (d, _) in enumerate(recompute_steps) if not d]
    # only the first saved sequence's chunks run before anything decodes (fewer than 32 KV tokens)
    assert alone == list(range(len(alone))) and len(alone) <= 2 < len(recompute_steps), steps
    assert [r["response"]["body"]["choices"] for r in read_output(out)] == \
        [r["response"]["body"]["choices"] for r in read_output(ref)]
