"""int8 KV through the engine's options, the sizing model and the run summary: the bytes each side
counts are the store's (int8 with its per-token scales), and options that do not apply are
refused with a message naming them."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fastdecode.engine.args import EngineArgs, resolve_dtypes
from fastdecode.model.presets import PRESETS
from fastdecode.sizing.plan import main as plan_main
from fastdecode.sizing.schema import MODEL_PRESETS
from rworker import KVStore
from rworker.protocol.kvformat import kv_elem_bytes, kv_token_bytes


def test_int8_bytes_agree_between_the_store_the_engine_and_the_sizing_model():
    from fastdecode.model.config import config_from_hf_dict
    cfg = PRESETS["llama-3-8b"]
    L, Hkv, D = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    store = KVStore(L, Hkv, D, "int8", threads=1)
    assert store.kv_bytes_per_token() == L * 2 * Hkv * (D + 4) == L * kv_token_bytes("int8", Hkv, D)
    config = config_from_hf_dict({**cfg, "rms_norm_eps": 1e-5, "rope_theta": 1e4}, "llama-3-8b")
    assert config.kv_bytes_per_token("int8") == store.kv_bytes_per_token()
    dims = MODEL_PRESETS["llama-3-8b"]
    assert dims.kv_bytes_per_token_layer(kv_elem_bytes("int8", D)) * L == store.kv_bytes_per_token()
    # 32 tokens at one layer fill one page per KV head: K and V runs of 32 x D bytes, 32 scales each
    store.append(0, np.zeros(32, np.int64), *np.zeros((2, 32, Hkv, D), np.float32))
    assert store.bytes_committed() == Hkv * 2 * (32 * D + 32 * 4)


@pytest.mark.parametrize("kv, probs, needle", [("int8", "bf16", "int8"), ("int4", "fp32", "int4")])
def test_options_that_do_not_apply_to_the_kv_dtype_are_refused_by_name(kv, probs, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_dtypes(EngineArgs(kv_dtype=kv, attn_probs=probs), torch.device("cpu"))


def test_plan_counts_int8_bytes_and_scales(capsys):
    def plan(kv, context=4096, *extra):
        code = plan_main(["--gpu-profile", "a10", "--model", "llama-7b", "--cpu-bw", "150", "--batch", "1024",
                          "--context", str(context), "--kv-dtype", kv, "--json", *extra])
        assert code == 0
        return json.loads(capsys.readouterr().out)
    # on 8 R-workers the KV they hold scales with the bytes per token, (128 + 4) / (2 * 128) of
    # bf16's at llama-7b's head dim 128, and so does the R-time each added token costs (the
    # difference of two contexts that both fit: the per-call overhead cancels)
    on8 = ("--rworkers", "8", "--no-device-kv")      # all KV on the R-workers (int8 has no device tier)
    bf16, int8 = plan("bf16", 4096, *on8), plan("int8", 4096, *on8)
    assert int8["kv_tokens_capacity"] / bf16["kv_tokens_capacity"] == pytest.approx(256 / 132, rel=1e-3)
    slope = {kv: plan(kv, 2048, *on8)["r_layer_s"] - plan(kv, 1024, *on8)["r_layer_s"] for kv in ("int8", "bf16")}
    assert slope["int8"] / slope["bf16"] == pytest.approx(132 / 256, rel=1e-3)
    # and the sockets a GPU needs fall with them
    assert plan("int8")["rworkers_needed"] < plan("bf16")["rworkers_needed"]


def test_the_run_summary_names_the_kv_dtype_and_its_bytes(tmp_path):
    import subprocess
    import sys
    inp, out, stats = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "stats.json"
    inp.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "Hello", "max_tokens": 4, "temperature": 0}}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "fastdecode", "generate", "-i", str(inp), "-o", str(out),
                           "--kv-dtype", "int8", "--stats-json", str(stats), "--quiet"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(stats.read_text())["summary"]
    assert summary["kv_dtype"] == "int8"
    assert summary["kv_bytes_per_token"] == 30 * kv_token_bytes("int8", 3, 64)
    row = json.loads(out.read_text().splitlines()[0])
    assert row["response"]["status_code"] == 200
