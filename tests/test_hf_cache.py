"""Models by the names people use: `org/name` found in a local Hugging Face cache that the tests
write themselves (refs, snapshots, revisions; HF_HUB_CACHE and HF_HOME), never downloaded; a model
or revision not there is one error saying how to get it; request lines may name the model by its
repo id or its directory."""
from __future__ import annotations

import json
import os

import pytest
from conftest import batch_line, read_output, run_fastdecode

from fastdecode.model.config import ConfigError
from fastdecode.model.names import served_model
from fastdecode.model.source import resolve_model

MAIN, V2 = "a" * 40, "b" * 40          # commit hashes of the two snapshots


def tiny_llama(path, layers: int) -> None:
    """A 2-4 layer random llama with a word-level tokenizer, saved as an HF model directory."""
    import torch
    import transformers
    from family_cases import save_tokenizer
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    save_tokenizer(str(path))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A cache holding org/tiny at main (2 layers) and at tag v2 (3 layers), laid out as the hub
    client lays it out: blobs are files of the snapshot directories here (links in a real cache)."""
    root = tmp_path_factory.mktemp("hf") / "hub"
    repo = root / "models--org--tiny"
    for commit, layers in ((MAIN, 2), (V2, 3)):
        tiny_llama(repo / "snapshots" / commit, layers)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return root


def layers_of(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def test_a_repo_id_resolves_to_its_snapshot_by_ref_tag_or_commit(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    src = resolve_model("org/tiny")
    assert (src.kind, src.repo_id, src.name) == ("hf", "org/tiny", "org/tiny")
    assert src.path == str(hub / "models--org--tiny" / "snapshots" / MAIN) and layers_of(src.path) == 2
    assert layers_of(resolve_model("org/tiny", "v2").path) == 3
    assert resolve_model("org/tiny", V2).path.endswith(V2)
    assert resolve_model("org/tiny", MAIN).path.endswith(MAIN)


def test_hf_home_is_read_when_no_hub_cache_is_set(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hub.parent))          # the cache is HF_HOME/hub
    assert resolve_model("org/tiny").path.endswith(MAIN)


def test_an_absent_model_or_revision_says_how_to_get_it(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(ConfigError) as e:
        resolve_model("meta-llama/Meta-Llama-3-8B-Instruct")
    msg = str(e.value)
    assert "\n" not in msg and str(hub) in msg and "never downloads" in msg
    assert "`hf download meta-llama/Meta-Llama-3-8B-Instruct`" in msg
    assert "--local-dir ./Meta-Llama-3-8B-Instruct` and pass -m ./Meta-Llama-3-8B-Instruct" in msg
    with pytest.raises(ConfigError) as e:
        resolve_model("org/tiny", "v9")
    msg = str(e.value)
    assert "at revision 'v9'" in msg and "hf download org/tiny --revision v9" in msg
    assert f"main ({MAIN[:12]})" in msg and f"v2 ({V2[:12]})" in msg          # what the cache does hold


def test_revision_needs_a_repo_id_and_a_directory_wins_over_the_cache(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with pytest.raises(ConfigError, match="--revision 'v2' picks a snapshot"):
        resolve_model("smollm2-135m", "v2")
    local = tmp_path / "org" / "tiny"                          # ./org/tiny exists: it is that directory
    tiny_llama(local, 4)
    monkeypatch.chdir(tmp_path)
    src = resolve_model("org/tiny")
    assert src.repo_id is None and layers_of(src.path) == 4


def test_requests_may_name_the_repo_id_or_the_snapshot(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    src = resolve_model("org/tiny")
    served = served_model(src)
    assert served.reported == "org/tiny"
    assert served.mismatch("org/tiny") is None and served.mismatch(src.path) is None
    assert "does not exist" in served.mismatch("org/other")
    # a directory in the cache given as a path is still also its repo id (as before)
    assert served_model(resolve_model(src.path)).mismatch("org/tiny") is None


def test_info_and_generate_by_repo_id(hub, tmp_path):
    env = {"HF_HUB_CACHE": str(hub)}
    proc = run_fastdecode(["info", "-m", "org/tiny", "--revision", "v2"], timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "llama: 3 layers" in proc.stdout and V2 in proc.stdout
    snapshot = str(hub / "models--org--tiny" / "snapshots" / MAIN)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(batch_line(cid, {"model": model, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
                           + "\n" for cid, model in (("by-id", "org/tiny"), ("by-dir", snapshot), ("other", "org/x"))))
    proc = run_fastdecode(["generate", "-m", "org/tiny", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["custom_id"]: r["response"] for r in read_output(out)}
    assert rows["by-id"]["status_code"] == rows["by-dir"]["status_code"] == 200
    assert rows["by-id"]["body"]["model"] == "org/tiny"
    assert rows["by-id"]["body"]["choices"][0]["text"] == rows["by-dir"]["body"]["choices"][0]["text"]
    assert rows["other"]["status_code"] == 404


def test_generate_with_an_absent_repo_id_exits_2_with_one_line(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi"}) + "\n")
    proc = run_fastdecode(["generate", "-m", "meta-llama/Meta-Llama-3-8B-Instruct", "-i", str(inp),
                           "-o", str(tmp_path / "o.jsonl")], timeout=120, env={"HF_HUB_CACHE": str(tmp_path / "none")})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastdecode: error: model 'meta-llama/Meta-Llama-3-8B-Instruct' "
                                                   "is not in the local Hugging Face cache"), proc.stderr
    assert "hf download meta-llama/Meta-Llama-3-8B-Instruct" in lines[0]


def test_plan_takes_a_repo_id_from_the_cache(hub):
    proc = run_fastdecode(["plan", "--model", "org/tiny", "--gpu-profile", "h100", "--cpu-bw", "100", "--batch", "64",
                           "--json"], timeout=120, env={"HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "org/tiny"
    proc = run_fastdecode(["plan", "--model", "org/absent", "--gpu-profile", "h100", "--cpu-bw", "100"], timeout=120,
                          env={"HF_HUB_CACHE": str(hub)})
    assert proc.returncode == 2 and "hf download org/absent" in proc.stderr


# ---------------------------------------------------------------------------- revisions stay in the cache

@pytest.fixture
def cache_with_outside(tmp_path, monkeypatch):
    """A cache holding org/tiny at main, and beside it (outside the cache) a model directory and a
    file holding a commit hash, for revisions and refs that try to reach them."""
    root = tmp_path / "hub"
    repo = root / "models--org--tiny"
    (repo / "snapshots" / MAIN).mkdir(parents=True)
    (repo / "snapshots" / MAIN / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (tmp_path / "outside" / "model").mkdir(parents=True)
    (tmp_path / "outside" / "model" / "config.json").write_text("{}")
    (tmp_path / "outside_ref").write_text(MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return repo


def test_a_revision_is_a_ref_or_a_commit_never_a_path(cache_with_outside):
    from fastdecode.model.hf_cache import cached_snapshot
    assert cached_snapshot("org/tiny").endswith(MAIN)
    # refs/../../../outside_ref is a file holding a commit, outside refs/: read before, refused now
    for revision in ("../../../outside_ref", "../../../../../../../../../dev/zero", "/dev/zero", "main/../main"):
        with pytest.raises(ConfigError, match="is not a branch, tag or commit") as e:
            cached_snapshot("org/tiny", revision)
        assert "\n" not in str(e.value) and repr(revision) in str(e.value)


def test_a_ref_file_resolves_only_to_a_snapshot_inside_the_cache(cache_with_outside):
    from fastdecode.model.hf_cache import cached_snapshot
    refs = cache_with_outside / "refs"
    (refs / "escape").write_text("../../outside/model")       # snapshots/../../outside/model: another model
    with pytest.raises(ConfigError, match=r"refs/escape holds '\.\./\.\./outside/model', not a commit hash"):
        cached_snapshot("org/tiny", "escape")
    os.symlink(cache_with_outside.parent.parent / "outside_ref", refs / "linked")   # a link out of refs/
    with pytest.raises(ConfigError, match="is not a file inside"):
        cached_snapshot("org/tiny", "linked")
    os.symlink("/dev/zero", refs / "zero")                    # a device: never read endlessly
    with pytest.raises(ConfigError, match="is not a file inside"):
        cached_snapshot("org/tiny", "zero")
    (refs / "huge").write_text("a" * 10**6)                   # read up to a hash's length, not whole
    with pytest.raises(ConfigError, match="not a commit hash"):
        cached_snapshot("org/tiny", "huge")
