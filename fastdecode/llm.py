"""The vLLM-shaped Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

In a singleton process the R-part runs in-process (local mode). Under `mpirun -n 1+R` every rank
runs the same script: rank 0 returns an LLM (the S-worker); on ranks 1..R the constructor serves
as an R-worker until rank 0 closes, then ends the process.
"""
from __future__ import annotations

import atexit
import sys
from collections.abc import Sequence as Seq

from fastdecode.batch.progress import Progress, engine_snapshot
from fastdecode.engine.args import EngineArgs
from fastdecode.engine.llm_engine import LLMEngine
from fastdecode.engine.prompt_inputs import params_per_prompt, parse_prompts
from fastdecode.engine.request_checks import RequestError
from fastdecode.engine.sampling_params import RequestOutput, SamplingParams
from fastdecode.launch import mpi_env


class LLM:
    def __init__(self, model: str = "smollm2-135m", **kwargs):
        from fastdecode.launch.env_vars import environment_error
        args = EngineArgs(model=model, **kwargs)
        error = environment_error(runs_kernels=mpi_env.launched_rank() > 0 or mpi_env.launched_size() <= 1)
        if error:
            raise ValueError(error)
        comm = mpi_env.world()
        if comm is not None and comm.Get_rank() != 0:
            from rworker.worker import run
            run(comm, args.r_threads, args.rworker_mem, args.timeout)
            sys.exit(0)
        try:
            self.engine = LLMEngine(args, comm)
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
        encoded = []
        for i, (text, ids) in enumerate(parse_prompts(prompts)):
            if ids is None:
                try:
                    ids = self.engine.tokenizer.encode(text)
                except ValueError as e:          # a model without a tokenizer takes token ids only
                    raise ValueError(f"prompts[{i}]: {e}") from None
            encoded.append((text, ids))
        return self._run(encoded, sampling_params, use_tqdm, "prompts")

    def chat(self, messages, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = [(None, self.engine.tokenizer.encode_chat(c)) for c in convs]
        return self._run(encoded, sampling_params, use_tqdm, "messages")

    def _run(self, encoded, sampling_params, use_tqdm: bool, what: str) -> list[RequestOutput]:
        n = len(encoded)
        params = params_per_prompt(sampling_params, n)
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
