"""Log-probabilities and presence / frequency / repetition penalties against HF transformers on the
same weights (fp32, fp32 KV): logprobs are HF's log_softmax at each position; the repetition
penalty is HF's own RepetitionPenaltyLogitsProcessor; frequency and presence follow OpenAI's
formula applied to HF's logits here. Plus the batch-file side: request fields, 400s for what is
not implemented, and the OpenAI output shapes."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import batch_line, hf_greedy, read_output, run_fastdecode

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there was a",
           "List of fruits: apple, banana, apple, banana,"]


def hf_logprobs(model, prompt_ids: list[int], out_ids: list[int]) -> np.ndarray:
    """float64 log_softmax of HF's logits for each output position: [len(out_ids), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out_ids])).logits[0].double()
    return torch.log_softmax(logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(out_ids)], -1).numpy()


@pytest.mark.parametrize("temperature", [0.0, 0.7])    # 0.7: raw logprobs, not the tempered ones
def test_logprobs_equal_hf_log_softmax(llm, hf_smollm, temperature):
    from fastdecode import SamplingParams
    tok, model = hf_smollm
    k = 5
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=temperature, seed=7, logprobs=k,
                                                ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        c = out.outputs[0]
        ref = hf_logprobs(model, tok(prompt)["input_ids"], c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == 12
        total = 0.0
        for t, (tok_id, pos) in enumerate(zip(c.token_ids, c.logprobs)):
            want = ref[t]
            # the sampled token: its raw log-probability (not the temperature's) and its rank
            assert pos[tok_id].logprob == pytest.approx(want[tok_id], abs=2e-4), (prompt, t)
            lo, hi = 1 + int((want > want[tok_id] + 1e-4).sum()), int((want > want[tok_id] - 1e-4).sum())
            assert lo <= pos[tok_id].rank <= hi, (prompt, t)          # up to fp32 near-ties
            if temperature == 0:
                assert pos[tok_id].rank == 1
            # the top k: HF's k largest, in order, up to near-ties
            order = np.argsort(-want)
            top = sorted((lp for lp in pos.values() if lp.rank <= k), key=lambda lp: lp.rank)
            assert len(top) == k
            for r, lp in enumerate(top):
                assert lp.logprob == pytest.approx(want[order[r]], abs=2e-4), (prompt, t, r)
            assert len(pos) in (k, k + 1) and (len(pos) == k) == (pos[tok_id].rank <= k)
            assert pos[tok_id].decoded_token == tok.decode([tok_id])
            total += pos[tok_id].logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-6)


def test_no_logprobs_unless_asked(llm):
    from fastdecode import SamplingParams
    c = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None


