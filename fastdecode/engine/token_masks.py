"""vLLM's allowed_token_ids and bad_words: the tokens a sequence may not generate at a step.

A bad word is banned as token sequences: the word as it appears at the start of a text and, for
tokenizers that fold a leading space into the token (BPE, SentencePiece), as it appears after a
space. A sequence's last token is banned wherever the output so far ends with the tokens before
it; a one-token word is banned everywhere. Like vLLM, only generated tokens are matched, not the
prompt.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_word_sequences(encode: Callable[[str], list[int]], words: Sequence[str]) -> list[tuple[int, ...]]:
    """The distinct token sequences of `words`, in first-seen order (linear in their number);
    encode: text -> ids without special tokens."""
    seqs: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                seqs.setdefault(ids)
    return list(seqs)


def banned_tokens(sequences: list[tuple[int, ...]], output_ids: list[int]) -> list[int]:
    """The last token of every bad-word sequence whose other tokens end output_ids."""
    banned = []
    for ids in sequences:
        n = len(ids) - 1
        if n == 0 or (len(output_ids) >= n and tuple(output_ids[-n:]) == ids[:-1]):
            banned.append(ids[-1])
    return banned
