"""vLLM's `allowed_token_ids` and `bad_words`, against HF transformers on the same weights (fp32, fp32
KV): a greedy token is the argmax of HF's float64 logits over the tokens the mask leaves, the bad
words' token sequences computed in the test from HF's own tokenizer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import batch_line, read_output, run_fastdecode

PROMPT = "The three largest cities in the United States are"


def hf_last_logits(model, seq: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0, -1].double().numpy()


def test_bad_word_sequences_and_banned_tokens():
    from fastdecode.engine.token_masks import bad_word_sequences, banned_tokens
    vocab = {"cat": [5], " cat": [7], "hot dog": [1, 2], " hot dog": [3, 1, 2], "x": [9], " x": [9]}
    seqs = bad_word_sequences(lambda text: vocab[text], ["cat", "  hot dog", "x"])
    assert seqs == [(5,), (7,), (1, 2), (3, 1, 2), (9,)]         # leading blanks folded, duplicates once
    assert banned_tokens(seqs, []) == [5, 7, 9]                     # one-token words: always
    assert banned_tokens(seqs, [4, 1]) == [5, 7, 2, 9]              # "hot" just generated: "dog" banned
    assert banned_tokens(seqs, [3, 1]) == [5, 7, 2, 2, 9]           # ... by both spellings
    assert banned_tokens(seqs, [1, 4]) == [5, 7, 9]                 # only where the output ends with it


def test_allowed_tokens_mask_keeps_only_allowed_logits():
    from fastdecode.engine.sampler import AllowedTokens
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((6, 50)).astype(np.float32))
    before = logits.clone()
    allowed = {1: [3, 7], 4: [0, 49, 7]}
    AllowedTokens.of(allowed).apply(logits)
    for row in range(6):
        if row not in allowed:
            assert torch.equal(logits[row], before[row])
            continue
        keep = np.zeros(50, bool)
        keep[allowed[row]] = True
        assert torch.equal(logits[row][keep], before[row][keep])
        assert torch.isneginf(logits[row][~keep]).all()


def test_bans_that_empty_the_allowed_set_are_lifted_for_the_step():
    """bad_words / min_tokens bans that leave a row none of its allowed tokens: allowed_token_ids wins
    for that step (never a sample from all -inf); other rows keep their bans."""
    from fastdecode.engine.sampler import AllowedTokens, SamplingBatch, sample
    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((3, 40)).astype(np.float32))
    cols = np.array([[0, 0, 1, 0], [0, 0, 1, 0], [1.0, 0, 1, 0]])          # rows 0, 1 greedy; row 2 samples
    for suppress, want0 in (({0: [3, 7], 1: [5], 2: [3, 7]}, None), ({0: [7], 1: [5], 2: [3, 7]}, 3)):
        batch = SamplingBatch.from_arrays(cols, np.arange(3), np.zeros(3), np.zeros(3), suppress, "cpu")
        batch.allowed = AllowedTokens.of({0: [3, 7], 2: [3, 7]})
        got = sample(logits, batch)
        ref0 = [3, 7][int(np.argmax(logits[0, [3, 7]].numpy()))]
        assert got[0] == (ref0 if want0 is None else want0)                # all banned: lifted; else the ban holds
        z1 = logits[1].numpy().copy()
        z1[5] = -np.inf
        assert got[1] == int(np.argmax(z1))                                 # a row without allowed ids: ban kept
        assert got[2] in (3, 7)                                             # sampled inside the allowed set


def test_allowed_token_ids_greedy_equals_hf_restricted_argmax(llm, hf_smollm):
    from fastdecode import SamplingParams
    tok, model = hf_smollm
    ids, steps = tok(PROMPT)["input_ids"], 6
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    # the plain answer's later tokens and some others, but not its first: the answer must change
    allowed = sorted(set(plain[1:]) - {plain[0]} | {11, 198, 1000, 2500, 30000})
    got = llm.generate([PROMPT], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                                allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0].token_ids
    want, seq = [], list(ids)
    for _ in range(steps):
        z = hf_last_logits(model, seq)
        t = allowed[int(np.argmax(z[allowed]))]
        want.append(t)
        seq.append(t)
    assert got == want and got != plain


def contains(tokens: list[int], seq: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(seq)]) == seq for i in range(len(tokens) - len(seq) + 1))


def test_bad_words_greedy_equals_hf_reference(llm, hf_smollm):
    """A two-word phrase of the plain answer (its last token banned right after the first word's) and a
    one-token word of it, each alone: both must change the answer exactly as the reference does."""
    from fastdecode import SamplingParams
    tok, model = hf_smollm
    ids, steps = tok(PROMPT)["input_ids"], 12
    params = dict(max_tokens=steps, temperature=0, ignore_eos=True)
    plain = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    words = [w for w in plain.text.split() if w.isalpha()]
    spelled = lambda text: tuple(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    phrases = [f"{a} {b}" for a, b in zip(words, words[1:])
               if len(spelled(f" {a} {b}")) >= 2 and contains(plain.token_ids, spelled(f" {a} {b}"))]
    singles = [w for w in words if len(spelled(" " + w)) == 1]
    assert phrases and singles, (plain.text, plain.token_ids)    # the prompt must yield both kinds
    for bad in (phrases[:1], singles[:1]):
        got = llm.generate([PROMPT], SamplingParams(**params, bad_words=bad), use_tqdm=False)[0].outputs[0].token_ids
        seqs = {spelled(v) for w in bad for v in (w, " " + w)}
        want, seq = [], list(ids)
        for _ in range(steps):
            z = hf_last_logits(model, seq)
            for s in seqs:                              # a word's last token, where the output ends with the rest
                if len(s) == 1 or (len(want) >= len(s) - 1 and tuple(want[len(want) - len(s) + 1:]) == s[:-1]):
                    z[s[-1]] = -np.inf
            t = int(np.argmax(z))
            want.append(t)
            seq.append(t)
        assert got == want and got != plain.token_ids, bad
        assert not any(contains(got, s) for s in seqs), bad


def test_sampled_tokens_stay_inside_the_masks(llm):
    from fastdecode import SamplingParams
    allowed = [11, 198, 260, 1000, 2500, 30000]
    out = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                                allowed_token_ids=allowed, bad_words=[llm.engine.tokenizer.decode(
                                                    [1000])]), use_tqdm=False)[0]
    tokens = [t for o in out.outputs for t in o.token_ids]
    assert len(tokens) == 32 and set(tokens) <= set(allowed) - {1000} and len(set(tokens)) > 1


def test_mask_request_errors(llm):
    from fastdecode import SamplingParams
    from fastdecode.engine.request_checks import RequestError
    eng, vocab = llm.engine, llm.engine.config.vocab_size
    with pytest.raises(RequestError, match=f"allowed_token_ids: token id {vocab} "):
        eng.add_request(0, "a", "hi", [1, 2], SamplingParams(allowed_token_ids=[5, vocab]))
    word = eng.tokenizer.decode([1000])
    with pytest.raises(RequestError, match="bad_words ban every token in allowed_token_ids"):
        eng.add_request(0, "b", "hi", [1, 2], SamplingParams(allowed_token_ids=[1000], bad_words=[word]))
    eos = sorted(eng.eos_ids)
    with pytest.raises(RequestError, match="min_tokens is 2 but every token in allowed_token_ids ends"):
        eng.add_request(0, "c", "hi", [1, 2], SamplingParams(allowed_token_ids=eos, min_tokens=2))
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must be a list of non-blank strings"):
        SamplingParams(bad_words=["ok", " "])


def test_batch_bodies_carry_the_masks():
    from fastdecode.batch.jsonl import parse_line
    line = parse_line(1, batch_line("m", {"messages": [{"role": "user", "content": "hi"}], "bad_words": ["a b"],
                                          "allowed_token_ids": [3, 4]}, "/v1/chat/completions"))
    assert line.error is None and line.params.bad_words == ["a b"] and line.params.allowed_token_ids == [3, 4]


def test_batch_lines_with_masks(tmp_path, hf_smollm):
    """allowed_token_ids and bad_words in OpenAI batch bodies (vLLM's extra parameters), and 400s."""
    tok, _ = hf_smollm
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    allowed = [11, 198, 1000, 2500]
    inp.write_text("\n".join([
        batch_line("allowed", {"prompt": PROMPT, "max_tokens": 5, "logprobs": 1, "allowed_token_ids": allowed,
                               "ignore_eos": True}),
        batch_line("chat", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                            "bad_words": ["Hi", "Hello"], "temperature": 0}, "/v1/chat/completions"),
        batch_line("empty", {"prompt": PROMPT, "allowed_token_ids": []}),
        batch_line("type", {"prompt": PROMPT, "bad_words": "Hi"}),
        batch_line("far", {"prompt": PROMPT, "allowed_token_ids": [10 ** 7]}),
    ]) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["custom_id"]: r for r in read_output(str(out))}
    choice = rows["allowed"]["response"]["body"]["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert len(tokens) == 5 and set(tokens) <= {tok.decode([t]) for t in allowed}, tokens
    assert rows["chat"]["response"]["status_code"] == 200
    for cid, msg in (("empty", "allowed_token_ids must be a non-empty list"), ("type", "body.bad_words must be list"),
                     ("far", "allowed_token_ids: token id 10000000 is not in the model's vocabulary")):
        assert rows[cid]["response"]["status_code"] == 400 and msg in rows[cid]["error"]["message"], rows[cid]
