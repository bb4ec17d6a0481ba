"""The model on the S-worker: where it comes from (source, presets), its config, weights and
tokenizer, and the S-part layers (llama, ops, with Triton kernels and CUDA graphs on a GPU).
"""
