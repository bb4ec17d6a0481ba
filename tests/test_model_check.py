"""A request's `model` is checked as vLLM checks it: a line naming a model the job does not serve
gets a 404 `model_not_found` row (type NotFoundError) and the job goes on; a line naming the
model (-m as given, a name derived from its path, a --served-model-name alias) or none is served,
and every response names the first served name."""
from __future__ import annotations

import json
import os

import pytest
from conftest import batch_line, read_output, run_fastdecode

from fastdecode.batch.jsonl import parse_line
from fastdecode.model.names import derived_names, served_model
from fastdecode.model.source import ModelSource

GREEDY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def status(row: dict) -> int:
    return row["response"]["status_code"]


def texts(row: dict) -> list[str]:
    return [c["text"] for c in row["response"]["body"]["choices"]]


# ---------------------------------------------------------------------------- the names (no model loaded)

def test_names_derived_from_an_hf_directory(tmp_path):
    path = tmp_path / "meta-llama" / "Llama-2-7b-hf"
    names = derived_names(ModelSource(str(path) + "/", "hf", str(path)))
    assert {str(path) + "/", str(path), "Llama-2-7b-hf", "meta-llama/Llama-2-7b-hf"} <= names
    cached = tmp_path / "hub" / "models--Qwen--Qwen2-0.5B" / "snapshots" / "0123abcd"
    assert "Qwen/Qwen2-0.5B" in derived_names(ModelSource(str(cached), "hf", str(cached)))


def test_names_derived_from_a_relative_path_and_a_gguf_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = derived_names(ModelSource("models/tiny.Q4_0.gguf", "gguf", str(tmp_path / "models/tiny.Q4_0.gguf")))
    assert {"models/tiny.Q4_0.gguf", str(tmp_path / "models/tiny.Q4_0.gguf"), "tiny.Q4_0.gguf", "tiny.Q4_0"} <= names
    assert derived_names(ModelSource("random:llama-7b:layers=2", "random", "random:llama-7b:layers=2")) == \
        {"random:llama-7b:layers=2"}


def test_served_names_report_the_first_alias_and_keep_the_model_path(tmp_path):
    src = ModelSource(str(tmp_path / "m.gguf"), "gguf", str(tmp_path / "m.gguf"))
    served = served_model(src, ["gpt-4-0613", "gpt-4", "gpt-4-0613"])
    assert served.reported == "gpt-4-0613" and served.names == ("gpt-4-0613", "gpt-4")
    for ok in (None, "gpt-4", "gpt-4-0613", str(tmp_path / "m.gguf"), "m"):
        assert served.mismatch(ok) is None, ok
    message = served.mismatch("gpt-3.5-turbo")
    assert "`gpt-3.5-turbo`" in message and "`gpt-4-0613`, `gpt-4`" in message
    assert served_model(src).reported == str(tmp_path / "m.gguf")            # no alias: -m as given
    with pytest.raises(ValueError, match="non-empty"):
        served_model(src, ["ok", " "])


def test_a_wrong_model_is_a_404_after_the_schema():
    served = served_model(ModelSource("smollm2-135m", "gguf", "/x/SmolLM2-135M-Instruct.Q4_1.gguf"))
    wrong = parse_line(1, batch_line("w", {**GREEDY, "model": "llama-3-8b"}), served=served)
    assert (wrong.error.code, wrong.error.status) == ("model_not_found", 404)
    assert "`llama-3-8b`" in str(wrong.error) and "`smollm2-135m`" in str(wrong.error)
    typed = parse_line(2, batch_line("t", {**GREEDY, "model": "llama-3-8b", "max_tokens": "4"}), served=served)
    assert (typed.error.code, typed.error.status) == ("invalid_request", 400)      # a schema error comes first
    for model in ("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1", None):
        body = GREEDY if model is None else {**GREEDY, "model": model}
        assert parse_line(3, batch_line("ok", body), served=served).error is None, model


