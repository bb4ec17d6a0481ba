"""fp8 checkpoints as published (compressed-tensors FP8-Dynamic and per-tensor FP8, transformers'
fbgemm_fp8), written here with safetensors from a tiny random model; `--quantization fp8` on
its float checkpoint; the bad inputs; and how far fp8 moves a model's greedy tokens.

The checkpoints are quantized by this file's own code (amax / 448, torch's cast), not
fastdecode's, so loading checks the layout and the scales, not fastdecode against itself.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from family_cases import CASES, build_hf, prompt_logits, prompts, save_tokenizer
from safetensors.torch import load_file, save_file

from fastdecode.model.config import ConfigError
from fastdecode.model.fp8 import Fp8Weight
from fastdecode.model.quantization import weight_format
from fastdecode.model.source import read_config, resolve_model
from fastdecode.model.spart import SPart
from fastdecode.model.weights import load_weights

PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.\d+\.w[123]\.weight$")
CT_GROUP = {"targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}
LAYOUTS = {   # name -> (quantization_config, per channel, scale dtype)
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                            "quantization_status": "compressed", "config_groups": {"group_0": CT_GROUP},
                            "ignore": ["lm_head"]}, True, torch.bfloat16),
    "compressed-tensors-per-tensor": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "tensor"}}},
         "ignore": ["lm_head"]}, False, torch.float32),
    "fbgemm_fp8": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                    "modules_to_not_convert": ["lm_head"]}, True, torch.float32),
}


def fp8_checkpoint(src: str, dst, layout: str, edit=None) -> str:
    """A copy of the HF directory `src` with its projections in e4m3 and `weight_scale`s, as
    `layout` publishes them. edit(tensors) may break it afterwards."""
    qc, per_channel, scale_dtype = LAYOUTS[layout]
    shutil.copytree(src, dst)
    tensors = {}
    for name, w in load_file(f"{src}/model.safetensors").items():
        if not PROJECTION.search(name):
            tensors[name] = w
            continue
        amax = w.float().abs().amax(dim=-1, keepdim=True) if per_channel else w.float().abs().amax()
        scale = amax / 448                                                      # [out, 1] or []
        tensors[name] = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name + "_scale"] = scale.to(scale_dtype)
    if edit:
        edit(tensors)
    save_file(tensors, f"{dst}/model.safetensors")
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    with open(f"{dst}/config.json", "w") as f:
        json.dump({**cfg, "quantization_config": qc}, f)
    return str(dst)


def spart(path: str, quantization: str | None = None) -> SPart:
    source = resolve_model(path)
    config = read_config(source)
    fmt = weight_format(quantization, source)
    return SPart(config, load_weights(source, config, torch.float32, fmt=fmt), "cpu", torch.float32)


def dequantized_spart(path: str) -> SPart:
    """The float model of a checkpoint's values: every Fp8Weight as its q * scale in float32."""
    source = resolve_model(path)
    config = read_config(source)
    w = load_weights(source, config, torch.float32, fmt=weight_format(None, source))
    return SPart(config, {k: v.dequantize(torch.float32) if isinstance(v, Fp8Weight) else v for k, v in w.items()},
                 "cpu", torch.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Qwen2-shaped (Q/K/V biases), 3 layers, initialized as HF does (std 0.02)."""
    root = tmp_path_factory.mktemp("fp8")
    path, _ = build_hf("qwen2", root, initializer_range=0.02)
    save_tokenizer(path)
    return path, root


def logits(m: SPart, seed: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return prompt_logits(m, prompts(CASES["qwen2"][2], seed=seed))[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_published_layouts_load_with_their_scales(tiny, layout):
    path, root = tiny
    ckpt = fp8_checkpoint(path, root / layout, layout)
    fmt = weight_format(None, resolve_model(ckpt))              # fp8 without being asked
    assert fmt.fp8 and fmt.checkpoint.method == LAYOUTS[layout][0]["quant_method"]
    m = spart(ckpt)
    stored = load_file(f"{ckpt}/model.safetensors")
    w_qkv = m.layers[1]["w_qkv"]
    assert isinstance(w_qkv, Fp8Weight) and isinstance(m.layers[1]["mlp"][1], Fp8Weight)
    assert not isinstance(m.lm_head, Fp8Weight) and m.lm_head.dtype == torch.float32
    parts = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    assert torch.equal(w_qkv.q.float(), torch.cat([stored[p].float() for p in parts]))
    scales = torch.cat([stored[p + "_scale"].float().reshape(-1).expand(stored[p].shape[0]) for p in parts])
    assert torch.equal(w_qkv.scale, scales)
    if layout == "fbgemm_fp8":
        assert w_qkv.act_amax_ub == 1200.0
    # the checkpoint's values, dequantized into a float model, give the same logits
    assert torch.equal(logits(m), logits(dequantized_spart(ckpt)))


def test_quantized_at_load_equals_the_fbgemm_checkpoint_of_the_same_model(tiny):
    """--quantization fp8 on the float checkpoint and the published per-channel fp8 checkpoint
    (float32 scales) hold the same e4m3 values and scales: the same logits, bit for bit."""
    path, root = tiny
    ckpt = fp8_checkpoint(path, root / "fbgemm-eq", "fbgemm_fp8")
    at_load, published = spart(path, "fp8"), spart(ckpt)
    for a, b in zip(at_load.layers, published.layers):
        assert torch.equal(a["w_qkv"].q.float(), b["w_qkv"].q.float()) and torch.equal(a["w_qkv"].scale, b["w_qkv"].scale)
    assert torch.equal(logits(at_load), logits(published))


def test_mixtral_experts_load_and_quantize(tmp_path):
    path, _ = build_hf("mixtral", tmp_path, initializer_range=0.02)
    ckpt = fp8_checkpoint(path, tmp_path / "mixtral-fp8", "compressed-tensors")
    for m in (spart(path, "fp8"), spart(ckpt)):
        moe = m.layers[0]["mlp"]
        assert isinstance(moe.gate_up, Fp8Weight) and moe.gate_up.shape == (4, 256, 256)
        assert isinstance(moe.router, torch.Tensor) and moe.router.dtype == torch.float32   # routing stays float
    assert torch.equal(spart(ckpt).layers[0]["mlp"].down.q.float(),
                       torch.stack([load_file(f"{ckpt}/model.safetensors")[
                           f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"].float() for e in range(4)]))


def drop_scale(t):
    del t["model.layers.1.self_attn.k_proj.weight_scale"]


def bad_scale(t):
    t["model.layers.2.mlp.down_proj.weight_scale"] = torch.ones(192, 2)


@pytest.mark.parametrize("edit,message", [
    (drop_scale, ("fp8 tensor model.layers.1.self_attn.k_proj.weight [64, 192] has no scale "
                  "model.layers.1.self_attn.k_proj.weight_scale")),
    (bad_scale, ("model.layers.2.mlp.down_proj.weight_scale has shape [192, 2]; for model.layers.2.mlp.down_proj.weight "
                 "[192, 256] expected [192] or [192, 1] (per output channel) or one value (per tensor)")),
])
def test_missing_or_misshaped_scales_are_named(tiny, edit, message):
    path, root = tiny
    ckpt = fp8_checkpoint(path, root / edit.__name__, "compressed-tensors", edit)
    with pytest.raises(ConfigError, match=re.escape(message)):
        weight_format(None, resolve_model(ckpt))


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method 'gptq' is not served"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise fp8 is not served"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "config_groups.group_0.weights: type 'int', num_bits 8; fastdecode serves float 8-bit (FP8) weights only"),
])
def test_other_quantizations_are_refused(tiny, qc, message):
    path, root = tiny
    dst = root / f"other-{qc['quant_method']}-{len(qc)}"
    shutil.copytree(path, dst, dirs_exist_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        weight_format(None, resolve_model(str(dst)))


def test_unknown_quantization_value():
    from fastdecode import LLM
    with pytest.raises(ValueError, match=r"quantization must be None or one of fp8, got 'int4'"):
        LLM("random:smollm2-135m:layers=1", quantization="int4", device="cpu")


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastdecode", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, check=False)


def test_cli_bad_inputs_exit_2_naming_them(tiny, tmp_path):
    path, root = tiny
    ckpt = fp8_checkpoint(path, root / "cli-missing", "fbgemm_fp8", drop_scale)
    prompts_file = tmp_path / "in.jsonl"
    prompts_file.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": [5, 6, 7], "max_tokens": 2}}) + "\n")
    common = ["generate", "-i", str(prompts_file), "-o", str(tmp_path / "out.jsonl"), "--quiet"]
    bad_value = run_cli(*common, "--quantization", "int4")
    assert bad_value.returncode == 2 and "argument --quantization/-q: invalid choice: 'int4'" in bad_value.stderr
    missing = run_cli(*common, "-m", ckpt)
    assert missing.returncode == 2
    assert "has no scale model.layers.1.self_attn.k_proj.weight_scale" in missing.stderr.strip().splitlines()[-1]


def test_engine_serves_an_fp8_checkpoint_unasked_and_float32_with_fp8(tiny, capfd):
    """The engine's start-up line says what is fp8 and from where; --dtype float32 with fp8 runs
    (the GEMM on the weights' values in float32 here); the published checkpoint and fp8 at load
    give the same greedy tokens (the same values)."""
    from fastdecode import LLM, SamplingParams
    path, root = tiny
    ckpt = fp8_checkpoint(path, root / "engine-fbgemm", "fbgemm_fp8")
    ids = [p.tolist() for p in prompts([23, 40, 9], seed=3)]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for name, model, quantization in (("checkpoint", ckpt, None), ("at load", path, "fp8")):
        llm = LLM(model, dtype="float32", kv_dtype="fp32", device="cpu", quantization=quantization, quiet=True)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in ids], greedy, use_tqdm=False)
        finally:
            llm.close()
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        line = next(x for x in capfd.readouterr().err.splitlines() if "fp8 weights" in x)
        origin = "the checkpoint's, fbgemm_fp8" if quantization is None else "quantized at load"
        assert f"fp8 weights ({origin}): 12 projections of 3 layers in float8_e4m3fn" in line
        assert "embeddings, norms and the LM head stay float32" in line and "dequantized to float32" in line
    assert tokens["checkpoint"] == tokens["at load"]


def test_greedy_agreement_is_that_of_noise_of_fp8s_size(tiny):
    """Teacher-forced greedy agreement of fp8 (at load) with float32, over 8 prompts of 41-80
    tokens, against a control: the float model with Gaussian noise of the same energy as fp8's
    error added to each projection. The measured error first: e4m3 keeps 3 mantissa bits, so a
    weight's rounding error is uniform within half a step, 2^-4 to 2^-5 of its value: about
    2^-3 / sqrt(12) * ln 2 = 0.025 of it in RMS. fp8 may flip no more argmaxes than noise of
    its size (less 2% of the positions, the control's own spread over seeds): a systematic error
    (a misapplied scale, a biased rounding) would."""
    path, _ = tiny
    source = resolve_model(path)
    config = read_config(source)
    floats = load_weights(source, config, torch.float32)
    ref, fp8 = spart(path), spart(path, "fp8")
    errs = []
    control = {}
    g = torch.Generator().manual_seed(0)
    for name, w in floats.items():
        if PROJECTION.search(name):
            delta = Fp8Weight.quantize(w).dequantize(torch.float32) - w
            errs.append(float(delta.norm() / w.norm()))
            noise = torch.randn(w.shape, generator=g)
            control[name] = w + noise * (delta.norm() / noise.norm())
        else:
            control[name] = w
    assert 0.02 < sum(errs) / len(errs) < 0.03 and max(errs) < 2.0 ** -4, errs
    noisy = SPart(config, control, "cpu", torch.float32)

    def agreement(m):
        hits = total = 0
        for seed in range(1, 5):
            a, b = logits(ref, seed), logits(m, seed)
            hits, total = hits + int((a.argmax(-1) == b.argmax(-1)).sum()), total + a.shape[0]
        return hits / total
    got, noise = agreement(fp8), agreement(noisy)
    assert got < 1.0, "fp8 changed no argmax: was anything quantized?"
    assert got >= noise - 0.02, f"fp8 agrees at {got:.1%}, noise of its size at {noise:.1%}"
