"""Batch lines for fuzzing `generate`: good requests, and hostile ones that must each get a 400
(wrong types, out-of-range or non-finite numbers, ids outside the vocabulary, limits passed,
broken JSON, invalid UTF-8, raw CR, deep nesting, huge integers). hypothesis strategies; each
example is (line bytes, custom_id the row must carry or None, served: 200 expected or 400).
Used by tests/test_hostile_input.py and bench/e2e/fuzz_bench.py."""
from __future__ import annotations

import json

from hypothesis import strategies as st

VOCAB = 49152                                  # smollm2-135m
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
WORDS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=12)


def _line(cid: str, body: dict, url: str = COMPLETIONS) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}).encode()


@st.composite
def good_body(draw) -> tuple[dict, str]:
    """A request that must be served (short: max_tokens <= 3)."""
    chat = draw(st.booleans())
    body: dict = {"max_tokens": draw(st.integers(1, 3))}
    if chat:
        body["messages"] = [{"role": draw(st.sampled_from(["user", "system"])), "content": draw(WORDS)}]
        if body["messages"][0]["role"] == "system":
            body["messages"].append({"role": "user", "content": draw(WORDS)})
    else:
        ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
        body["prompt"] = draw(st.one_of(WORDS, ids, st.lists(WORDS, min_size=1, max_size=2),   # batched prompts
                                        st.lists(ids, min_size=1, max_size=2)))
    optional = {
        "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 100),
        "seed": st.integers(-2**63, 2**63 - 1), "n": st.integers(1, 2), "stop": st.lists(WORDS, max_size=3),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4), "presence_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2), "logit_bias": st.dictionaries(
            st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
        "ignore_eos": st.booleans(),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)):
        body[name] = draw(optional[name])
    return body, CHAT if chat else COMPLETIONS


# hostile values by field: each makes the line a 400 whatever else it holds
BAD_FIELDS = {
    "temperature": st.sampled_from(["0.5", True, -1, [1]]),
    "top_p": st.sampled_from([0, 1.5, "1", 2]),
    "top_k": st.sampled_from([2**63, -5, 1.5, "5"]),
    "n": st.sampled_from([0, 10**8, 2**63, "2", 1.0]),
    "max_tokens": st.sampled_from([-1, "16", 10**30, 2.5]),
    "stop_token_ids": st.sampled_from([["5"], [5.7], [VOCAB + 7], [-1], [True], "5"]),
    "logprobs": st.sampled_from([-1, 10**6, 2.5, "3"]),
    "prompt_logprobs": st.sampled_from([-2, 21, "1", 1.5]),
    "bad_words": st.sampled_from(["Hi", [1], [""], ["x"] * 5000]),
    "logit_bias": st.sampled_from([[5], {"x": 1}, {"5": 1000}, {str(VOCAB): 1}]),
    "allowed_token_ids": st.sampled_from([[], [VOCAB], ["1"], [-3]]),
    "seed": st.sampled_from(["7", 7.5, [7]]),
    "presence_penalty": st.sampled_from([3, "0", -9.5]),
    "min_tokens": st.sampled_from([-1, 100]),
    "best_of": st.just(3),
    "tools": st.just([{"type": "function"}]),
    # (a list mixing strings and token ids, ["x", [1]], is served: not here)
    "prompt": st.sampled_from([[], [[]], ["x", []], [""], [[1], [VOCAB]], [[-1]], [["x"]]]),
    "model": st.sampled_from([5, ["smollm2-135m"], {"name": "x"}]),
}
RAW_BAD_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"9" * 5000]


@st.composite
def bad_line(draw, cid: str) -> tuple[bytes, str | None]:
    """A line that must get a 400; (bytes, the custom_id its row names or None)."""
    kind = draw(st.sampled_from(["field", "raw_number", "json", "utf8", "cr", "nest", "role", "envelope"]))
    body = {"prompt": "Hello", "max_tokens": 2}
    if kind == "field":
        name = draw(st.sampled_from(sorted(BAD_FIELDS)))
        body[name] = draw(BAD_FIELDS[name])
        if name == "min_tokens" and body[name] == 100:     # above max_tokens
            body["max_tokens"] = 2
        return _line(cid, body), cid
    if kind == "raw_number":                               # not JSON numbers at all, or too big to read
        field = draw(st.sampled_from(["temperature", "n", "seed", "top_p"]))
        raw = draw(st.sampled_from(RAW_BAD_NUMBERS))
        return _line(cid, body).replace(b'"max_tokens": 2', b'"max_tokens": 2, "' + field.encode() + b'": ' + raw), cid
    if kind == "json":
        cut = draw(st.integers(1, 40))           # the custom_id near the start survives: the row names it
        return _line(cid, body)[:-cut], cid
    if kind == "utf8":
        return _line(cid, body).replace(b"Hello", b"He\xff\xfello"), cid
    if kind == "cr":                                       # a raw CR inside a string: invalid JSON, one row
        return _line(cid, body).replace(b"Hello", b"He\rllo"), cid
    if kind == "nest":
        depth = draw(st.sampled_from([300, 5000]))
        return _line(cid, body).replace(b'"max_tokens": 2', b'"max_tokens": 2, "x": ' + b"[" * depth + b"]" * depth), cid
    if kind == "role":
        msgs = [{"role": draw(st.sampled_from(["robot", "tool", "", "USER"])), "content": "hi"}]
        return _line(cid, {"messages": msgs, "max_tokens": 2}, CHAT), cid
    envelope = draw(st.sampled_from([{"custom_id": 5}, {"url": "/v1/embeddings"}, {"method": "GET"},
                                     {"body": "x"}]))
    obj = {"custom_id": cid, "method": "POST", "url": COMPLETIONS, "body": body, **envelope}
    return json.dumps(obj).encode(), cid if isinstance(obj["custom_id"], str) else None


@st.composite
def batch(draw, size: int = 30, prefix: str = "") -> list[tuple[bytes, str | None, bool]]:
    """`size` lines, good and hostile mixed; custom_ids unique."""
    lines = []
    for i in range(size):
        cid = f"{prefix}{i}"
        if draw(st.booleans()):
            body, url = draw(good_body())
            lines.append((_line(cid, body, url), cid, True))
        else:
            data, named = draw(bad_line(cid))
            lines.append((data, named, False))
    return lines
