"""Ranks 1..T-1 of a tensor-parallel S-worker: each holds its shard of the model and its share of
the S-worker's own KV tier, and runs every runner call rank 0 announces (steps.py) on the same
rows, so that the collectives of the layers line up. It reads no input and samples nothing: its
runner (FollowerRunner) takes the rows from the message, joins the LM head's gather and returns
placeholders where rank 0 samples. Shared prefixes: it keeps its own heads' K/V of each prefix
rank 0 keeps (MirrorPrefix), under the entry's id, until rank 0 says it dropped it.
"""
from __future__ import annotations

import numpy as np
import torch

from fastdecode.engine.prefix_cache import Fork
from fastdecode.engine.runner import PROMPT_LOGPROB_BLOCK, ModelRunner
from fastdecode.tp import steps


class MirrorPrefix:
    """The runner's side of engine/prefix_cache.py on a follower: what rank 0 decided, told per row."""

    def __init__(self):
        self.kept: dict[int, list] = {}          # entry id -> per layer (K, V) [tokens, Hkv/T, D]

    def take_fork(self, s: steps.Shadow) -> Fork | None:
        if s.fork is None:
            return None
        entry, source, tokens = s.fork
        return Fork(source, tokens, [(k[:tokens], v[:tokens]) for k, v in self.kept[entry]], entry)

    def capture_tokens(self, s: steps.Shadow) -> int:
        return s.capture[1] if s.capture is not None else 0

    def keep(self, s: steps.Shadow, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kv = self.kept.setdefault(s.capture[0], [])
        if layer == len(kv):
            kv.append((k, v))

    def drop(self, entries) -> None:
        for e in entries:
            self.kept.pop(int(e), None)


class FollowerRunner(ModelRunner):
    """The runner on rows told by rank 0: no sampling, no log-probabilities (the LM head's gather
    still runs: rank 0 needs every rank's slice)."""

    meta: np.ndarray | None = None     # this call's decode rows (rank 0's runner._decode_meta)

    def _decode_meta(self, seqs) -> np.ndarray:
        return self.meta

    @staticmethod
    def _chunk_tokens(s: steps.Shadow, start: int, end: int) -> list[int]:
        return s.tokens

    def _sampling_batch(self, seqs, n_out):
        return None

    def _sample(self, seqs, logits, batch) -> np.ndarray:
        return np.zeros(len(seqs), dtype=np.int64)

    def _prompt_logprobs(self, seqs, ends, x) -> None:
        m = self.model              # rank 0's blocks, in its order: each block's logits are a gather
        block = max(1, PROMPT_LOGPROB_BLOCK // m.config.vocab_size)
        for s, end in zip(seqs, ends):
            if s.prompt_logprobs is None or s.sample_index != 0:
                continue
            start, n = end - s.prompt_len, s.prompt_len - 1
            for i in range(0, n, block):
                m.logits(x[start + i: start + min(i + block, n)])

    def run(self, message: dict) -> None:
        """One message of rank 0's: the frees, the call, then the prefixes rank 0 dropped."""
        ids, workers = message["frees"]
        if len(ids):
            self.forget([steps.Shadow(int(i)) for i in ids])
            by_worker = [[] for _ in self.backend.workers]
            for i, w in zip(ids.tolist(), workers.tolist()):
                by_worker[w].append(i)
            self.backend.free(by_worker)
        kind = message["kind"]
        if kind in ("decode", "mixed"):
            self.meta = message["meta"]
        rows = list(range(len(self.meta))) if kind in ("decode", "mixed") else None
        if kind == "prefill":
            self.prefill(message["shadows"])
        elif kind == "decode":
            self.decode(rows)
        elif kind == "mixed":
            self.mixed(rows, message["shadows"])
        self.prefix.drop(message["retired"])
