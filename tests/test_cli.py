"""`fastdecode generate` end to end: batch JSONL in/out, bad lines, bad usage, failing ranks."""
from __future__ import annotations

import json

import pytest
from conftest import batch_line, read_output, run_fastdecode

CHAT = "/v1/chat/completions"


def good_lines():
    return [
        batch_line("c1", {"model": "smollm2-135m", "prompt": "The sky is", "max_tokens": 12, "temperature": 0}),
        batch_line("chat1", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 10,
                             "temperature": 0}, CHAT),
        batch_line("c2", {"prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0.9, "seed": 3, "stop": [","]}),
        batch_line("chat2", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Count to 3."}]}],
                             "max_completion_tokens": 9, "temperature": 0, "n": 2}, CHAT),
    ]


BAD = {
    "not-json": "{this is not json",
    "no-custom-id": json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
    "bad-type": batch_line("bad-type", {"prompt": "x", "max_tokens": "many"}),
    "bad-url": json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings",
                           "body": {"input": "x"}}),
    "no-body": json.dumps({"custom_id": "no-body", "method": "POST", "url": "/v1/completions"}),
    "no-prompt": batch_line("no-prompt", {"max_tokens": 5}),
    "too-long": batch_line("too-long", {"prompt": "word " * 9000, "max_tokens": 4}),
    "over-context": batch_line("over-context", {"prompt": "hello", "max_tokens": 100000}),
    "bad-temp": batch_line("bad-temp", {"prompt": "hello", "temperature": -1}),
    "bad-messages": batch_line("bad-messages", {"messages": "hi"}, CHAT),
}
EXPECTED_CODES = {"bad-type": "invalid_request", "bad-url": "invalid_url", "no-body": "invalid_request",
                  "no-prompt": "invalid_request", "too-long": "context_length_exceeded",
                  "over-context": "context_length_exceeded", "bad-temp": "invalid_request",
                  "bad-messages": "invalid_request"}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    good = good_lines()
    lines = [good[0], BAD["not-json"], good[1], BAD["no-custom-id"], BAD["bad-type"], BAD["bad-url"], good[2],
             BAD["no-body"], BAD["no-prompt"], BAD["too-long"], BAD["over-context"], BAD["bad-temp"],
             BAD["bad-messages"], good[3], good[0].replace('"c1"', '"c1"')]   # last: duplicate custom_id
    path = tmp / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return tmp, path, lines


@pytest.fixture(scope="module")
def outputs(mixed_file):
    tmp, path, _ = mixed_file
    result = {}
    for ranks in (None, 2, 3):
        out = tmp / f"out-{ranks}.jsonl"
        proc = run_fastdecode(["generate", "-i", str(path), "-o", str(out), "--kv-dtype", "fp32", "--quiet"],
                              ranks=ranks)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result[ranks] = (read_output(out), proc)
    return result


def test_every_line_answered_in_input_order(mixed_file, outputs):
    _, _, lines = mixed_file
    rows, proc = outputs[None]
    assert len(rows) == len(lines)
    expected_ids = []
    for text in lines:
        try:
            cid = json.loads(text).get("custom_id")
        except json.JSONDecodeError:
            cid = None
        expected_ids.append(cid)
    assert [r["custom_id"] for r in rows] == expected_ids
    assert "Throughput:" in proc.stdout and "requests/s" in proc.stdout


def test_bad_lines_get_400_and_good_lines_are_served(outputs):
    rows, _ = outputs[None]
    by_id = {}
    for r in rows:
        by_id.setdefault(r["custom_id"], []).append(r)
    for cid, code in EXPECTED_CODES.items():
        (r,) = by_id[cid]
        assert r["response"]["status_code"] == 400, cid
        assert r["error"]["code"] == code, (cid, r["error"])
        assert r["error"]["message"]
    nulls = by_id[None]
    assert len(nulls) == 2 and all(r["response"]["status_code"] == 400 for r in nulls)
    assert any("not valid JSON" in r["error"]["message"] for r in nulls)
    first, dup = by_id["c1"]
    assert first["response"]["status_code"] == 200
    assert dup["error"]["code"] == "duplicate_custom_id"
    for cid in ("c1", "chat1", "c2", "chat2"):
        r = by_id[cid][0]
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    chat2 = by_id["chat2"][0]["response"]["body"]
    assert chat2["object"] == "chat.completion" and len(chat2["choices"]) == 2
    assert all(c["message"]["role"] == "assistant" for c in chat2["choices"])
    c2 = by_id["c2"][0]["response"]["body"]["choices"][0]
    assert "," not in c2["text"]                       # stop strings are cut from the text
    c1 = by_id["c1"][0]["response"]["body"]
    assert c1["object"] == "text_completion" and c1["usage"]["completion_tokens"] <= 12


