"""Prompt log-probabilities (vLLM's `prompt_logprobs`, OpenAI completions' `echo`) and `logit_bias`,
against HF transformers on the same weights (fp32, fp32 KV): each prompt token's log-probability is
HF's float64 log_softmax at the position before it; a biased greedy token is the argmax of HF's
logits plus the bias (then vLLM's repetition penalty, applied after the bias)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import batch_line, read_output, run_fastdecode

PROMPTS = ["The capital of France is Paris, and the capital of Italy is", "def fibonacci(n):\n    if n <",
           "Hi"]


def hf_log_softmax(model, ids: list[int]) -> np.ndarray:
    """float64 log_softmax of HF's logits at every position of `ids`: [len(ids), V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def check_position(pos: dict, token: int, want: np.ndarray, k: int, where) -> None:
    """One {id: Logprob} dict against HF's log-probabilities `want` [V] at that position."""
    assert pos[token].logprob == pytest.approx(want[token], abs=2e-4), where
    lo, hi = 1 + int((want > want[token] + 1e-4).sum()), int((want > want[token] - 1e-4).sum())
    assert lo <= pos[token].rank <= hi, where                       # up to fp32 near-ties
    top = sorted((lp for lp in pos.values() if lp.rank <= k), key=lambda lp: lp.rank)
    assert len(top) == k and len(pos) == k + (pos[token].rank > k), where
    order = np.argsort(-want)
    for r, lp in enumerate(top):
        assert lp.logprob == pytest.approx(want[order[r]], abs=2e-4), (where, r)


@pytest.mark.parametrize("block_rows", [None, 3])    # 3: the LM head runs over the prompt in blocks of 3 rows
def test_prompt_logprobs_equal_hf_log_softmax(llm, hf_smollm, monkeypatch, block_rows):
    from fastdecode import SamplingParams
    from fastdecode.engine import runner
    if block_rows is not None:
        monkeypatch.setattr(runner, "PROMPT_LOGPROB_BLOCK", block_rows * llm.engine.config.vocab_size)
    tok, model = hf_smollm
    k = 4
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=k), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt)["input_ids"]
        assert out.prompt_token_ids == ids
        plp = out.prompt_logprobs
        assert len(plp) == len(ids) and plp[0] is None
        want = hf_log_softmax(model, ids)
        for i in range(1, len(ids)):       # token i given tokens 0..i-1: HF's row i-1
            check_position(plp[i], ids[i], want[i - 1], k, (prompt, i))
            assert plp[i][ids[i]].decoded_token == tok.decode([ids[i]])
        assert out.outputs[0].logprobs is None        # prompt logprobs do not turn on output logprobs


def test_prompt_logprobs_once_per_request_and_not_unless_asked(llm):
    from fastdecode import SamplingParams
    out = llm.generate(PROMPTS[:1], SamplingParams(n=3, max_tokens=2, temperature=0.8, seed=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(len(pos) == 1 for pos in out.prompt_logprobs[1:])          # k = 0: the prompt token only
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


def biased_greedy_reference(model, ids: list[int], steps: int, bias: dict[int, float], repetition: float):
    """Greedy tokens where each step's logits get `bias` added, then the repetition penalty over the
    prompt and output so far (vLLM's order), from HF's float64 logits of the growing sequence."""
    seq = list(ids)
    for _ in range(steps):
        with torch.no_grad():
            z = model(torch.tensor([seq])).logits[0, -1].double().numpy().copy()
        for t, b in bias.items():
            z[t] += b
        seen = np.unique(seq)
        z[seen] = np.where(z[seen] > 0, z[seen] / repetition, z[seen] * repetition)
        seq.append(int(np.argmax(z)))
    return seq[len(ids):]


@pytest.mark.parametrize("repetition", [1.0, 1.4])
def test_logit_bias_greedy_equals_reference(llm, hf_smollm, repetition):
    from fastdecode import SamplingParams
    tok, model = hf_smollm
    steps, changed = 8, 0
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        plain = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                                      repetition_penalty=repetition), use_tqdm=False)[0]
        first = plain.outputs[0].token_ids
        # biases on tokens the model was about to use, on prompt tokens (where the repetition penalty's
        # sign rule meets the bias) and one far-off token pushed up
        bias = {first[0]: -3.0, first[1]: 2.5, ids[-1]: 4.0, ids[1]: 3.0, 1000: 12.0}
        got = llm.generate([prompt], SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                                    repetition_penalty=repetition, logit_bias=bias),
                           use_tqdm=False)[0].outputs[0].token_ids
        assert got == biased_greedy_reference(model, ids, steps, bias, repetition), prompt
        changed += got != first
    assert changed == 2                         # the biases did change both answers


