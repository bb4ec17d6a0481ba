"""`--kv-reserve grow`: sequences reserve R-worker memory page by page and the youngest are preempted
(KV freed, recomputed on re-admission) when a worker is full. Checked: in a simulation with random
lengths the reservations never pass capacity, what is reserved always covers the next token, the
oldest sequence always progresses and every sequence finishes; end to end, greedy tokens with
preemptions equal the ones of the default full reservation (no preemption), in local mode and
under mpirun."""
from __future__ import annotations

import json
import random

import pytest
from conftest import batch_line, read_output, run_fastdecode

PAGE = 64


class FifoAll:
    def admit(self, step, waiting, running, capacity):
        return len(waiting)


def make_seq(seq_id, prompt_len, max_tokens):
    from fastdecode.engine.sampling_params import SamplingParams
    from fastdecode.engine.sequence import Request, Sequence
    req = Request(seq_id, str(seq_id), None, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0)
    seq = Sequence(seq_id, req, 0, max_tokens)
    req.sequences.append(seq)
    return seq


@pytest.mark.parametrize("seed", range(6))
def test_grow_reservations_stay_within_capacity_and_everyone_finishes(seed):
    from fastdecode.engine.sequence import Status
    from fastdecode.rpart.base import WorkerInfo
    from fastdecode.sched.placement import Placement
    from fastdecode.sched.scheduler import Scheduler
    rng = random.Random(seed)
    caps = [rng.randint(6, 14) * PAGE for _ in range(rng.randint(1, 3))]       # tokens per worker
    workers = [WorkerInfo(w + 1, "h", 1, "avx2", cap * 8, page_tokens=PAGE) for w, cap in enumerate(caps)]
    place = Placement(workers, kv_bytes_per_token=8, policy="grow")
    sched = Scheduler(FifoAll(), place, max_batch=64, max_prefill_tokens=4096)
    seqs, target = [], {}
    for i in range(rng.randint(10, 40)):
        prompt = rng.randint(1, 150)
        max_tokens = rng.randint(1, min(caps) - prompt)          # the worst case fits every worker alone
        seq = make_seq(i + 1, prompt, max_tokens)
        assert place.fits_anywhere_alone(seq)
        target[seq.seq_id] = rng.randint(1, max_tokens)          # where EOS comes
        seqs.append(seq)
        sched.add(seq)
    preempted_total = 0
    for step in range(1, 20000):
        for seq in sched.schedule_prefill(step):
            if not seq.output_ids:
                seq.output_ids.append(0)                         # the prefill's token
        oldest = min((s for s in sched.running if s.status is Status.RUNNING), key=lambda s: s.seq_id,
                     default=None)
        preempted = sched.make_room()
        preempted_total += len(preempted)
        assert oldest is None or oldest not in preempted         # the oldest always progresses
        for w, cap in enumerate(caps):
            assert place.reserved[w] <= cap
        running = [s for s in sched.running if s.status is Status.RUNNING]
        for s in running:
            assert place._held[s.seq_id] >= s.kv_len + 1        # room for this step's token
            assert s.kv_len + 1 <= s.total_len_bound
        for s in running:                                        # decode
            if len(s.output_ids) >= target[s.seq_id]:
                sched.finish(s)
            else:
                s.output_ids.append(0)
        sched.drop_finished()
        if not sched.has_work():
            break
    assert all(s.status is Status.FINISHED and len(s.output_ids) == target[s.seq_id] for s in seqs)
    assert place.reserved == [0] * len(caps) and place.resident == [0] * len(caps)
    if seed == 0:
        assert preempted_total > 0          # the simulation does exercise preemption


PROMPTS = ["Story number 1: once upon a time", "Story number 2: once upon a time",
           "Story number 3: once upon a time"]
MEM = 9 * 2 ** 20       # 204 fp32 KV tokens of SmolLM2-135M: 3 pages of 64


def test_grow_with_preemption_gives_the_tokens_of_full_reservation(tmp_path):
    from fastdecode import LLM, SamplingParams
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    result = {}
    for policy in ("full", "grow"):
        llm = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", rworker_mem=MEM,
                  kv_reserve=policy)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if policy == "full":
            full_texts = [o.outputs[0].text for o in outs]
        result[policy] = ([o.outputs[0].token_ids for o in outs], llm.engine.step_no,
                          llm.engine.scheduler.num_preemptions, llm.engine.num_recomputed_tokens)
        llm.close()
    (full, full_steps, full_pre, _), (grow, grow_steps, grow_pre, recomputed) = result["full"], result["grow"]
    assert full_pre == 0 and grow_pre >= 1 and recomputed >= 64
    assert grow == full
    assert grow_steps < full_steps          # two sequences at once instead of one

    # the same under mpirun: preempted KV freed on an R-worker rank and recomputed there
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(batch_line(f"p{i}", {"prompt": p, "max_tokens": 100, "temperature": 0,
                                                 "ignore_eos": True}) for i, p in enumerate(PROMPTS)) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--dtype", "float32",
                           "--quiet", "--kv-reserve", "grow", "--rworker-mem", "9M",
                           "--summary-json", str(tmp_path / "summary.json")], ranks=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    this_run = json.loads((tmp_path / "summary.json").read_text())["this_run"]
    assert this_run["preemptions"] >= 1 and this_run["recomputed_tokens"] >= 64
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_output(str(out))}
    assert [texts[f"p{i}"] for i in range(len(PROMPTS))] == full_texts
