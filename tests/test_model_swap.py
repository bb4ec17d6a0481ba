"""A model changed between a stop and its rerun: with `-m latest` a link to v1, a job stopped
mid-way, `latest` pointed at v2 (the same shapes, config and tokenizer: a retrained model) and
the same command rerun. The output's rows and its in-flight save are bound to the model's
content (model/identity.py), so the rerun is refused (exit 2, naming both models) instead of
mixing two models' text in one output; `--overwrite` starts over. The same model reached by
another path resumes."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import batch_line, read_output, run_fastdecode
from inprocess import generate

from fastdecode.batch import binding, inflight, lock
from fastdecode.batch.binding import ForeignOutput
from fastdecode.batch.inflight_read import Untrusted
from fastdecode.cli import UsageError, build_parser, validate_generate
from fastdecode.model.identity import model_identity


def tiny_llama(path, seed: int) -> None:
    """A 2-layer random llama with a word-level tokenizer; the seed alone picks its weights."""
    import torch
    import transformers
    from family_cases import save_tokenizer
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    save_tokenizer(str(path))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tiny_llama(root / "v1", seed=0)
    tiny_llama(root / "v2", seed=1)
    return root


def point(link, target) -> None:
    """Point the link `link` at `target`, as `ln -sfn` does."""
    if os.path.islink(link):
        os.unlink(link)
    os.symlink(target, link)


def safetensors_header(path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def validate(argv: list[str]) -> None:
    """The command's checks before any compute, in-process (the lock they take is let go)."""
    try:
        validate_generate(build_parser().parse_args(["generate"] + argv))
    finally:
        lock.release_all()


def test_identity_tells_a_retrained_model_from_its_base_and_follows_the_content(models, tmp_path):
    v1, v2 = models / "v1", models / "v2"
    # everything but the weights' values is the same: names, shapes, offsets, config, tokenizer
    assert safetensors_header(v1 / "model.safetensors") == safetensors_header(v2 / "model.safetensors")
    assert (v1 / "config.json").read_bytes() == (v2 / "config.json").read_bytes()
    one, two = model_identity(str(v1)), model_identity(str(v2))
    assert one["digest"] != two["digest"]
    latest = tmp_path / "latest"
    point(latest, v1)
    assert model_identity(str(latest)) == {"model": str(latest), "path": str(v1), "digest": one["digest"]}
    copy = tmp_path / "copy"
    shutil.copytree(v1, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config, indent=4, sort_keys=False))   # reformatted only
    assert model_identity(str(copy))["digest"] == one["digest"]
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["model"]["vocab"]["t9"], tok["model"]["vocab"]["t10"] = 10, 9                  # another tokenizer
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    assert model_identity(str(copy))["digest"] != one["digest"]
    assert model_identity(str(v1), tokenizer=str(copy))["digest"] != one["digest"]


def lines(n: int) -> str:
    """Short and long requests: a stop after a few steps finds rows written and sequences in flight."""
    return "".join(batch_line(f"request-{i}", {"prompt": [5, 6, 7 + i], "temperature": 0, "ignore_eos": True,
                                               "max_tokens": 2 if i % 2 else 40}) + "\n" for i in range(n))


def test_a_rerun_after_the_model_behind_its_name_changed_is_refused(models, tmp_path):
    from fastdecode import LLM
    v1, v2, latest = models / "v1", models / "v2", tmp_path / "latest"
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(lines(8))
    point(latest, v1)
    argv = ["-m", str(latest), "-i", str(inp), "-o", str(out)]
    llm = LLM(str(latest), device="cpu", dtype="float32", kv_dtype="fp32")
    try:
        engine = llm.engine
        assert generate(engine, argv, stop_at=4)[2] == 75
        kept = out.read_bytes()
        assert 0 < len(read_output(out)) < 8 and os.path.exists(f"{out}.inflight")
        one = model_identity(str(latest))

        point(latest, v2)                                      # `latest` now names another model
        two = model_identity(str(latest))
        both = (rf"output {out} was written by model {latest} \({v1}, identity {one['digest'][:12]}\), not this "
                rf"job's {latest} \({v2}, identity {two['digest'][:12]}\)")
        with pytest.raises(UsageError, match=both):
            validate(argv)
        proc = run_fastdecode(["generate", "--quiet"] + argv, timeout=300)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert str(v1) in proc.stderr and str(v2) in proc.stderr and "--overwrite" in proc.stderr
        with pytest.raises(ForeignOutput, match=both):         # the same refusal where the job opens its output
            generate(engine, argv)
        assert out.read_bytes() == kept and os.path.exists(f"{out}.inflight")
        with pytest.raises(Untrusted, match="model_digest"):   # the save is bound to v1's content too
            inflight.read(f"{out}.inflight", {"model_digest": two["digest"]})

        point(latest, v1)                                      # the same model again: the job resumes
        _, rep, code = generate(engine, argv)
        assert code == 0 and rep["this_run"]["continued_sequences"] > 0
        assert sorted(r["custom_id"] for r in read_output(out)) == [f"request-{i}" for i in range(8)]
        point(latest, v2)
        validate(argv + ["--overwrite"])                       # starting over with v2 is allowed
    finally:
        llm.close()


def test_a_save_alone_is_bound_to_its_model(models, tmp_path):
    from fastdecode import LLM
    latest, inp, out = tmp_path / "latest", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(batch_line(f"r{i}", {"prompt": [5, 6, i + 7], "max_tokens": 40, "temperature": 0,
                                                "ignore_eos": True}) + "\n" for i in range(3)))
    point(latest, models / "v1")
    argv = ["-m", str(latest), "-i", str(inp), "-o", str(out)]
    llm = LLM(str(latest), device="cpu", dtype="float32", kv_dtype="fp32")
    try:
        assert generate(llm.engine, argv, stop_at=3)[2] == 75
    finally:
        llm.close()
    assert out.read_bytes() == b"" and os.path.exists(f"{out}.inflight")     # no row yet: the save alone
    point(latest, models / "v2")
    with pytest.raises(UsageError, match=f"output {out} was written by model {latest}"):
        validate(argv)


def test_an_output_recorded_before_models_were_named_resumes_and_is_restamped(models, tmp_path):
    from conftest import write_bound_rows

    from fastdecode.batch.output import OutputWriter
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(lines(2))
    row = {"id": "x", "custom_id": "request-0", "response": {"status_code": 200, "body": {}}, "error": None}
    write_bound_rows(inp, out, [(1, row)], model=str(models / "v1"))          # a header without a model
    assert "model" not in binding.read_header(f"{out}.fingerprints")[0]
    validate(["-m", str(models / "v1"), "-i", str(inp), "-o", str(out)])
    identity = model_identity(str(models / "v1"))
    OutputWriter(str(out), str(inp), model=identity).close()
    assert binding.read_header(f"{out}.fingerprints")[0]["model"] == identity
    assert sum(len(chunk) for chunk in binding.records(str(out))) == 1            # its record kept
    with pytest.raises(UsageError, match="was written by model"):
        validate(["-m", str(models / "v2"), "-i", str(inp), "-o", str(out)])
