"""The sparse MoE MLP (fastdecode/model/moe.py) against HF transformers' own MoE blocks of
mixtral, qwen2_moe and qwen3_moe, fed through stack_experts from both checkpoint layouts; and
stack_experts on what save_pretrained writes."""
from __future__ import annotations

import re

import pytest
import torch

from fastdecode.model.moe import MoESpec, SparseMoE, stack_experts

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
FP32_RTOL = 1e-5      # max |ours - HF| relative to max |HF|
BF16_RTOL = 1e-2      # a couple of bf16 ulps: rows meet the GEMMs in other groupings than HF's


def tiny_config(family: str):
    """hidden 64-128, 4-8 experts, top-2, intermediate 32-64; one decoder layer for whole models."""
    import transformers as tf
    common = dict(vocab_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=48, num_local_experts=8, **common)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(hidden_size=96, moe_intermediate_size=32, intermediate_size=80,
                                shared_expert_intermediate_size=40, num_experts=6, **common)
    else:
        cfg = tf.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, intermediate_size=96,
                                num_experts=4, norm_topk_prob=True, head_dim=32, **common)
    cfg._experts_implementation = "eager"        # HF's reference loop over experts
    return cfg


def spec_of(family: str, cfg) -> MoESpec:
    if family == "mixtral":
        return MoESpec(cfg.num_local_experts, cfg.num_experts_per_tok, True, cfg.hidden_act,
                       fp32_routing_weights=True)
    return MoESpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_act)


