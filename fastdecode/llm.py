"""The vLLM-shaped Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

In a singleton process the R-part runs in-process (local mode). Under `mpirun -n 1+R` every rank
runs the same script: rank 0 returns an LLM (the S-worker); on ranks 1..R the constructor serves
as an R-worker until rank 0 closes, then ends the process. With `tensor_parallel_size=T` (under
`mpirun -n T+R`) ranks 1..T-1 serve as the S-worker's other ranks the same way.

`LLM(...)` takes EngineArgs' fields and vLLM's keyword arguments (vllm_args.py: `max_num_seqs` is
the max batch; one without a meaning here is accepted at its no-op value, refused at any other),
within the ranges the command line's flags take (flag_ranges.py): a ValueError names the one out.
"""
from __future__ import annotations

import atexit
import dataclasses
import sys
from collections.abc import Sequence as Seq

from fastdecode.batch.progress import Progress, engine_snapshot
from fastdecode.engine.args import EngineArgs
from fastdecode.engine.chat import conversations, load_chat_template, template_messages
from fastdecode.engine.prompt_inputs import params_per_prompt, parse_prompts
from fastdecode.engine.request_checks import RequestError
from fastdecode.engine.sampling_params import RequestOutput, SamplingParams
from fastdecode.flag_ranges import engine_args_error, machine_error
from fastdecode.launch import mpi_env
from fastdecode.launch.ranks import launched_roles, set_s_ranks
from fastdecode.tp.engines import s_worker_engine
from fastdecode.vllm_args import engine_kwargs

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs):
        from fastdecode.launch.env_vars import environment_error
        args = EngineArgs(model=model, **engine_kwargs(kwargs, _ENGINE_FIELDS))
        set_s_ranks(args.tensor_parallel_size)            # the roles' names in every message and report
        rank, roles = mpi_env.launched_rank(), launched_roles()
        # the command line's ranges, and its check of sizes against this machine (flag_ranges.py)
        error = engine_args_error(args) or machine_error(args, rank, roles) \
            or environment_error(runs_kernels=roles.holds_kv(rank))
        if error:
            raise ValueError(error)
        comm = mpi_env.world()
        if comm is not None and roles.is_rworker(comm.Get_rank()):
            from rworker.worker import run
            run(comm, args.r_threads, args.rworker_mem, args.timeout, s_ranks=roles.s_ranks)
            sys.exit(0)
        if comm is not None and comm.Get_rank() != 0:       # a tensor-parallel S-worker's other ranks
            from fastdecode.tp.follower_engine import run_follower
            run_follower(args, comm)
            sys.exit(0)
        try:
            self.engine = s_worker_engine(args, comm)
        except Exception as e:
            if comm is not None:
                mpi_env.fail(comm, e)
            raise
        self._closed = False
        self._requests_seen = 0
        atexit.register(self.close)

    def get_tokenizer(self):
        return self.engine.tokenizer.hf

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts, as vLLM takes them: a string, {"prompt": str} (TextPrompt), {"prompt_token_ids":
        [int, ...]} (TokensPrompt) or a list of token ids; one, or a list of them mixed.
        sampling_params: one for all prompts, or one per prompt. Outputs in input order."""
        parsed = parse_prompts(prompts)
        params = params_per_prompt(sampling_params, len(parsed))
        encoded = []
        for i, ((text, ids), p) in enumerate(zip(parsed, params)):
            keep = self._kept_prompt_tokens(p)
            if ids is None:
                try:
                    ids = self.engine.tokenizer.encode(text, truncate=keep)
                except ValueError as e:          # a model without a tokenizer takes token ids only
                    raise ValueError(f"prompts[{i}]: {e}") from None
            elif keep is not None:
                ids = ids[-keep:]
            encoded.append((text, ids))
        return self._run(encoded, params, use_tqdm, "prompts")

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's chat: messages is one conversation (a list of {"role", "content"}, content a
        string or a list of text parts) or a list of them, each through the chat template (the
        model's, or `chat_template`: its text or a file). add_generation_prompt opens the
        assistant's turn; continue_final_message (with add_generation_prompt=False) continues the
        last message instead; tools and chat_template_kwargs go to the template."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported by fastdecode")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message and add_generation_prompt=True "
                             "starts a new one: pass add_generation_prompt=False with it")
        template = load_chat_template(chat_template)
        convs = conversations(messages)
        params = params_per_prompt(sampling_params, len(convs))
        encoded = []
        for i, (conv, p) in enumerate(zip(convs, params)):
            where = "messages" if len(convs) == 1 and isinstance(messages[0], dict) else f"messages[{i}]"
            msgs = template_messages(conv, chat_template_content_format, where)
            try:
                ids = self.engine.tokenizer.encode_chat(msgs, template, add_generation_prompt, continue_final_message,
                                                        tools, chat_template_kwargs)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            keep = self._kept_prompt_tokens(p)
            encoded.append((None, ids if keep is None else ids[-keep:]))
        return self._run(encoded, params, use_tqdm, "messages")

    def _kept_prompt_tokens(self, params: SamplingParams) -> int | None:
        """vLLM's truncate_prompt_tokens: k keeps the prompt's last k tokens, -1 the model's context."""
        k = params.truncate_prompt_tokens
        return self.engine.max_model_len if k == -1 else k

    def _run(self, encoded, params: list[SamplingParams], use_tqdm: bool, what: str) -> list[RequestOutput]:
        n = len(encoded)
        eng = self.engine
        for i, ((_, ids), p) in enumerate(zip(encoded, params)):   # all checked before any is queued
            try:
                eng.check_request(ids, p)
            except RequestError as e:
                raise ValueError(f"{what}[{i}]: {e}") from None
        base, self._requests_seen = self._requests_seen, self._requests_seen + n   # unique request ids
        for i, ((text, ids), p) in enumerate(zip(encoded, params)):
            eng.add_request(i, str(base + i), text, ids, p)
        results: list[RequestOutput | None] = [None] * n
        done, before = 0, eng.num_output_tokens
        with Progress(lambda: engine_snapshot(eng, done, n, since_tokens=before), enabled=use_tqdm) as progress:
            while eng.has_unfinished():
                for req in eng.step():
                    results[req.index] = eng.output_of(req)
                    done += 1
                progress.update()
            progress.finish()
        return results

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            atexit.unregister(self.close)     # the exit hook held the engine (weights, KV) until exit
            self.engine.close()