def test_repetition_penalty_equals_hf_generate(llm, hf_smollm):
    from fastdecode import SamplingParams
    tok, model = hf_smollm
    eos = [tok.eos_token_id]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.3),
                        use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    changed = 0
    for prompt, out, base in zip(PROMPTS, outs, plain):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=24, do_sample=False, repetition_penalty=1.3, eos_token_id=eos,
                                 pad_token_id=eos[0])[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
        changed += out.outputs[0].token_ids != base.outputs[0].token_ids
    assert changed >= 2          # the penalty does something on these prompts (a no-op would pass the above)


def test_frequency_and_presence_penalties_follow_openai_formula(llm, hf_smollm):
    """Greedy with penalties: each chosen token is the argmax of HF's logits less
    frequency * count + presence * (count > 0) over the tokens generated before it."""
    from fastdecode import SamplingParams
    tok, model = hf_smollm
    freq, pres = 0.7, 0.5
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, frequency_penalty=freq,
                                                presence_penalty=pres, ignore_eos=True), use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    changed = 0
    for prompt, out, base in zip(PROMPTS, outs, plain):
        ids, got = tok(prompt)["input_ids"], out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1:].double().numpy()
        counts = np.zeros(logits.shape[1])
        for t, chosen in enumerate(got):
            penalized = logits[t] - freq * counts - pres * (counts > 0)
            assert penalized[chosen] >= penalized.max() - 1e-4, (prompt, t)     # argmax up to fp32 ties
            counts[chosen] += 1
        changed += got != base.outputs[0].token_ids
    assert changed >= 2


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_apply_equals_numpy_reference(seed):
    """Penalties.apply on random logits and histories (some rows unpenalized, some with empty
    histories, repeated tokens, signs of both kinds) against the formula in float64."""
    from fastdecode.engine import sampler
    rng = np.random.default_rng(seed)
    n, vocab = 11, 50
    logits = rng.normal(0, 3, (n, vocab)).astype(np.float32)
    rows = np.array([0, 2, 3, 5, 6, 7, 10])
    pres, freq = rng.uniform(-2, 2, len(rows)), rng.uniform(-2, 2, len(rows))
    rep = np.where(rng.random(len(rows)) < 0.5, 1.0, rng.uniform(0.5, 2.0, len(rows)))
    outs = [rng.integers(0, 12, rng.integers(0, 9)) for _ in rows]          # small ids: repeats
    prompts = [rng.integers(0, vocab, rng.integers(1, 6)) if r != 1 else np.zeros(0, np.int64) for r in rep]
    idx = np.arange(len(rows))
    pen = sampler.Penalties(rows, pres, freq, rep, np.repeat(idx, [len(o) for o in outs]), np.concatenate(outs),
                            np.repeat(idx, [len(p) for p in prompts]), np.concatenate(prompts))
    got = torch.from_numpy(logits.copy())
    pen.apply(got)
    want = logits.astype(np.float64)
    for j, r in enumerate(rows):
        counts = np.bincount(outs[j], minlength=vocab)
        seen = (counts > 0) | np.isin(np.arange(vocab), prompts[j])
        x = want[r]
        if rep[j] != 1:
            x = np.where(seen, np.where(x > 0, x / rep[j], x * rep[j]), x)
        want[r] = x - freq[j] * counts - pres[j] * (counts > 0)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-5)
    untouched = np.setdiff1d(np.arange(n), rows)
    assert np.array_equal(got.numpy()[untouched], logits[untouched])


def test_include_stop_str_and_skip_special_tokens(llm):
    from fastdecode import SamplingParams
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].outputs[0]
    words = plain.text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut, kept = (llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, temperature=0, stop=[stop],
                                                          include_stop_str_in_output=inc), use_tqdm=False)[0].outputs[0]
                 for inc in (False, True))
    assert cut.stop_reason == kept.stop_reason == stop
    assert stop not in cut.text and kept.text == cut.text + stop

    # a chat answer that ends at EOS: the EOS token's text shows only with skip_special_tokens=False
    msgs = [{"role": "user", "content": "Say hello."}]
    shown, hidden = (llm.chat(msgs, SamplingParams(max_tokens=64, temperature=0, skip_special_tokens=skip),
                              use_tqdm=False)[0].outputs[0] for skip in (False, True))
    assert shown.finish_reason == "stop" and shown.stop_reason is None          # ended by EOS
    eos_text = llm.get_tokenizer().decode([shown.token_ids[-1]])
    assert eos_text and shown.text == hidden.text + eos_text


def test_sampling_params_validate_new_fields():
    from fastdecode import SamplingParams
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                {"logprobs": -1}, {"logprobs": True}, {"repetition_penalty": float("inf")}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)
    assert not SamplingParams().penalized and SamplingParams(presence_penalty=0.1).penalized
    assert SamplingParams(logprobs=21).logprobs == 21     # the engine's --max-logprobs bounds it (test_hostile_input)


# ---------------------------------------------------------------------------- batch files

def test_request_fields_map_to_sampling_params():
    from fastdecode.batch.jsonl import parse_line
    chat = parse_line(1, batch_line("c", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                          "top_logprobs": 3, "frequency_penalty": 0.5}, "/v1/chat/completions"))
    assert chat.error is None and chat.params.logprobs == 3 and chat.params.frequency_penalty == 0.5
    only = parse_line(2, batch_line("c2", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
                                    "/v1/chat/completions"))
    assert only.params.logprobs == 0
    comp = parse_line(3, batch_line("p", {"prompt": "hi", "logprobs": 2, "repetition_penalty": 1.1}))
    assert comp.error is None and comp.params.logprobs == 2 and comp.params.repetition_penalty == 1.1
    off = parse_line(4, batch_line("p2", {"prompt": "hi", "echo": False, "logit_bias": {}, "best_of": 1,
                                          "include_stop_str_in_output": True, "skip_special_tokens": False}))
    assert off.error is None and off.params.logprobs is None
    assert off.params.include_stop_str_in_output and not off.params.skip_special_tokens


