"""vLLM's prompt shapes: `LLM.generate` takes strings, TextPrompt and TokensPrompt dicts and token-id
lists, one or a list of them mixed, with one SamplingParams or one per prompt; a batch line's
`prompt` may be a string, token ids, or a list of either (OpenAI's batched prompts: prompt i's n
choices are i*n..i*n+n-1). Token-id prompts answer as their text does, and as HF transformers does
on the same weights; a list of prompts answers as the same prompts on separate lines."""
from __future__ import annotations

import json

import pytest
from conftest import batch_line, hf_greedy

from fastdecode import SamplingParams
from fastdecode.batch.generate import BatchJob
from fastdecode.batch.jsonl import parse_line
from fastdecode.batch.schema import Limits
from fastdecode.engine.prompt_inputs import params_per_prompt, parse_prompts

VOCAB = 49152                                   # smollm2-135m
A, B = "The capital of France is", "Water boils at"
GREEDY = SamplingParams(max_tokens=12, temperature=0)


# ---------------------------------------------------------------------------- shapes (no model)

def test_every_accepted_shape_one_or_mixed():
    assert parse_prompts("hi") == [("hi", None)]
    assert parse_prompts({"prompt": "hi"}) == [("hi", None)]
    assert parse_prompts({"prompt_token_ids": (5, 6)}) == [(None, [5, 6])]
    assert parse_prompts([5, 6]) == [(None, [5, 6])]                       # one prompt as token ids
    assert parse_prompts(["a", {"prompt": "b"}, {"prompt_token_ids": [1]}, [2, 3]]) == \
        [("a", None), ("b", None), (None, [1]), (None, [2, 3])]
    assert parse_prompts([]) == []


@pytest.mark.parametrize("prompts, error, match", [
    (5, TypeError, r"prompts must be a string, \{'prompt': str\}"),
    (["ok", 3.5], TypeError, r"prompts\[1\] must be a string, .* or a list of token ids, got float"),
    ([{"prompt_token_ids": []}], ValueError, r"prompts\[0\]\['prompt_token_ids'\] is empty"),
    ([[1, True]], TypeError, r"prompts\[0\]\[1\] must be an integer token id, got True"),
    ([{"prompt": 7}], TypeError, r"prompts\[0\]\['prompt'\] must be a string"),
    ([{"text": "x"}], ValueError, r"prompts\[0\] has the unknown key 'text'"),
    ([{"prompt": "x", "prompt_token_ids": [1]}], ValueError, "give one"),
    ([{"prompt_embeds": [[0.0]]}], ValueError, "prompt embeddings are not supported"),
    ([{}], ValueError, r"prompts\[0\] is a dict without 'prompt' or 'prompt_token_ids'"),
])
def test_a_bad_shape_names_its_index_and_what_is_accepted(prompts, error, match):
    with pytest.raises(error, match=match):
        parse_prompts(prompts)


def test_sampling_params_one_or_one_per_prompt():
    p, q = SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)
    assert params_per_prompt(p, 3) == [p, p, p]
    assert params_per_prompt([p, q], 2) == [p, q]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        params_per_prompt([p], 2)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got dict"):
        params_per_prompt([p, {"max_tokens": 3}], 2)


# ---------------------------------------------------------------------------- the Python API