def test_logit_bias_out_of_vocabulary_is_a_request_error(llm):
    from fastdecode import SamplingParams
    from fastdecode.engine.request_checks import RequestError
    vocab = llm.engine.config.vocab_size
    with pytest.raises(RequestError, match=f"logit_bias token id {vocab} "):
        llm.engine.add_request(0, "r", "hi", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))


def test_batch_echo_prompt_logprobs_and_bias_in_openai_shapes(tmp_path, hf_smollm):
    """Scoring (echo, logprobs 1, max_tokens 0), echo with a completion, the
    vLLM `prompt_logprobs` field on chat, and logit_bias, through `fastdecode generate`."""
    tok, model = hf_smollm
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    text, chat_msgs = "The sky is blue and the grass is", [{"role": "user", "content": "Name a colour."}]
    ids = tok(text)["input_ids"]
    inp.write_text("\n".join([
        batch_line("score", {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}),
        batch_line("echo", {"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}),
        batch_line("echo-ids", {"prompt": ids, "max_tokens": 2, "echo": True, "temperature": 0}),
        batch_line("chat", {"messages": chat_msgs, "max_tokens": 2, "prompt_logprobs": 1},
                   "/v1/chat/completions"),
        batch_line("bias", {"prompt": text, "max_tokens": 4, "temperature": 0, "logit_bias": {"1000": 100}}),
        batch_line("bias-far", {"prompt": text, "logit_bias": {str(10 ** 7): 1}}),
    ]) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--dtype", "float32",
                           "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["custom_id"]: r for r in read_output(str(out))}
    want = hf_log_softmax(model, ids)

    score = rows["score"]["response"]["body"]
    choice, lp = score["choices"][0], score["choices"][0]["logprobs"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert score["usage"]["completion_tokens"] == 0 and score["usage"]["prompt_tokens"] == len(ids)
    assert lp["tokens"] == [tok.decode([t]) for t in ids] and "".join(lp["tokens"]) == text
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx([want[i - 1, ids[i]] for i in range(1, len(ids))], abs=2e-4)
    assert lp["text_offset"] == [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1][str(ids[1])]["logprob"] == pytest.approx(want[0, ids[1]], abs=2e-4)

    echo = rows["echo"]["response"]["body"]["choices"][0]
    assert echo["text"].startswith(text) and len(echo["text"]) > len(text)
    elp = echo["logprobs"]
    assert len(elp["tokens"]) == len(ids) + 3 and "".join(elp["tokens"]) == echo["text"]
    assert elp["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)
    gen = [int(t) for t in ids]
    gen += tok(echo["text"][len(text):], add_special_tokens=False)["input_ids"]
    if len(gen) == len(ids) + 3:        # the completion re-tokenizes to the same ids (not guaranteed)
        full = hf_log_softmax(model, gen)
        assert elp["token_logprobs"][len(ids):] == pytest.approx(
            [full[i - 1, gen[i]] for i in range(len(ids), len(gen))], abs=2e-4)

    echo_ids = rows["echo-ids"]["response"]["body"]["choices"][0]
    assert echo_ids["text"].startswith(text) and echo_ids["logprobs"] is None and "prompt_logprobs" not in echo_ids

    chat = rows["chat"]["response"]["body"]
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_logprobs"]) and chat["prompt_logprobs"][0] is None
    assert all(1 <= len(pos) <= 2 for pos in chat["prompt_logprobs"][1:])

    bias = rows["bias"]["response"]["body"]["choices"][0]
    assert bias["text"] == tok.decode([1000] * 4)           # +100 makes token 1000 win every step
    far = rows["bias-far"]
    assert far["response"]["status_code"] == 400 and "logit_bias token id" in far["error"]["message"]
    json.dumps(rows, allow_nan=False)
