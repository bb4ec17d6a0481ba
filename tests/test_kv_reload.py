"""A stop saves the running sequences' KV beside the output (OUTPUT.inflight.kv) and the rerun
reloads it instead of recomputing it: the same text as an uninterrupted run, no KV recomputed for
the reloaded sequences; damaged or unusable KV is named and recomputed instead
(--save-kv-on-stop, batch/kv_stop.py, engine/kv_reload.py)."""
from __future__ import annotations

import pytest
from conftest import batch_line, read_output
from inprocess import generate
from test_inflight import answers

LINES = [batch_line(f"r{i}", {"prompt": f"Story {i}: once upon a time " + "far away " * (i % 4),
                              "max_tokens": 16 + 4 * (i % 3), "temperature": 0 if i % 2 else 0.8, "seed": i,
                              "ignore_eos": True, **({"n": 2} if i == 3 else {})})
         for i in range(6)]


@pytest.fixture(scope="module")
def job(llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_reload")
    inp = tmp / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(tmp / "ref.jsonl")])
    assert code == 0
    return tmp, inp, answers(read_output(tmp / "ref.jsonl"))


def stop_then_rerun(llm, out, inp, flags=(), damage=None):
    """Stop after 5 steps, (damage the KV file,) rerun; -> (the stopped run's and the rerun's this_run)."""
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out), *flags], stop_at=5)
    assert code == 75
    stopped = rep["this_run"]
    if damage is not None:
        damage(out.parent / (out.name + ".inflight.kv"))
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    assert code == 0 and rep["state"] == "done", rep
    return stopped, rep["this_run"]


def test_a_stops_kv_is_reloaded_and_the_text_is_the_uninterrupted_runs(llm, job):
    tmp, inp, reference = job
    out = tmp / "reloaded.jsonl"
    stopped, rerun = stop_then_rerun(llm, out, inp)
    assert stopped["saved_kv_sequences"] == stopped["saved_in_flight_sequences"] > 0
    assert stopped["saved_kv_bytes"] > 0
    assert rerun["reloaded_sequences"] == stopped["saved_kv_sequences"]
    assert rerun["reloaded_tokens"] > 0 and rerun["recomputed_tokens"] == 0
    assert answers(read_output(out)) == reference
    assert not (tmp / "reloaded.jsonl.inflight.kv").exists() and not (tmp / "reloaded.jsonl.inflight").exists()


def test_never_saves_no_kv_and_the_rerun_recomputes(llm, job):
    tmp, inp, reference = job
    out = tmp / "never.jsonl"
    stopped, rerun = stop_then_rerun(llm, out, inp, ["--save-kv-on-stop", "never"])
    assert stopped["saved_kv_sequences"] == 0 and stopped["saved_in_flight_sequences"] > 0
    assert rerun["reloaded_tokens"] == 0 and rerun["recomputed_tokens"] > 0
    assert answers(read_output(out)) == reference


def test_damaged_kv_is_named_and_recomputed(llm, job, capfd):
    tmp, inp, reference = job
    out = tmp / "damaged.jsonl"

    def flip_last_byte(path):
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0x40
        path.write_bytes(bytes(raw))
    stopped, rerun = stop_then_rerun(llm, out, inp, damage=flip_last_byte)
    assert "recomputed, not reloaded: its KV's checksum does not match" in capfd.readouterr().err
    assert 0 < rerun["reloaded_sequences"] < stopped["saved_kv_sequences"] and rerun["recomputed_tokens"] > 0
    assert answers(read_output(out)) == reference


def test_a_reloaded_sequence_leaves_no_prefix_entry_pending(llm, tmp_path):
    """Prompts that share a long prefix: the first step starts the first one alone (the others wait
    for the prefix it donates), and the stop saves it. The rerun reloads it, its placement having
    opened a prefix entry for the waiting prompts; no prefill fills that entry, so it is dropped and
    they prefill in full in the next step (before, they waited on it until the reloaded sequence
    ended, its whole generation: the rerun took about twice the steps)."""
    system = "You are a careful assistant. " + " ".join(f"rule {i}: answer briefly." for i in range(24))
    lines = [batch_line(f"q{i}", {"prompt": f"{system} Question {i}: what is {i} plus {i}?", "max_tokens": 10,
                                  "temperature": 0, "ignore_eos": True}) for i in range(4)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    flags = ["-i", str(inp)]
    assert generate(llm.engine, flags + ["-o", str(tmp_path / "ref.jsonl")])[2] == 0
    out = str(tmp_path / "out.jsonl")
    assert generate(llm.engine, flags + ["-o", out], stop_at=1)[2] == 75
    before = llm.engine.step_no
    _, rep, code = generate(llm.engine, flags + ["-o", out], stop_at=200)
    assert code == 0, rep
    assert llm.engine.step_no - before <= 10 + 3      # 10 tokens each, the waiting prompts from step 2
    assert rep["this_run"]["reloaded_sequences"] == 1
    assert answers(read_output(out)) == answers(read_output(tmp_path / "ref.jsonl"))