def test_token_prompts_answer_as_their_text_and_as_hf(llm, hf_smollm):
    tok, model = hf_smollm
    ids = tok(A)["input_ids"]
    outs = llm.generate([A, {"prompt": A}, {"prompt_token_ids": ids}, ids], GREEDY, use_tqdm=False)
    expected = hf_greedy(model, ids, GREEDY.max_tokens, [tok.eos_token_id])
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 4
    assert [o.prompt for o in outs] == [A, A, None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    single = llm.generate({"prompt_token_ids": ids}, [GREEDY], use_tqdm=False)
    assert single[0].outputs[0].token_ids == expected


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate([A, B], [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0),
                                 SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]


def test_ids_outside_the_vocabulary_are_named_and_nothing_is_queued(llm):
    with pytest.raises(ValueError, match=rf"prompts\[1\]: prompt token ids {VOCAB + 3}, -1 are not in the model's "
                                         rf"vocabulary \[0, {VOCAB}\)"):
        llm.generate([A, {"prompt_token_ids": [5, VOCAB + 3, -1]}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()          # the good prompt before it was not queued either
    assert len(llm.generate([B], GREEDY, use_tqdm=False)) == 1


# ---------------------------------------------------------------------------- batch lines

def prompts_of(body: dict, limits: Limits | None = None):
    line = parse_line(1, batch_line("p", body), limits or Limits())
    return line.prompts if line.error is None else (line.error.code, str(line.error))


def test_batch_prompt_shapes_and_their_errors():
    assert prompts_of({"prompt": [A, B]}) == [A, B]
    assert prompts_of({"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]
    assert prompts_of({"prompt": [A]}) == [A]
    assert prompts_of({"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert prompts_of({"prompt": []}) == ("invalid_request", ("body.prompt must be a non-empty list (of token "
                                                              "ids, strings or token-id lists)"))
    assert prompts_of({"prompt": [[1, 2], []]}) == ("invalid_request",
                                                    "body.prompt[1] must be a non-empty list of token ids")
    assert prompts_of({"prompt": [A, ""]}) == ("invalid_request", "body.prompt[1] must be a non-empty string")
    assert prompts_of({"prompt": [A, [1]]}) == [A, [1]]                  # mixed, as LLM.generate takes them
    code, message = prompts_of({"prompt": [1, A]})
    assert code == "invalid_request" and message.startswith("body.prompt must be a string, a list of token ids")
    assert prompts_of({"prompt": [[1, -2]]})[0] == "invalid_request"


def test_the_list_limit_bounds_the_prompts_of_a_line():
    limits = Limits(max_list_items=3)
    assert prompts_of({"prompt": ["a"] * 4}, limits) == (
        "request_too_large", "body.prompt must have at most 3 prompts (--max-list-items), got 4")
    assert prompts_of({"prompt": [[1]] * 4}, limits)[0] == "request_too_large"
    assert prompts_of({"prompt": list(range(10))}, limits) == [list(range(10))]   # one prompt: the context bounds it


def run_lines(llm, tmp_path, lines: list[str]) -> dict[str, dict]:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    with BatchJob(str(inp), str(out)) as job:
        assert not job.run(llm.engine, show_progress=False)
        job.finish(sort=True)
    rows = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == [json.loads(x)["custom_id"] for x in lines]
    return {r["custom_id"]: r for r in rows}


def choices(row: dict) -> list[tuple[int, str]]:
    return [(c["index"], c["text"]) for c in row["response"]["body"]["choices"]]


def test_a_prompt_list_answers_as_separate_lines(llm, tmp_path):
    ids_a, ids_b = (llm.get_tokenizer()(p)["input_ids"] for p in (A, B))
    greedy = {"max_tokens": 6, "temperature": 0}
    sampled = {"max_tokens": 6, "temperature": 0.9, "seed": 7, "n": 2}
    rows = run_lines(llm, tmp_path, [
        batch_line("a", {**greedy, "prompt": A}), batch_line("b", {**greedy, "prompt": B}),
        batch_line("ids", {**greedy, "prompt": [ids_a, ids_b]}),
        batch_line("sa", {**sampled, "prompt": A}), batch_line("sb", {**sampled, "prompt": B}),
        batch_line("both", {**sampled, "prompt": [A, B]}),
        batch_line("mixed", {**greedy, "prompt": [A, ids_b]}),
        batch_line("echo", {"max_tokens": 2, "temperature": 0, "prompt": [A, B], "echo": True}),
        batch_line("empty-inner", {**greedy, "prompt": [ids_a, []]}),
        batch_line("vocab", {**greedy, "prompt": [ids_a, [1, VOCAB + 1]]})])
    assert choices(rows["ids"]) == [(0, choices(rows["a"])[0][1]), (1, choices(rows["b"])[0][1])]
    assert choices(rows["mixed"]) == [(0, choices(rows["a"])[0][1]), (1, choices(rows["b"])[0][1])]
    separate = [text for cid in ("sa", "sb") for _, text in choices(rows[cid])]
    assert choices(rows["both"]) == list(enumerate(separate))             # prompt i's choices are i*n..i*n+n-1
    usage = rows["both"]["response"]["body"]["usage"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert usage[key] == sum(rows[cid]["response"]["body"]["usage"][key] for cid in ("sa", "sb"))
    echoed = [text for _, text in choices(rows["echo"])]
    assert echoed[0].startswith(A) and echoed[1].startswith(B) and len(echoed) == 2
    assert rows["empty-inner"]["error"]["message"] == "body.prompt[1] must be a non-empty list of token ids"
    assert rows["vocab"]["response"]["status_code"] == 400
    assert rows["vocab"]["error"]["message"].startswith(f"body.prompt[1]: prompt token ids {VOCAB + 1} are not")


def test_the_usage_guides_mixed_prompt_list_is_served():
    """docs/usage.md's example line (a string and a token-id list in one `prompt`) parses to its two prompts."""
    import pathlib
    import re
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "usage.md").read_text()
    example = next(m.group(1) for m in re.finditer(r"```json\n(.*?)```", doc, re.S) if '"prompt": [' in m.group(1))
    line = parse_line(1, " ".join(example.split("\n")), Limits())
    assert line.error is None, line.error
    assert [type(p) for p in line.prompts] == [str, list] and line.prompts[1] == [12615, 36411, 418]
