"""The model's HF tokenizer, with its defaults: special tokens as `tokenizer(prompt)` adds them,
chat through the model's chat template with the generation prompt, decode skipping special tokens
(unless a request says otherwise).

A GGUF tokenizer is converted by transformers once (slow) and cached with `save_pretrained`.
"""
from __future__ import annotations

import json
import os

from fastdecode.model.source import ModelSource, cache_dir
from fastdecode.model.template_budget import template_budget


class TokenIdsOnly:
    """The tokenizer of a random benchmark model: prompts must be token ids; text is empty."""

    hf = None
    generation_eos = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def eos_token_ids(self, config_eos: tuple[int, ...]) -> frozenset[int]:
        return frozenset(config_eos)

    def encode(self, prompt: str) -> list[int]:
        raise ValueError("this model has no tokenizer (a random benchmark model): give prompts as token ids")

    encode_chat = encode_text = encode

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def token_text(self, token: int) -> str:
        return ""


class Tokenizer:
    def __init__(self, source: ModelSource, digest: str | None = None):
        from transformers import AutoTokenizer

        if source.kind == "hf":
            self.hf = AutoTokenizer.from_pretrained(source.path)
            self.generation_eos = _generation_config_eos(source.path)
        else:
            saved = os.path.join(cache_dir(), "tokenizer", digest or source.stat_key)
            if os.path.isfile(os.path.join(saved, "tokenizer.json")):
                self.hf = AutoTokenizer.from_pretrained(saved)
            else:
                self.hf = AutoTokenizer.from_pretrained(os.path.dirname(source.path),
                                                        gguf_file=os.path.basename(source.path))
                tmp = f"{saved}.{os.getpid()}.tmp"
                self.hf.save_pretrained(tmp)
                os.makedirs(os.path.dirname(saved), exist_ok=True)
                try:
                    os.replace(tmp, saved)
                except OSError:   # another job saved it first
                    pass
            self.generation_eos = ()
        self.vocab_size = len(self.hf)

    def eos_token_ids(self, config_eos: tuple[int, ...]) -> frozenset[int]:
        """EOS ids that end generation: the config's, generation_config.json's and the tokenizer's."""
        ids = set(config_eos) | set(self.generation_eos)
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        return frozenset(ids)

    def encode(self, prompt: str) -> list[int]:
        return self.hf(prompt)["input_ids"]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a piece of text, without the special tokens a prompt gets."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The messages through the model's chat template (within its time budget: template_budget.py)."""
        with template_budget():
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's text for log-probability listings: special tokens spelled out."""
        return self.hf.decode([token], skip_special_tokens=False)


def _generation_config_eos(model_dir: str) -> tuple[int, ...]:
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return ()
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)
