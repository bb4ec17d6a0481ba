"""The Python API as a vLLM user writes it: LLM's keyword arguments (mapped, accepted at their no-op
value, refused naming why), llm.chat with content parts and templates against HF's own
apply_chat_template, SamplingParams' detokenize / truncate_prompt_tokens /
spaces_between_special_tokens / best_of / guided decoding, and RequestOutput.metrics."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastdecode import LLM, SamplingParams
from fastdecode.engine.args import EngineArgs
from fastdecode.vllm_args import engine_kwargs

FIELDS = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}
GREEDY = dict(temperature=0, max_tokens=3)


# ---------------------------------------------------------------------------- LLM's keyword arguments

def test_vllm_kwargs_with_a_meaning_here_are_mapped():
    got = engine_kwargs(dict(max_num_seqs=7, seed=None, dtype=torch.bfloat16, kv_cache_dtype="auto",
                             enable_prefix_caching=False, enforce_eager=True, tokenizer="/t", revision="v1",
                             max_model_len=512), FIELDS)
    assert got == dict(max_batch=7, seed=0, dtype="bfloat16", kv_dtype="auto", prefix_sharing=False,
                       enforce_eager=True, tokenizer="/t", revision="v1", max_model_len=512)
    assert engine_kwargs(dict(dtype="half", seed=3, enforce_eager=False), FIELDS) == dict(dtype="float16", seed=3,
                                                                                         enforce_eager=False)
    # vLLM's defaults of what has no meaning here change nothing
    assert engine_kwargs(dict(trust_remote_code=False, pipeline_parallel_size=1,
                              swap_space=4, tokenizer_mode="auto",
                              disable_log_stats=True), FIELDS) == {}
    # the S-worker over several GPUs is fastdecode's own (fastdecode/tp/)
    assert engine_kwargs(dict(tensor_parallel_size=2), FIELDS) == dict(tensor_parallel_size=2)
    # the fraction of the card a GPU S-worker fills (its KV tier included) is fastdecode's own too
    assert engine_kwargs(dict(gpu_memory_utilization=0.5), FIELDS) == dict(gpu_memory_utilization=0.5)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(tensor_parallel_size=2), "--tensor-parallel-size 2 needs 2 MPI ranks for the S-worker, and the job has 1"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5: expected a fraction in (0, 1]"),
    (dict(quantization="int4"), "quantization"),
    (dict(trust_remote_code=True), "trust_remote_code=True is not supported by fastdecode: fastdecode runs its own "
                                   "implementation of each model family"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype 'fp8' is not supported by fastdecode"),
    (dict(max_num_seqs=4, max_batch=8), "max_num_seqs=4 contradicts max_batch=8"),
    (dict(dtype="float64"), "dtype must be one of"),
])
def test_vllm_kwargs_without_a_meaning_are_refused_naming_why(kwargs, needle):
    with pytest.raises(ValueError) as e:
        LLM("smollm2-135m", **kwargs)                 # refused before anything loads
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_kwarg_is_a_type_error_with_the_closest_name():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_num_seq'.*did you mean max_num_seqs\?"):
        LLM("smollm2-135m", max_num_seq=4)


@pytest.fixture(scope="module")
def llm_one():
    """vLLM's spelling of the arguments; one sequence at a time (max_num_seqs=1)."""
    engine = LLM("smollm2-135m", max_num_seqs=1, seed=None, dtype="float32", kv_dtype="fp32", device="cpu",
                 trust_remote_code=False, tensor_parallel_size=1, gpu_memory_utilization=0.9, enforce_eager=True)
    yield engine
    engine.close()


def test_max_num_seqs_is_the_batch_and_metrics_are_filled_as_vllm_does(llm_one):
    assert llm_one.engine.args.max_batch == 1
    first, second = llm_one.generate(["The sky is", "Water boils at"], SamplingParams(**GREEDY), use_tqdm=False)
    for out in (first, second):
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time == m.finished_time
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
        assert m.scheduler_time is None and m.model_forward_time is None
    # one at a time: the second waited in the queue until the first finished
    assert second.metrics.first_scheduled_time >= first.metrics.finished_time
    assert second.metrics.time_in_queue > first.metrics.time_in_queue


# ---------------------------------------------------------------------------- llm.chat

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Count to 3."}, {"type": "text", "text": "Go."}]}]
TEXT_CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3.\nGo."}]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def hf_ids(tok, conv, **kw) -> list[int]:
    out = tok.apply_chat_template(conv, tokenize=True, **kw)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def chat_prompt(llm, conv, **kw) -> list[int]:
    return llm.chat(conv, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, **kw)[0].prompt_token_ids