def test_same_output_with_one_or_two_rworkers_and_local(outputs):
    def served(rows):
        return [(r["custom_id"], [c.get("text", c.get("message", {}).get("content"))
                                  for c in r["response"]["body"]["choices"]])
                for r in rows if r["response"] and r["response"]["status_code"] == 200]
    local = served(outputs[None][0])
    assert served(outputs[2][0]) == local
    assert served(outputs[3][0]) == local


# ---------------------------------------------------------------------------- usage errors: exit 2, no hang

@pytest.mark.parametrize("ranks", [None, 3])
def test_missing_model_exits_2_with_one_line(tmp_path, ranks):
    inp = tmp_path / "in.jsonl"
    inp.write_text(good_lines()[0] + "\n")
    proc = run_fastdecode(["generate", "-m", str(tmp_path / "nope"), "-i", str(inp), "-o", str(tmp_path / "o")],
                          ranks=ranks, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fastdecode: error:")]
    assert len(errors) == 1 and "not found" in errors[0]
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture_exits_2(tmp_path):
    model = tmp_path / "gpt2-like"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    (model / "model.safetensors").write_bytes(b"\0" * 16)
    inp = tmp_path / "in.jsonl"
    inp.write_text(good_lines()[0] + "\n")
    proc = run_fastdecode(["generate", "-m", str(model), "-i", str(inp), "-o", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2
    assert "unsupported architecture" in proc.stderr and "gpt2" in proc.stderr


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "unwritable-output"])
def test_bad_input_or_output_paths_exit_2(tmp_path, case):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(good_lines()[0] + "\n")
    if case == "missing":
        inp = tmp_path / "absent.jsonl"
    elif case == "directory":
        inp = tmp_path
    elif case == "empty":
        inp.write_text("")
    else:
        out = tmp_path / "no-such-dir" / "out.jsonl"
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out)], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("fastdecode: error:")


def test_argparse_errors_exit_2():
    proc = run_fastdecode(["generate", "-i", "x.jsonl"], timeout=60)    # no -o
    assert proc.returncode == 2 and "required" in proc.stderr


# ---------------------------------------------------------------------------- a failing rank ends the job

@pytest.mark.parametrize("fault", ["1:decode", "2:prefill", "0:step"])
def test_exception_on_a_rank_ends_the_job_naming_it(tmp_path, fault):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(good_lines()) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], ranks=3, timeout=180,
                          env={"FASTDECODE_INJECT_FAULT": fault})
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    rank = fault.split(":")[0]
    assert f"rank {rank} (" in proc.stderr and "injected fault" in proc.stderr, proc.stderr[-2000:]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())      # failed, before the job ended
    assert report["state"] == "failed" and "injected fault" in report["error"], report
    assert report.get("failed_rank") == (None if rank == "0" else int(rank)), report


def test_info_reports_isa_and_mpi():
    proc = run_fastdecode(["info"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kernel_isa" in proc.stdout and "mpi_library" in proc.stdout and "torch" in proc.stdout
    from rworker import KVStore
    pairs = KVStore(1, 1, 64, "bf16", threads=1).has_v_pairs
    assert ("kernel_v_pairs" in proc.stdout) and (("--attn-probs bf16" in proc.stdout) == pairs), proc.stdout


# ---------------------------------------------------------------------------- --max-model-len

def test_max_model_len_caps_requests_and_the_reservation(tmp_path):
    """Under --max-model-len 40: a chat request without max_tokens runs to 40 tokens in all and one
    that asks past 40 is a 400. The note about whole-context reservations appears when few such
    sequences fit (the model's own 8,192-token context in 64 MiB of KV)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([
        batch_line("open", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True},
                   CHAT),
        batch_line("over", {"prompt": "The sky is", "max_tokens": 38}),
    ]) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--quiet",
                           "--max-model-len", "40"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["custom_id"]: r for r in read_output(str(out))}
    usage = rows["open"]["response"]["body"]["usage"]
    assert usage["total_tokens"] == 40 and rows["open"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert rows["over"]["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 40 tokens" in rows["over"]["error"]["message"]
    assert "sets no max_tokens" not in proc.stderr          # 40-token reservations fit by the thousand

    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o2.jsonl"), "--kv-dtype", "fp32",
                           "--quiet", "--rworker-mem", "64M", "--max-model-len", "8192"], ranks=2, timeout=300)
    assert "request 'open' sets no max_tokens" in proc.stderr and "--max-model-len" in proc.stderr


@pytest.mark.parametrize("value,needle", [("100000", "longer than the model's context of 8192"),
                                          ("1", "--max-model-len must be an integer >= 2")])
def test_bad_max_model_len_exits_2(tmp_path, value, needle):
    inp = tmp_path / "in.jsonl"
    inp.write_text(good_lines()[0] + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "o"), "--max-model-len", value],
                          timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()