def hf_block(family: str, seed: int = 0):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cls = {"mixtral": MixtralSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
           "qwen3_moe": Qwen3MoeSparseMoeBlock}[family]
    cfg = tiny_config(family)
    torch.manual_seed(seed)
    block = cls(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():              # experts are torch.empty: give them values
            p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    return cfg, block


def per_expert_layout(sd: dict, prefix: str, family: str) -> dict:
    """HF's fused block state dict -> the published per-expert checkpoint names under prefix."""
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = {prefix + k: v for k, v in sd.items() if not k.startswith("experts.")}
    g, u = sd["experts.gate_up_proj"].chunk(2, dim=1)               # [E, I, h] each
    for e in range(g.shape[0]):
        out[f"{prefix}experts.{e}.{gate}.weight"] = g[e].clone()
        out[f"{prefix}experts.{e}.{up}.weight"] = u[e].clone()
        out[f"{prefix}experts.{e}.{down}.weight"] = sd["experts.down_proj"][e].clone()
    return out


def moe_from_block(family: str, cfg, block, layout: str) -> SparseMoE:
    sd = {k: v.detach() for k, v in block.state_dict().items()}
    if layout == "fused":
        weights, prefix = {"model.layers.3.mlp." + k: v for k, v in sd.items()}, "model.layers.3.mlp."
    else:
        prefix = "model.layers.3." + ("block_sparse_moe." if family == "mixtral" else "mlp.")
        weights = per_expert_layout(sd, prefix, family)
    used: set[str] = set()
    parts = stack_experts(weights, prefix, spec_of(family, cfg).num_experts, consumed=used)
    assert used == set(weights), set(weights) - used
    return SparseMoE(spec_of(family, cfg), **parts)


def hf_out(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return block(x[None]).reshape(x.shape)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def paths():
    has_grouped = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    return ["loop", pytest.param("grouped", marks=pytest.mark.skipif(not has_grouped, reason="no grouped_mm"))]


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_matches_hf_block(family, layout, n, path):
    cfg, block = hf_block(family)
    moe = moe_from_block(family, cfg, block, layout)
    moe.use_grouped_mm = path == "grouped"
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    if n == 300:                                   # the big batch keeps every expert busy
        _, experts = moe.route(x)
        assert (torch.bincount(experts.reshape(-1), minlength=moe.spec.num_experts) > 0).all()
    ours = moe(x)
    assert ours.shape == x.shape and ours.dtype == torch.float32
    assert rel_err(ours, hf_out(block, x)) < FP32_RTOL


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("family", FAMILIES)
def test_idle_experts(family, path):
    """Experts that get no rows: their router rows point against every input."""
    cfg, block = hf_block(family)
    idle = [0, 2] if family != "qwen3_moe" else [1]
    with torch.no_grad():
        block.gate.weight[idle] = -block.gate.weight[idle].abs() - 1.0
    moe = moe_from_block(family, cfg, block, "fused")
    moe.use_grouped_mm = path == "grouped"
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).abs()
    _, experts = moe.route(x)
    counts = torch.bincount(experts.reshape(-1), minlength=moe.spec.num_experts)
    assert (counts[idle] == 0).all() and (counts > 0).sum() >= moe.spec.top_k
    assert rel_err(moe(x), hf_out(block, x)) < FP32_RTOL


@pytest.mark.parametrize("path", paths())
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_matches_hf_block(family, path):
    cfg, block = hf_block(family)
    block = block.to(torch.bfloat16)
    moe = moe_from_block(family, cfg, block, "per_expert")
    moe.use_grouped_mm = path == "grouped"
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    ours, ref = moe(x), hf_out(block, x)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(moe.route(x)[1], block.gate(x)[2])          # the same experts for every row
    assert rel_err(ours, ref) < BF16_RTOL
    # rounding where HF rounds leaves (nearly) every row bit-identical on the CPU; casting the
    # routing weights the other family's way changes most of them by an ulp
    assert (ours == ref).all(dim=-1).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_empty_batch(family, dtype):
    cfg, block = hf_block(family)
    moe = moe_from_block(family, cfg, block.to(dtype), "fused")
    out = moe(torch.empty(0, cfg.hidden_size, dtype=dtype))
    assert out.shape == (0, cfg.hidden_size) and out.dtype == dtype


def test_spec_and_shapes_are_checked():
    cfg, block = hf_block("mixtral")                                 # h = 64, 2I = 96
    parts = stack_experts({"p." + k: v for k, v in block.state_dict().items()}, "p.", 8)
    with pytest.raises(ValueError, match="experts"):
        SparseMoE(MoESpec(5, 2, True), **parts)
    with pytest.raises(ValueError, match="activation"):
        SparseMoE(MoESpec(8, 2, True, act="swish2"), **parts)
    for name in ("gate_up", "down"):                                  # a transposed tensor
        with pytest.raises(ValueError, match=name):
            SparseMoE(MoESpec(8, 2, True), **{**parts, name: parts[name].transpose(1, 2)})
    with pytest.raises(ValueError, match="gate_up_proj"):
        stack_experts({"p.gate.weight": parts["router"], "p.experts.down_proj": parts["down"],
                       "p.experts.gate_up_proj": parts["gate_up"].transpose(1, 2)}, "p.", 8)


# ----------------------------------------------------------------------------- saved checkpoints

def _model_class(family: str):
    import transformers as tf
    return {"mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM,
            "qwen3_moe": tf.Qwen3MoeForCausalLM}[family]


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(family, model, tensors as save_pretrained writes them, tensors with save_original_format=False)."""
    from safetensors.torch import load_file
    family = request.param
    torch.manual_seed(3)
    model = _model_class(family)(tiny_config(family)).eval()
    loaded = []
    for original in (True, False):
        d = tmp_path_factory.mktemp(f"{family}-{original}")
        model.save_pretrained(d, save_original_format=original)
        loaded.append(load_file(str(d / "model.safetensors")))
    return family, model, loaded[0], loaded[1]


def _layer_prefix(family: str) -> str:
    return "model.layers.0." + ("block_sparse_moe." if family == "mixtral" else "mlp.")


def test_saved_layouts_stack_to_the_same_tensors(saved):
    family, model, per_expert, fused = saved
    num_experts = spec_of(family, model.config).num_experts
    # what each layout holds: the published per-expert names by default, the fused ones otherwise
    assert f"{_layer_prefix(family)}experts.{num_experts - 1}.{'w2' if family == 'mixtral' else 'down_proj'}.weight" \
        in per_expert
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    stacked = []
    for weights in (per_expert, fused):
        used: set[str] = set()
        stacked.append(stack_experts(weights, _layer_prefix(family), num_experts, consumed=used))
        moe_keys = {k for k in weights if k.startswith(("model.layers.0.mlp.", "model.layers.0.block_sparse_moe."))}
        assert used == moe_keys, moe_keys ^ used
    a, b = stacked
    assert set(a) == set(b) == ({"router", "gate_up", "down"} |
                                ({"shared_gate_up", "shared_down", "shared_gate"} if family == "qwen2_moe" else set()))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    mlp = model.model.layers[0].mlp
    assert torch.equal(a["gate_up"], mlp.experts.gate_up_proj) and torch.equal(a["down"], mlp.experts.down_proj)
    # and the MoE built from the saved tensors computes what the model's own block does
    x = torch.randn(9, model.config.hidden_size)
    assert rel_err(SparseMoE(spec_of(family, model.config), **a)(x), hf_out(mlp, x)) < FP32_RTOL


def test_missing_expert_or_wrong_count_is_named(saved):
    family, model, per_expert, fused = saved
    p, num_experts = _layer_prefix(family), spec_of(family, model.config).num_experts
    key = f"{p}experts.1.{'w3' if family == 'mixtral' else 'up_proj'}.weight"
    with pytest.raises(KeyError, match=re.escape(key)):
        stack_experts({k: v for k, v in per_expert.items() if k != key}, p, num_experts)
    with pytest.raises(ValueError, match=re.escape(f"{p}gate.weight routes to {num_experts} experts")):
        stack_experts(per_expert, p, num_experts - 1)
    fused_down = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(KeyError, match=re.escape(fused_down)):
        stack_experts({k: v for k, v in fused.items() if k != fused_down}, p, num_experts)
    with pytest.raises(KeyError, match=re.escape("model.layers.5.mlp.gate.weight")):
        stack_experts(fused, "model.layers.5.mlp.", num_experts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_matches_hf_block(family):
    """Both expert paths on the GPU; on sm80+ the automatic choice is the grouped GEMM."""
    cfg, block = hf_block(family)
    block = block.to("cuda", torch.bfloat16)
    moe = moe_from_block(family, cfg, block, "fused")
    x = torch.randn(300, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    ref = hf_out(block, x)
    outs = {}
    for use in (False, True, None):
        moe.use_grouped_mm = use
        outs[use] = moe(x)
        assert rel_err(outs[use], ref) < BF16_RTOL, use
    if torch.cuda.get_device_capability() >= (8, 0):
        assert moe.use_grouped_mm is None and torch.equal(outs[None], outs[True])
    assert moe(x[:0]).shape == (0, cfg.hidden_size)