@pytest.mark.parametrize("body,url,needle", [
    ({"messages": [{"role": "user", "content": "hi"}], "echo": True}, "/v1/chat/completions", "echo"),
    ({"prompt": "hi", "logit_bias": {"x": 10}}, "/v1/completions", "logit_bias keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "/v1/completions", "[-100, 100]"),
    ({"prompt": "hi", "logit_bias": [5]}, "/v1/completions", "logit_bias must be dict"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "/v1/completions", "prompt_logprobs must be at most 20"),
    ({"prompt": "hi", "max_tokens": 0}, "/v1/completions", "max_tokens"),
    ({"prompt": "hi", "best_of": 3}, "/v1/completions", "best_of"),
    ({"prompt": "hi", "logprobs": True}, "/v1/completions", "logprobs must be an integer"),
    ({"prompt": "hi", "logprobs": 30}, "/v1/completions", "logprobs must be at most 20"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "/v1/chat/completions",
     "needs body.logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 2}, "/v1/chat/completions", "boolean"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 25},
     "/v1/chat/completions", "top_logprobs must be at most 20"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
     "/v1/chat/completions", "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     "/v1/chat/completions", "tools"),
    ({"prompt": "hi", "presence_penalty": 3}, "/v1/completions", "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, "/v1/chat/completions",
     "add_generation_prompt"),
    ({"prompt": "hi", "skip_special_tokens": "no"}, "/v1/completions", "skip_special_tokens must be bool"),
])
def test_unsupported_or_bad_fields_get_a_400_naming_them(body, url, needle):
    from fastdecode.batch.jsonl import parse_line
    line = parse_line(1, batch_line("x", body, url))
    assert line.error is not None and needle in str(line.error)


def test_batch_output_logprobs_in_openai_shapes(tmp_path, hf_smollm):
    """One completion (logprobs=2) and one chat (top_logprobs=3) through `fastdecode generate`; the
    values are HF's log_softmax at the positions of the tokens written."""
    tok, model = hf_smollm
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    chat_msgs = [{"role": "user", "content": "Name a colour."}]
    inp.write_text("\n".join([
        batch_line("comp", {"prompt": "The sky is", "max_tokens": 6, "temperature": 0, "logprobs": 2}),
        batch_line("chat", {"messages": chat_msgs, "max_tokens": 6, "temperature": 0, "logprobs": True,
                            "top_logprobs": 3}, "/v1/chat/completions"),
        batch_line("none", {"prompt": "The sky is", "max_tokens": 3, "temperature": 0}),
    ]) + "\n")
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--kv-dtype", "fp32", "--dtype", "float32",
                           "--quiet"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["custom_id"]: r for r in read_output(str(out))}

    comp = rows["comp"]["response"]["body"]["choices"][0]
    ids = tok("The sky is")["input_ids"]
    gen = tok(comp["text"], add_special_tokens=False)["input_ids"]
    lp = comp["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert "".join(lp["tokens"]) == comp["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    if len(gen) == 6:                # the text re-tokenizes to the same ids (not guaranteed in general)
        ref = hf_logprobs(model, ids, gen)
        assert lp["token_logprobs"] == pytest.approx([ref[t, g] for t, g in enumerate(gen)], abs=2e-4)
    for t, top in enumerate(lp["top_logprobs"]):
        assert 2 <= len(top) <= 3 and lp["tokens"][t] in top       # greedy: the sampled token is the top one
        assert max(top.values()) == pytest.approx(lp["token_logprobs"][t], abs=1e-6)

    chat = rows["chat"]["response"]["body"]["choices"][0]
    content = chat["logprobs"]["content"]
    assert len(content) == rows["chat"]["response"]["body"]["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode()) and math.isfinite(item["logprob"])
        tops = item["top_logprobs"]
        assert len(tops) == 3 and tops[0]["token"] == item["token"]
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)

    assert rows["none"]["response"]["body"]["choices"][0]["logprobs"] is None
    json.dumps(rows, allow_nan=False)      # every value is plain JSON (no NaN / Infinity)
