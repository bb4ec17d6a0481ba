"""Work in flight survives a stop: the generated tokens of every running sequence (and what its
sampler needs) are saved beside the output, and the rerun continues them. Greedy, seeded and
unseeded sampling, n > 1, several prompts per line, stop strings, log-probabilities: the text of
an uninterrupted run, whatever step the stop came at; in local mode (in-process, fp32) and under
`mpiexec -n 3`. A damaged or foreign save is named and ignored."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import batch_line, read_output, run_fastdecode, stop_after_rows
from inprocess import generate

from fastdecode.batch import inflight
from fastdecode.engine import continuation
from fastdecode.engine.sampling_params import SamplingParams
from fastdecode.engine.sequence import Request, Sequence

LINES = [
    batch_line("greedy", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    batch_line("seeded", {"prompt": "Once upon a time", "max_tokens": 14, "temperature": 0.9, "seed": 11,
                          "ignore_eos": True}),
    batch_line("unseeded-n2", {"prompt": "A list of fruits:", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9,
                               "n": 2, "ignore_eos": True, "logprobs": 2}),
    batch_line("two-prompts", {"prompt": ["Red", "Blue green"], "max_tokens": 8, "temperature": 0.7, "seed": 3}),
    batch_line("stops-n3", {"prompt": "Q: name a colour.\nA:", "max_tokens": 10, "temperature": 1.0, "seed": 5,
                            "n": 3, "stop": [" ", "."]}),
    batch_line("chat", {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "temperature": 0,
                        "ignore_eos": True, "logprobs": True, "top_logprobs": 1}, url="/v1/chat/completions"),
    batch_line("prompt-logprobs", {"prompt": "One two three", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                   "prompt_logprobs": 1}),
]


def answers(rows: list[dict]) -> dict[str, list]:
    """Per custom_id the generated text of every choice (what a user reads), in row order."""
    out = {}
    for r in rows:
        choices = r["response"]["body"]["choices"]
        out[r["custom_id"]] = [c.get("text", (c.get("message") or {}).get("content")) for c in choices]
    return out


@pytest.fixture(scope="module")
def job(llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inflight")
    inp = tmp / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    ref = tmp / "reference.jsonl"
    before = llm.engine.num_output_tokens
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(ref)])
    assert code == 0 and rep["state"] == "done"
    rows = read_output(ref)
    assert all(r["response"]["status_code"] == 200 for r in rows), rows
    return tmp, inp, rows, llm.engine.num_output_tokens - before


@pytest.mark.parametrize("at", [1, 4, 9])
def test_a_stop_at_any_step_continues_to_the_text_of_an_uninterrupted_run(llm, job, at):
    tmp, inp, reference, ref_tokens = job
    out = tmp / f"stopped-{at}.jsonl"
    saved_path = tmp / f"stopped-{at}.jsonl.inflight"
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)], stop_at=at)
    assert code == 75 and rep["state"] == "interrupted"
    saved = rep["this_run"]["saved_in_flight_sequences"]
    saved_tokens = rep["this_run"]["saved_in_flight_tokens"]
    assert saved > 0 and saved_tokens >= saved and saved_path.exists()
    entries = inflight.read(str(saved_path), {"model": "smollm2-135m"})
    assert sum(len(s.sequences) for _, states in entries.values() for s in states if s is not None) == saved

    before = llm.engine.num_output_tokens
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    assert code == 0 and rep["state"] == "done", rep
    assert rep["this_run"]["continued_sequences"] == saved
    assert rep["this_run"]["continued_tokens"] == saved_tokens
    # the saved tokens are not generated again
    assert llm.engine.num_output_tokens - before <= ref_tokens - saved_tokens
    rows = read_output(out)
    assert answers(rows) == answers(reference)
    for got, want in zip(rows, reference):      # log-probabilities returned before the stop come back too
        for c_got, c_want in zip(got["response"]["body"]["choices"], want["response"]["body"]["choices"]):
            lp_got, lp_want = c_got.get("logprobs"), c_want.get("logprobs")
            if lp_want is not None:
                got_tokens = lp_got.get("tokens") or [t["token"] for t in lp_got["content"]]
                want_tokens = lp_want.get("tokens") or [t["token"] for t in lp_want["content"]]
                assert got_tokens == want_tokens
    assert not saved_path.exists()               # removed once its rows are written


def test_a_second_stop_keeps_what_the_first_saved(llm, job):
    """Stopped again before every saved line was served again: nothing saved is lost."""
    tmp, inp, reference, _ = job
    out = tmp / "twice.jsonl"
    generate(llm.engine, ["-i", str(inp), "-o", str(out), "--max-batch", "2"], stop_at=6)
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out), "--max-batch", "2"], stop_at=2)
    assert code == 75 and rep["this_run"]["saved_in_flight_sequences"] > 0
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out), "--max-batch", "2"])
    assert code == 0 and answers(read_output(out)) == answers(reference)


@pytest.mark.parametrize("damage", ["flipped-byte", "other-output", "not-ours"])
def test_a_damaged_or_foreign_save_is_named_and_ignored(llm, job, damage, capfd):
    tmp, inp, reference, _ = job
    out = tmp / f"damaged-{damage}.jsonl"
    saved_path = tmp / f"damaged-{damage}.jsonl.inflight"
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)], stop_at=4)
    assert code == 75 and saved_path.exists()
    data = saved_path.read_bytes()
    if damage == "flipped-byte":
        saved_path.write_bytes(data[:-100] + bytes([data[-100] ^ 0x55]) + data[-99:])
    elif damage == "other-output":       # a whole, valid save of another output
        generate(llm.engine, ["-i", str(inp), "-o", str(tmp / "other.jsonl")], stop_at=4)
        shutil.copy(tmp / "other.jsonl.inflight", saved_path)
    else:
        saved_path.write_bytes(b"PK\x03\x04 something else entirely")
    capfd.readouterr()
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    err = capfd.readouterr().err
    assert code == 0 and f"{saved_path}: ignored, not trusted (" in err, err
    want = {"flipped-byte": "checksum", "other-output": "saved for output",
            "not-ours": "not an in-flight save"}[damage]
    assert want in err, err
    assert rep["this_run"]["continued_sequences"] == 0
    assert answers(read_output(out)) == answers(reference)
    assert not saved_path.exists()


def test_a_saved_state_that_does_not_fit_its_request_is_refused():
    """Checked again per request as its line is served: another prompt, more samples, too many tokens."""
    params = SamplingParams(n=2, max_tokens=5, temperature=0.5)

    def request(prompt):
        req = Request(0, "r", None, prompt, params, 7)
        req.sequences = [Sequence(1, req, 0, 5), Sequence(2, req, 1, 5)]
        return req
    good = continuation.RequestState(7, continuation.prompt_digest([1, 2, 3]),
                                     [continuation.SequenceState(0, [4, 5]),
                                      continuation.SequenceState(1, [6, 7, 8, 9, 10], finish_reason="length")])
    assert continuation.check(request([1, 2, 3]), good, 100) is None
    assert "prompt" in continuation.check(request([1, 2, 4]), good, 100)
    wide = continuation.RequestState(7, good.prompt_digest, [continuation.SequenceState(2, [4])])
    assert "not one of the request's 2" in continuation.check(request([1, 2, 3]), wide, 100)
    long = continuation.RequestState(7, good.prompt_digest, [continuation.SequenceState(0, [4] * 5)])
    assert "do not fit max_tokens 5" in continuation.check(request([1, 2, 3]), long, 100)
    assert "outside the vocabulary" in continuation.check(request([1, 2, 3]), good, 8)
    req = request([1, 2, 3])
    continuation.restore(req, good)
    assert req.sequences[0].output_ids == [4, 5] and not req.finished
    assert req.sequences[1].finish_reason == "length" and req.seed == 7


# ---------------------------------------------------------------------------- under mpiexec -n 3

def test_a_stopped_mpi_job_continues_its_sequences(llm, tmp_path):
    """Rank 0 saves what the R-workers held, the tokens and (exported from the R-workers) their KV;
    the rerun (3 ranks) imports the KV there and goes on."""
    lines = [batch_line(f"r{i}", {"prompt": f"Story {i}: once upon a time", "max_tokens": 6 + 20 * (i % 3),
                                  "temperature": 0 if i % 2 else 0.8, "seed": i, "ignore_eos": True})
             for i in range(6)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    _, _, code = generate(llm.engine, ["-i", str(inp), "-o", str(tmp_path / "ref.jsonl")])
    assert code == 0
    reference = answers(read_output(tmp_path / "ref.jsonl"))
    flags = ["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "6", "--dtype", "float32",
             "--kv-dtype", "fp32"]
    code, err = stop_after_rows(flags, 3, out, 2)
    assert code == 75, err[-3000:]
    assert "sequence(s) in flight" in err and (tmp_path / "out.jsonl.inflight").exists(), err[-3000:]
    assert "saved the KV of" in err and (tmp_path / "out.jsonl.inflight.kv").exists(), err[-3000:]
    again = run_fastdecode(flags, ranks=3, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["this_run"]["continued_sequences"] > 0
    # the R-workers exported their KV on the stop and imported it in the rerun: nothing recomputed
    assert report["this_run"]["reloaded_sequences"] > 0 and report["this_run"]["recomputed_tokens"] == 0
    assert answers(read_output(out)) == reference
