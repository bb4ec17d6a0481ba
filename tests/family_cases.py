"""Tiny random-weight HF models of every served family for the S-part tests: 3 layers, real
head layouts (GQA 1-4, head_dim 64/128/256), sliding windows shorter than the prompts, Gemma 2's
soft-caps on (small enough to bite), Phi-3's partial rotary and longrope; norms and biases
randomized (HF initializes them to constants, which would hide a misplaced one)."""
from __future__ import annotations

import torch

VOCAB = 512
LENGTHS = [41, 57, 80]             # prompts of one packed batch
ROPE_16 = {"short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [2.0 + 0.3 * i for i in range(16)]}

# name -> (HF config class, its arguments, prompt lengths, max_model_len for the S-part)
CASES = {
    "qwen3": ("Qwen3Config", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                  use_sliding_window=True, sliding_window=24, max_window_layers=1), LENGTHS, None),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1,
                                         head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True, mlp_only_layers=[1]), LENGTHS, None),
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96, decoder_sparse_step=2,
                                         use_sliding_window=True, sliding_window=20, max_window_layers=2),
                  LENGTHS, None),
    "mixtral": ("MixtralConfig", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=32), LENGTHS, None),
    "gemma2": ("Gemma2Config", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                    sliding_window=16, query_pre_attn_scalar=64, attn_logit_softcapping=5.0,
                                    final_logit_softcapping=8.0), LENGTHS, None),
    "gemma3_text": ("Gemma3TextConfig", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
        LENGTHS, None),
    # longrope: HF picks the long factors for sequences past original_max_position_embeddings (64);
    # the S-part picks by the job's context: 256 -> long (prompts > 64), 64 -> short (prompts <= 64)
    "phi3-long": ("Phi3Config", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                     partial_rotary_factor=0.5, sliding_window=48, original_max_position_embeddings=64,
                                     rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5, **ROPE_16}), [65, 72, 80], None),
    "phi3-short": ("Phi3Config", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      partial_rotary_factor=0.5, original_max_position_embeddings=64,
                                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5, **ROPE_16}), [41, 64], 64),
    "mistral": ("MistralConfig", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                      sliding_window=24), LENGTHS, None),
    "qwen2": ("Qwen2Config", dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                                  use_sliding_window=True, sliding_window=24, max_window_layers=1), LENGTHS, None),
}


def build_hf(name: str, root, **override):
    """Save the case's HF model under root/name -> (path, HF model in float32, eager attention)."""
    import transformers
    cls, kwargs, _, _ = CASES[name]
    base = dict(vocab_size=VOCAB, num_hidden_layers=3, intermediate_size=256, max_position_embeddings=256,
                initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = getattr(transformers, cls)(**{**base, **kwargs, **override})
    cfg._experts_implementation = "eager"          # HF's reference loop over experts
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    path = root / name
    model.save_pretrained(path)
    return str(path), model


def save_tokenizer(path: str) -> None:
    """A word-level tokenizer over the tiny vocabulary (the engine loads one; prompts are ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", pad_token="t0").save_pretrained(path)


def load_spart(path: str, max_model_len: int | None = None, dtype=torch.float32):
    from fastdecode.model.source import read_config, resolve_model
    from fastdecode.model.spart import SPart
    from fastdecode.model.weights import load_weights
    source = resolve_model(path)
    config = read_config(source)
    return SPart(config, load_weights(source, config, dtype), "cpu", dtype, max_model_len=max_model_len)


def prompts(lengths: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lengths]


@torch.no_grad()
def prompt_logits(m, chunks: list[torch.Tensor], starts: list[int] | None = None,
                  kept: list | None = None) -> tuple[torch.Tensor, list]:
    """The S-part's prompt path over a packed batch (embed, per layer qkv -> prompt_attention ->
    post_attn, logits): chunks[i] covers positions starts[i].. of its prompt; kept[i] (or None):
    per layer the (K, V) of its earlier positions. -> (logits [T, V], per chunk per layer its
    (K, V) so far)."""
    starts = starts or [0] * len(chunks)
    kept = kept or [None] * len(chunks)
    lengths = [len(c) for c in chunks]
    bounds = [sum(lengths[:i]) for i in range(len(chunks) + 1)]
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    x, rope = m.embed_tokens(torch.cat(chunks)), m.rope.cos_sin(pos)
    seen = [[] for _ in chunks]
    for layer in range(m.config.num_layers):
        q, k, v = m.qkv(layer, x, rope)
        context = []
        for i in range(len(chunks)):
            own = (k[bounds[i]:bounds[i + 1]], v[bounds[i]:bounds[i + 1]])
            kv = own if kept[i] is None else tuple(torch.cat([e, o]) for e, o in zip(kept[i][layer], own))
            seen[i].append(kv)
            context.append(None if kept[i] is None else kv)
        x = m.post_attn(layer, x, m.prompt_attention(layer, q, k, v, lengths,
                                                     None if all(c is None for c in context) else context))
    return m.logits(x), seen
