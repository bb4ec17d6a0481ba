"""The model on the S-worker: where it comes from (source, presets, gguf_meta), its config
(config, hf_families), weights and tokenizer, and the S-part (spart; rope, prompt_attention,
layer_weights, moe, ops with Triton kernels, and CUDA graphs on a GPU).
"""
