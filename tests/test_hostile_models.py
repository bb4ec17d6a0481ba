"""Model files are inputs: a config of the wrong shape, type or size, or one that disagrees with
its weights, is a one-line error naming the field, its value and what the weights say, found
before anything is sized from it (generate, info); a chat template that runs forever costs its
line a 400, not the job. A failure on rank 0 before the first step ends every rank at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import MPIEXEC, MPIEXEC_ERROR, REPO, batch_line, read_output, run_fastdecode

H, V, LAYERS, HEADS, KV, INTER = 64, 100, 2, 4, 2, 128      # the tiny model's true shape
BASE = {"model_type": "llama", "hidden_size": H, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "num_hidden_layers": LAYERS, "intermediate_size": INTER, "vocab_size": V, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5}


def weights(hidden=H, vocab=V, layers=LAYERS, heads=HEADS, kv=KV, inter=INTER, head_dim=None) -> dict[str, np.ndarray]:
    hd = head_dim or hidden // heads
    w = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                  p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
                  p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
                  p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                  p + "mlp.down_proj.weight": (hidden, inter)})
    return {name: np.zeros(shape, np.float32) for name, shape in w.items()}


def hf_dir(root, config, tensors=None) -> str:
    from safetensors.numpy import save_file
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    save_file(tensors if tensors is not None else weights(), str(root / "model.safetensors"))
    return str(root)


def read(path: str):
    from fastdecode.model.source import read_config, resolve_model
    return read_config(resolve_model(path))


# ---------------------------------------------------------------------------- config.json

HOSTILE_CONFIGS = {
    "list-shaped": ("[1, 2, 3]", "must hold a JSON object of config fields, got a list"),
    "deeply nested": ('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON"),
    "heads 0": ({"num_attention_heads": 0}, "num_attention_heads must be an integer in [1, 1,024], got 0"),
    "layers 10^9": ({"num_hidden_layers": 10**9}, "num_hidden_layers must be an integer in [1, 1,024], got 1000000000"),
    "vocab 0": ({"vocab_size": 0}, "vocab_size must be an integer in [1, "),
    "vocab negative": ({"vocab_size": -5}, "got -5"),
    "hidden 0": ({"hidden_size": 0}, "hidden_size must be an integer in [1, "),
    "intermediate 10^9": ({"intermediate_size": 10**9}, "intermediate_size must be an integer in [1, "),
    "positions 10^12": ({"max_position_embeddings": 10**12}, "max_position_embeddings must be an integer in [2, "),
    "eps negative": ({"rms_norm_eps": -1}, "rms_norm_eps must be a finite number in (0, 1], got -1"),
    "size as text": ({"hidden_size": "64"}, "hidden_size must be an integer in [1, 65,536], got '64'"),
    "layers as bool": ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    "rope_scaling a list": ({"rope_scaling": [1, 2]}, "rope_scaling must be an object (or null), got list"),
    "more kv heads than heads": ({"num_key_value_heads": 8}, "num_key_value_heads must be at most num_attention_heads"),
    "hidden missing": ({"hidden_size": None}, "hidden_size is missing"),
}


@pytest.mark.parametrize("case", list(HOSTILE_CONFIGS))
def test_a_hostile_config_is_a_config_error_naming_the_field(tmp_path, case):
    from fastdecode.model.config import ConfigError
    change, needle = HOSTILE_CONFIGS[case]
    config = change if isinstance(change, str) else {k: v for k, v in {**BASE, **change}.items() if v is not None}
    path = hf_dir(tmp_path / "m", config)
    with pytest.raises(ConfigError) as err:
        read(path)
    assert needle in str(err.value) and path in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


WEIGHT_MISMATCHES = {
    "layers beyond the weights": ({"num_hidden_layers": 3}, {},
                                  ("num_hidden_layers is 3, but the weights hold layers 2 (model.layers.0..1): "
                                   "layer 2 is missing")),
    "vocab against the embedding": ({"vocab_size": 200}, {},
                                    ("vocab_size 200, hidden_size 64 make model.embed_tokens.weight [200, 64], "
                                     "but the weights' is [100, 64]")),
    "heads against q_proj": ({}, {"heads": 8, "kv": 4, "head_dim": 16},
                             ("num_attention_heads 4 x head_dim 16, hidden_size 64 make "
                              "model.layers.0.self_attn.q_proj.weight [64, 64], but the weights' is [128, 64]")),
    "intermediate against the MLP": ({"intermediate_size": 256}, {},
                                     ("intermediate_size 256, hidden_size 64 make model.layers.0.mlp.gate_proj.weight "
                                      "[256, 64], but the weights' is [128, 64]")),
}


@pytest.mark.parametrize("case", list(WEIGHT_MISMATCHES))
def test_a_config_that_disagrees_with_its_weights_names_both(tmp_path, case):
    from fastdecode.model.config import ConfigError
    change, shape, needle = WEIGHT_MISMATCHES[case]
    path = hf_dir(tmp_path / "m", {**BASE, **change}, weights(**shape))
    with pytest.raises(ConfigError) as err:
        read(path)
    assert needle in str(err.value), str(err.value)


def test_a_config_that_matches_its_weights_is_read(tmp_path):
    c = read(hf_dir(tmp_path / "m", BASE))
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (LAYERS, HEADS, KV, H // HEADS, V)


# ---------------------------------------------------------------------------- GGUF

def write_gguf(path: str, block_count=LAYERS, head_count=HEADS, vocab=V) -> str:
    import gguf
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(block_count)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(head_count)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, arr in weights().items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            name = f"blk.{i}.{block[rest.rsplit('.', 1)[0]]}.weight"
        else:
            name = names[name]
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("field,value,needle", [
    ("head_count", 0, "num_attention_heads (GGUF llama.attention.head_count) must be an integer in [1, 1,024], got 0"),
    ("block_count", 10**9, "num_hidden_layers (GGUF llama.block_count) must be an integer in [1, 1,024]"),
    ("block_count", 3, "num_hidden_layers is 3, but the weights hold layers 2"),
    ("vocab", 300, ("vocab_size 300, hidden_size 64 make model.embed_tokens.weight [300, 64], but the weights' is "
                    "[100, 64]")),
])
def test_a_gguf_is_checked_against_its_own_tensors(tmp_path, monkeypatch, field, value, needle):
    from fastdecode.model.config import ConfigError
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(str(tmp_path / "m.gguf"), **{field: value})
    with pytest.raises(ConfigError) as err:
        read(path)
    assert needle in str(err.value), str(err.value)


def test_a_good_gguf_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    c = read(write_gguf(str(tmp_path / "m.gguf")))
    assert (c.num_layers, c.num_heads, c.vocab_size) == (LAYERS, HEADS, V)


def test_info_of_a_model_with_a_billion_layers_is_a_usage_error_at_once(tmp_path):
    """`fastdecode info -m` reads the config the same way: a billion layers is named, not built
    (it was a list of 10^9 layer kinds: gigabytes within seconds)."""
    path = write_gguf(str(tmp_path / "m.gguf"), block_count=10**9)
    t0 = time.time()
    proc = run_fastdecode(["info", "-m", path], timeout=120, env={"FASTDECODE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "num_hidden_layers (GGUF llama.block_count) must be an integer in [1, 1,024], got 1000000000" in proc.stderr
    assert "Traceback" not in proc.stderr and time.time() - t0 < 60


# ---------------------------------------------------------------------------- the chat template

def tiny_tokenizer(template: str):
    from tokenizers import Tokenizer as Words
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from fastdecode.model.tokenizer import Tokenizer
    words = Words(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok = Tokenizer.__new__(Tokenizer)
    tok.hf = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2", pad_token="t0")
    tok.hf.chat_template = template
    return tok


ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"


def test_a_chat_template_that_runs_forever_stops_at_its_budget():
    from fastdecode.model.template_budget import CHAT_TEMPLATE_BUDGET_S, TemplateBudgetExceeded
    tok = tiny_tokenizer(ENDLESS)
    done, t0 = [], time.time()

    def render():             # on a thread: the old code rendered 10^10 steps, the test must still end
        try:
            tok.encode_chat([{"role": "user", "content": "t3"}])
        except TemplateBudgetExceeded as e:
            done.append(e)

    worker = threading.Thread(target=render, daemon=True)
    worker.start()
    worker.join(CHAT_TEMPLATE_BUDGET_S + 20)
    assert done and "ran past its budget" in str(done[0]), "the template was not stopped"
    assert time.time() - t0 < CHAT_TEMPLATE_BUDGET_S + 10
    assert tiny_tokenizer("{{ messages[0].content }}").encode_chat([{"role": "user", "content": "t3"}]) == [3]


def test_a_chat_template_that_writes_more_than_the_context_holds_is_stopped():
    from fastdecode.model.template_budget import MIN_TEMPLATE_CHARS, TemplateBudgetExceeded
    one_piece = tiny_tokenizer("{{ 'x' * %d }}{{ messages[0].content }}" % (2 * MIN_TEMPLATE_CHARS))
    with pytest.raises(TemplateBudgetExceeded, match="wrote more than 1,048,576 characters"):
        one_piece.encode_chat([{"role": "user", "content": "t3"}])
    # 10^9 characters in pieces: stopped at the bound, not after a gigabyte is written and tokenized
    looping = tiny_tokenizer(WRITES_1E9 + "{{ messages[0].content }}")
    t0 = time.time()
    with pytest.raises(TemplateBudgetExceeded, match="characters"):
        looping.encode_chat([{"role": "user", "content": "t3"}])
    assert time.time() - t0 < 5
    under_the_bound = tiny_tokenizer("{% for i in range(900) %}{{ 'x' * 1000 }}{% endfor %}")
    assert len(under_the_bound.encode_chat([{"role": "user", "content": "t3"}])) == 1     # one unknown word


WRITES_1E9 = "{% for i in range(100000) %}{% for j in range(10) %}{{ 'x' * 1000 }}{% endfor %}{% endfor %}"


def test_a_line_whose_template_runs_past_its_budget_is_a_400_and_the_job_goes_on(tmp_path):
    model = tmp_path / "m"
    hf_dir(model, BASE)
    tok = tiny_tokenizer("{% if messages[0].content == 't9' %}" + ENDLESS + "{% endif %}"
                         "{% if messages[0].content == 't8' %}" + WRITES_1E9 + "{% endif %}{{ messages[0].content }}")
    tok.hf.save_pretrained(str(model))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat = "/v1/chat/completions"
    inp.write_text("\n".join([
        batch_line("slow", {"messages": [{"role": "user", "content": "t9"}], "max_tokens": 2}, chat),
        batch_line("huge", {"messages": [{"role": "user", "content": "t8"}], "max_tokens": 2}, chat),
        batch_line("fine", {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2}, chat),
        batch_line("ids", {"prompt": [3, 4, 5], "max_tokens": 2}),
    ]) + "\n")
    proc = run_fastdecode(["generate", "-m", str(model), "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["custom_id"]: r for r in read_output(str(out))}
    assert rows["slow"]["response"]["status_code"] == 400
    assert "chat template ran past its budget" in rows["slow"]["error"]["message"], rows["slow"]
    assert rows["huge"]["response"]["status_code"] == 400
    assert "chat template wrote more than" in rows["huge"]["error"]["message"], rows["huge"]
    assert rows["fine"]["response"]["status_code"] == 200 and rows["ids"]["response"]["status_code"] == 200


# ---------------------------------------------------------------------------- rank 0 fails before MPI starts

def bad_model(tmp_path, case: str) -> tuple[list[str], dict, str]:
    """(generate's model arguments, environment, what the error line names) of a start that fails on rank 0."""
    if case == "list config":
        return ["-m", hf_dir(tmp_path / "m", "[1, 2]")], {}, "must hold a JSON object"
    if case == "heads 0":
        return ["-m", hf_dir(tmp_path / "m", {**BASE, "num_attention_heads": 0})], {}, "num_attention_heads"
    blocker = tmp_path / "a-file"                      # the cache "directory" is below a file
    blocker.write_text("")
    return [], {"FASTDECODE_CACHE": str(blocker / "cache")}, "cache directory"


@pytest.mark.parametrize("case", ["list config", "heads 0", "unusable cache"])
def test_a_failure_on_rank_0_before_the_first_step_ends_every_rank_at_once(tmp_path, case):
    """Under mpiexec -n 3: one line naming the cause, exit 2, and every rank gone within 5 s of
    it. The old code's R-workers waited in MPI's start-up for 300 s (the init timeout)."""
    if MPIEXEC is None:
        pytest.fail(MPIEXEC_ERROR)
    model_args, env, needle = bad_model(tmp_path, case)
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": [1, 2], "max_tokens": 2}) + "\n")
    cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "fastdecode", "generate", *model_args, "-i", str(inp),
           "-o", str(tmp_path / "out.jsonl")]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           start_new_session=True, env={**os.environ, **env,
                                                        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")})
    lines, said = [], []

    def read_stderr():
        for line in job.stderr:
            lines.append(line)
            if line.startswith("fastdecode: error:") and not said:
                said.append(time.time())

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        job.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)         # the job this test started, and only it
        job.wait()
        pytest.fail(f"the job outlived its rank 0's error by more than a minute: {''.join(lines)[-2000:]}")
    ended = time.time()
    reader.join(5)
    errors = [line for line in lines if line.startswith("fastdecode: error:")]
    assert job.returncode == 2, (job.returncode, "".join(lines)[-2000:])
    assert len(errors) == 1 and needle in errors[0], "".join(lines)[-2000:]
    assert "Traceback" not in "".join(lines)
    assert ended - said[0] < 5.0, f"ranks ended {ended - said[0]:.1f} s after the error"


def test_a_model_found_unservable_only_as_it_loads_exits_2():
    """After MPI's start-up a ConfigError (a GGUF whose dequantized weights cannot be cached) ends
    the job like the checks before it: one line, exit 2 (an abort of every rank under MPI)."""
    from fastdecode.launch import mpi_env
    from fastdecode.model.config import ConfigError
    with pytest.raises(SystemExit) as end:
        mpi_env.fail(None, ConfigError("m.gguf: its dequantized weights cannot be written to the cache /c"))
    assert end.value.code == 2
    with pytest.raises(SystemExit) as end:
        mpi_env.fail(None, ZeroDivisionError("a bug"))
    assert end.value.code == 1