def test_chat_content_parts_and_templates_match_hf(llm, tmp_path):
    tok = llm.get_tokenizer()
    assert chat_prompt(llm, CONV) == hf_ids(tok, TEXT_CONV, add_generation_prompt=True)      # parts joined by \n
    assert chat_prompt(llm, CONV, add_generation_prompt=False) == hf_ids(tok, TEXT_CONV, add_generation_prompt=False)
    assert chat_prompt(llm, CONV, chat_template=TEMPLATE) == hf_ids(tok, TEXT_CONV, chat_template=TEMPLATE,
                                                                    add_generation_prompt=True)
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert chat_prompt(llm, CONV, chat_template=str(path)) == chat_prompt(llm, CONV, chat_template=TEMPLATE)
    partial = TEXT_CONV + [{"role": "assistant", "content": "1, 2,"}]
    cont = chat_prompt(llm, partial, add_generation_prompt=False, continue_final_message=True)
    assert cont == hf_ids(tok, partial, continue_final_message=True)
    assert tok.decode(cont).endswith("1, 2,")                     # the last message left open
    # several conversations at once, in order
    outs = llm.chat([CONV, TEXT_CONV], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids


def test_chat_errors_name_the_message(llm):
    with pytest.raises(ValueError, match="pass add_generation_prompt=False"):
        llm.chat(TEXT_CONV, continue_final_message=True, use_tqdm=False)
    image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                          {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: content parts of type 'image_url' are not"):
        llm.chat(image, use_tqdm=False)
    with pytest.raises(ValueError, match="looks like a file path but cannot be read"):
        llm.chat(TEXT_CONV, chat_template="/no/such/template.jinja", use_tqdm=False)


# ---------------------------------------------------------------------------- SamplingParams

def test_detokenize_false_gives_the_same_tokens_without_text(llm):
    with_text = llm.generate("The sky is", SamplingParams(**GREEDY, logprobs=1), use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate("The sky is", SamplingParams(**GREEDY, logprobs=1, detokenize=False),
                            use_tqdm=False)[0].outputs[0]
    assert with_text.text and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for pos in ids_only.logprobs for lp in pos.values())
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["."], detokenize=False)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    tok = llm.get_tokenizer()
    text = "The quick brown fox jumps over the lazy dog"
    full = tok(text)["input_ids"]
    got = llm.generate([text, full], SamplingParams(**GREEDY, truncate_prompt_tokens=4), use_tqdm=False)
    assert got[0].prompt_token_ids == got[1].prompt_token_ids == full[-4:]
    whole = llm.generate(text, SamplingParams(**GREEDY, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == full                          # -1: the model's context, longer than it
    chat = llm.chat(TEXT_CONV, SamplingParams(**GREEDY, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert chat.prompt_token_ids == hf_ids(tok, TEXT_CONV, add_generation_prompt=True)[-5:]
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be an integer >= 1, or -1"):
            SamplingParams(truncate_prompt_tokens=bad)


class CharTokenizer:
    """A slow (pure Python) tokenizer over a few letters, built lazily (transformers' base class)."""

    @staticmethod
    def make():
        from transformers import PreTrainedTokenizer

        class Chars(PreTrainedTokenizer):
            letters = "abcdefgh "

            @property
            def vocab_size(self):
                return len(self.letters)

            def get_vocab(self):
                return {**{c: i for i, c in enumerate(self.letters)}, **self.added_tokens_encoder}

            def _tokenize(self, text):
                return list(text)

            def _convert_token_to_id(self, token):
                return self.letters.index(token)

            def _convert_id_to_token(self, index):
                return self.letters[index]

            def convert_tokens_to_string(self, tokens):
                return "".join(tokens)

        return Chars(eos_token="<eos>", additional_special_tokens=["<sep>"])


def test_spaces_between_special_tokens_as_vllm_detokenizes(llm):
    from fastdecode.model.tokenizer import Tokenizer
    slow = Tokenizer.__new__(Tokenizer)
    slow.hf = CharTokenizer.make()
    assert not slow.hf.is_fast
    ids = slow.hf.convert_tokens_to_ids([*"ab", "<sep>", *"cd", "<eos>"])
    assert slow.decode(ids, skip_special_tokens=False) == "ab <sep> cd <eos>"          # vLLM's default
    assert slow.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == "ab<sep>cd<eos>"
    assert slow.decode(ids, skip_special_tokens=True) == "abcd"
    # a fast tokenizer's text is the same either way (as in vLLM); the flag reaches the output
    outs = [llm.generate("The sky is", SamplingParams(**GREEDY, skip_special_tokens=False,
                                                      spaces_between_special_tokens=flag), use_tqdm=False)[0]
            for flag in (True, False)]
    assert outs[0].outputs[0].text == outs[1].outputs[0].text
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be a bool"):
        SamplingParams(spaces_between_special_tokens="no")


def test_best_of_and_guided_decoding_are_refused():
    assert SamplingParams(n=3, best_of=3).n == 3                          # best_of = n: what is done anyway
    with pytest.raises(ValueError, match=r"best_of must be None or n \(1\): fastdecode returns every sample"):
        SamplingParams(best_of=2)
    with pytest.raises(ValueError, match="guided_decoding must be None: guided decoding is not supported"):
        SamplingParams(guided_decoding={"json": {"type": "object"}})
    with pytest.raises(ValueError, match="structured_outputs must be None"):
        SamplingParams(structured_outputs={"regex": "a+"})