def test_served_model_name_takes_several_names_and_repeats():
    from fastdecode.cli import build_parser
    args = build_parser().parse_args(["generate", "-i", "in", "-o", "out", "--served-model-name", "a", "b",
                                      "--served-model-name", "c"])
    assert args.served_model_name == ["a", "b", "c"]
    assert build_parser().parse_args(["generate", "-i", "in", "-o", "out"]).served_model_name is None


# ---------------------------------------------------------------------------- generate, end to end

def test_local_job_serves_the_named_model_and_404s_the_rest(tmp_path, smollm_source):
    """-m a GGUF path with two aliases: the path, its file name, an alias and no model are served (the
    same greedy answer each), a wrong name gets a 404 and the job goes on."""
    gguf = smollm_source.path
    lines = [batch_line("path", {**GREEDY, "model": gguf}), batch_line("wrong", {**GREEDY, "model": "gpt-4"}),
             batch_line("file", {**GREEDY, "model": os.path.basename(gguf)[: -len(".gguf")]}),
             batch_line("alias", {**GREEDY, "model": "alias-b"}), batch_line("none", GREEDY)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = run_fastdecode(["generate", "-m", gguf, "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--quiet",
                           "--served-model-name", "alias-a", "alias-b"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert [r["custom_id"] for r in rows] == ["path", "wrong", "file", "alias", "none"]
    assert [status(r) for r in rows] == [200, 404, 200, 200, 200]
    wrong = rows[1]
    assert wrong["error"]["code"] == "model_not_found" and "`gpt-4`" in wrong["error"]["message"]
    assert wrong["response"]["body"]["error"]["type"] == "NotFoundError"
    served = [r for r in rows if status(r) == 200]
    assert {r["response"]["body"]["model"] for r in served} == {"alias-a"}
    assert len({tuple(texts(r)) for r in served}) == 1                 # one model answered them all
    assert "serving `alias-a`, `alias-b`" in proc.stderr
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["served_model_names"] == ["alias-a", "alias-b"]
    assert report["errors_by_code"] == {"model_not_found": 1}


def test_a_404_row_is_retried_by_a_rerun():
    """A wrong model name depends on the command line (-m, --served-model-name), not the line alone:
    a rerun serves the line again rather than keeping the 404 (resume.py's retryable errors)."""
    from fastdecode.batch.responses import error_line
    from fastdecode.batch.resume import row_code
    row = error_line("x", "model_not_found", "The model `gpt-4` does not exist", status=404)
    assert row_code(json.dumps(row).encode()) == ("model_not_found", False)          # not done: served again
    bad = error_line("y", "invalid_prompt", "empty prompt", status=400)
    assert row_code(json.dumps(bad).encode()) == ("invalid_prompt", True)            # the line alone decides


def test_mpi_job_checks_the_model_and_serves_prompt_lists(tmp_path):
    """Under mpiexec -n 3 on the default model: its name and no model are served, another name is a
    404 between them, and a line with two prompts answers each as its own line does."""
    lines = [batch_line("named", {**GREEDY, "model": "smollm2-135m"}),
             batch_line("other", {**GREEDY, "model": "HuggingFaceTB/SmolLM2-1.7B"}),
             batch_line("second", {**GREEDY, "prompt": "Water boils at"}),
             batch_line("both", {**GREEDY, "prompt": [GREEDY["prompt"], "Water boils at"]})]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--quiet"], ranks=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_output(out)
    assert [(r["custom_id"], status(r)) for r in rows] == [("named", 200), ("other", 404), ("second", 200),
                                                           ("both", 200)]
    assert rows[1]["error"]["code"] == "model_not_found"
    assert rows[0]["response"]["body"]["model"] == "smollm2-135m"
    both = rows[3]["response"]["body"]
    assert [c["index"] for c in both["choices"]] == [0, 1]
    assert texts(rows[3]) == texts(rows[0]) + texts(rows[2])
    assert both["usage"]["prompt_tokens"] == sum(r["response"]["body"]["usage"]["prompt_tokens"]
                                                 for r in (rows[0], rows[2]))
