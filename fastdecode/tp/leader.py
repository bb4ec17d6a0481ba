"""Rank 0 of a tensor-parallel S-worker: it runs the engine as at T = 1 and, before each runner
call, tells the other S-ranks what the call is (steps.py), so they run the same call on the same
rows and every collective lines up. What a follower cannot know by itself it is told: the rows
(decode: the runner's meta array; prefill: each sequence's chunk, its reservation, its shared
prefix fork or capture), the sequences freed since the last call, and the shared prefixes whose
kept K/V rank 0 dropped. The mini-batch split is a pure function of the rows, so it needs no word.
"""
from __future__ import annotations

import numpy as np

from fastdecode.engine.runner import ModelRunner
from fastdecode.engine.sequence import Sequence
from fastdecode.tp import steps


class LeaderRunner(ModelRunner):
    def __init__(self, *args, comm, size: int, policy: str = "adaptive", timeout: float | None = None, **kwargs):
        self._prefix = None
        super().__init__(*args, **kwargs)
        self.comm, self.followers = comm, range(1, size)
        self.policy, self.timeout = policy, timeout
        self._freed: list[tuple[int, int]] = []      # (seq id, worker) freed since the last message
        self._stopped = False

    @property
    def prefix(self):
        return self._prefix

    @prefix.setter
    def prefix(self, cache) -> None:
        self._prefix = cache
        if cache is not None and cache.retired_ids is None:
            cache.retired_ids = []        # the followers keep copies of the kept K/V: they drop theirs with it

    def _send(self, kind: str, **parts) -> None:
        freed = np.array(self._freed, dtype=np.int64).reshape(-1, 2)
        self._freed = []
        retired = []
        if self._prefix is not None:
            retired, self._prefix.retired_ids = self._prefix.retired_ids, []
        steps.send_all(self.comm, self.followers, {"kind": kind, "frees": (freed[:, 0], freed[:, 1]),
                                                   "retired": retired, **parts}, self.policy, self.timeout)

    def shadows(self, seqs: list[Sequence]) -> list[steps.Shadow]:
        """What a follower's runner reads of each prefill row's sequence (before _prefill_plan takes
        the forks)."""
        out = []
        for s in seqs:
            b, e = s.prefilled, s.prefill_to or s.kv_len
            fork = self._prefix.forks.get(s.seq_id) if self._prefix is not None else None
            capture = self._prefix.capture_tokens(s) if self._prefix is not None else 0
            first = b == 0 or fork is not None
            out.append(steps.Shadow(
                s.seq_id, s.worker, s.prefilled, s.prefill_to, s.kv_len, s.prompt_len, s.output_ids[-1:],
                s.sample_index, s.request.params.prompt_logprobs, self._chunk_tokens(s, b, e),
                self.reserve_tokens(s) if first and self.reserve_tokens is not None else 0,
                (fork.entry, fork.source, fork.tokens) if fork is not None else None,
                (self._prefix.donated[s.seq_id].id, capture) if capture else None))
        return out

    def prefill(self, seqs):
        self._send("prefill", shadows=self.shadows(seqs))
        return super().prefill(seqs)

    def decode(self, seqs):
        self._send("decode", meta=self._decode_meta(seqs))
        return super().decode(seqs)

    def mixed(self, decode, prefill):
        self._send("mixed", meta=self._decode_meta(decode), shadows=self.shadows(prefill))
        return super().mixed(decode, prefill)

    def forget(self, seqs):
        self._freed += [(s.seq_id, s.worker) for s in seqs]
        super().forget(seqs)

    def stop(self) -> None:
        """The followers close their backends and leave (the engine closes)."""
        if not self._stopped:
            self._stopped = True
            steps.send_all(self.comm, self.followers, steps.stop_message(), self.policy, self.timeout)


def start(comm, args, config):
    """Rank 0, in the engine's start: the followers begin (steps.py "start"), and every S-rank
    joins the group (context.py). -> this rank's TPContext."""
    from fastdecode.engine.args import resolve_device
    from fastdecode.model.config import ConfigError
    from fastdecode.tp.checks import usage_error
    from fastdecode.tp.context import join
    error = usage_error(args.tensor_parallel_size, config, args.device, comm.Get_size() if comm is not None else 1)
    if error:
        raise ConfigError(error)
    steps.send_all(comm, range(1, args.tensor_parallel_size), steps.start_message(), timeout=args.timeout)
    return join(comm, args.tensor_parallel_size, config, resolve_device(args.device), args.timeout)


def runner(eng, comm) -> LeaderRunner:
    from rworker.host.wait import choose_policy
    ranks_here = eng.layout[0] if eng.layout else 1
    return LeaderRunner(eng.model, eng.backend, eng.eos_ids, eng.args.pipeline_depth, None, comm=comm,
                        size=eng.tp.size, policy=choose_policy(ranks_here, ranks_here), timeout=eng.args.timeout)


def workers(eng, comm, others):
    """Rank 0 found the R-workers (`others`): every follower learns them, and rank 0 reaches them for
    all S-ranks, gathering their heads (rpart/head_gather.py)."""
    import dataclasses

    from fastdecode.rpart.head_gather import HeadGather
    tp = eng.tp
    steps.send_all(comm, range(1, tp.size), {"kind": "workers", "workers": [dataclasses.asdict(w) for w in
                                                                             others.workers]},
                   timeout=eng.args.timeout)
    c = tp.config
    return HeadGather(others, tp.group, c.num_heads, c.num_kv_heads, c.head_dim)


def say(eng) -> None:
    """The start-up line of a tensor-parallel S-worker: its ranks and what each holds."""
    import sys

    from fastdecode.model.fp8 import weight_bytes
    from fastdecode.model.layer_weights import fp8_weights
    m, t = eng.model, eng.tp
    layer_bytes = sum(weight_bytes(v) for layer in m.layers for v in _tensors(layer))
    embed = m.embed.numel() * m.embed.element_size()
    head = m.lm_head.numel() * m.lm_head.element_size()
    fp8 = " (fp8)" if any(True for _ in fp8_weights(m.layers)) else ""
    print(f"fastdecode: tensor-parallel S-worker: {t.size} ranks (0..{t.size - 1}) over {t.group.backend}, "
          f"each with {m.config.num_heads} query / {m.config.num_kv_heads} KV heads and 1/{t.size} of every "
          f"MLP: {layer_bytes / 2**30:.2f} GiB of layer weights{fp8} and {head / 2**30:.2f} GiB of the LM head "
          f"per rank, the embedding ({embed / 2**30:.2f} GiB) and norms on every rank; rank 0 gathers the heads "
          f"for the R-workers", file=sys.stderr, flush=True)


def _tensors(layer: dict):
    """Every weight of a layer (the MLP's parts, an MoE's experts) for counting bytes."""
    for v in layer.values():
        if isinstance(v, tuple):
            yield from v
        elif hasattr(v, "gate_up"):
            yield from (p for p in (v.router, v.gate_up, v.down, v.shared_gate_up, v.shared_down, v.shared_gate)
                        if p is not None)
        elif v is not None:
            yield v


def close(eng) -> None:
    """The followers stop, the R-workers shut down, the group ends."""
    try:
        eng.runner.stop()
    finally:
        try:
            eng.backend.close()
        finally:
            eng.tp.group.close()


class Leader:
    """Rank 0's side of the assembly (engine/assembly.py) and of the engine's run and close."""
    join = staticmethod(start)
    workers = staticmethod(workers)
    say = staticmethod(say)
    runner = staticmethod(runner)
    close = staticmethod(close)
