"""The model's HF tokenizer, with its defaults: special tokens as `tokenizer(prompt)` adds them,
chat through the model's chat template with the generation prompt, decode skipping special tokens
(unless a request says otherwise).

A GGUF tokenizer is converted by transformers once (slow) and cached with `save_pretrained`.
"""
from __future__ import annotations

import json
import os

from fastdecode.model.source import ModelSource, cache_dir
from fastdecode.model.template_budget import max_template_chars, template_budget, too_long


class TokenIdsOnly:
    """The tokenizer of a random benchmark model: prompts must be token ids; text is empty."""

    hf = None
    generation_eos = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def eos_token_ids(self, config_eos: tuple[int, ...]) -> frozenset[int]:
        return frozenset(config_eos)

    def encode(self, prompt, *args, **kwargs) -> list[int]:
        raise ValueError("this model has no tokenizer (a random benchmark model): give prompts as token ids")

    encode_chat = encode_text = encode

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        return ""

    def token_text(self, token: int) -> str:
        return ""


class Tokenizer:
    max_chat_chars = max_template_chars(0)      # what a chat template may write (set per model in __init__)

    def __init__(self, source: ModelSource, digest: str | None = None, tokenizer: ModelSource | None = None,
                 max_model_len: int = 0):
        """The tokenizer of `source`, or of `tokenizer` where given (vLLM's `tokenizer`: another
        model's); `digest` names a GGUF model's converted tokenizer in the cache; `max_model_len`
        bounds what a chat template may write (template_budget.max_template_chars)."""
        from transformers import AutoTokenizer

        self.max_chat_chars = max_template_chars(max_model_len)

        own = tokenizer or source
        if own.kind == "hf":
            self.hf = AutoTokenizer.from_pretrained(own.path)
        elif own.kind == "gguf":
            saved = os.path.join(cache_dir(), "tokenizer", (digest if tokenizer is None else None) or own.stat_key)
            if os.path.isfile(os.path.join(saved, "tokenizer.json")):
                self.hf = AutoTokenizer.from_pretrained(saved)
            else:
                self.hf = AutoTokenizer.from_pretrained(os.path.dirname(own.path),
                                                        gguf_file=os.path.basename(own.path))
                tmp = f"{saved}.{os.getpid()}.tmp"
                self.hf.save_pretrained(tmp)
                os.makedirs(os.path.dirname(saved), exist_ok=True)
                try:
                    os.replace(tmp, saved)
                except OSError:   # another job saved it first
                    pass
        else:
            raise ValueError(f"tokenizer {own.name!r}: a random model has no tokenizer")
        self.generation_eos = _generation_config_eos(source.path) if source.kind == "hf" else ()
        self.vocab_size = len(self.hf)

    def eos_token_ids(self, config_eos: tuple[int, ...]) -> frozenset[int]:
        """EOS ids that end generation: the config's, generation_config.json's and the tokenizer's."""
        ids = set(config_eos) | set(self.generation_eos)
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        return frozenset(ids)

    def encode(self, prompt: str, truncate: int | None = None) -> list[int]:
        """A prompt's token ids with the special tokens the tokenizer adds; `truncate` k: at most k
        tokens, the text cut from the left (vLLM's truncate_prompt_tokens; the special tokens stay)."""
        if truncate is None:
            return self.hf(prompt)["input_ids"]
        side, self.hf.truncation_side = self.hf.truncation_side, "left"
        try:
            return self.hf(prompt, truncation=True, max_length=truncate)["input_ids"]
        finally:
            self.hf.truncation_side = side

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a piece of text, without the special tokens a prompt gets."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def encode_chat(self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        """A conversation through the chat template (the model's, or `chat_template`), within its time
        and size budget (template_budget.py), its text tokenized without added special tokens (the
        template writes them), as HF's apply_chat_template(tokenize=True) does."""
        with template_budget(max_chars=self.max_chat_chars):
            text = self.hf.apply_chat_template(messages, chat_template=chat_template, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **(template_kwargs or {}))
        if len(text) > self.max_chat_chars:          # written in one piece, or outside a generator frame
            raise too_long(len(text), self.max_chat_chars)
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """The text of `ids`, as vLLM detokenizes: a fast tokenizer (or one without added tokens)
        decodes them whole; a slow one decodes the runs between its added tokens and joins them and
        the added tokens with spaces (spaces_between_special_tokens) or without."""
        hf = self.hf
        if hf.is_fast or not hf.get_added_vocab():
            return hf.decode(ids, skip_special_tokens=skip_special_tokens)
        added, special = hf.get_added_vocab(), set(hf.all_special_tokens)
        pieces, run = [], []
        for token in hf.convert_ids_to_tokens(ids):
            if skip_special_tokens and token in special:
                continue
            if token in added:
                if run:
                    pieces.append(hf.convert_tokens_to_string(run))
                    run = []
                pieces.append(token)
            else:
                run.append(token)
        if run:
            pieces.append(hf.convert_tokens_to_string(run))
        return (" " if spaces_between_special_tokens else "").join(pieces)

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
