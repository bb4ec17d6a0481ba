"""The S-worker's own KV tier under tensor parallelism: every S-rank keeps the tier's pages of its
own KV heads (Hkv/T of each token) and attends its own query heads over them, with no gather:
the tier's sequences never leave the ranks' memories. Each rank's tier sees the same fork,
extend and free calls (the runner runs the same steps on every rank), so their pages stay in
step. To placement and the reports the tier is one worker holding whole tokens: its bytes are
counted as all T ranks' together (a rank's x T), its attention speed per whole token likewise
(the ranks attend their heads at once), so nothing above the backend knows of T. A rank's pages
hold only its heads, so the tier neither exports nor imports KV (RBackend's defaults refuse)."""
from __future__ import annotations

import dataclasses

from fastdecode.rpart.base import RBackend, StepStats


class ShardedTier(RBackend):
    def __init__(self, tier: RBackend, ranks: int):
        self.tier, self.ranks = tier, ranks
        self.workers = [dataclasses.replace(w, capacity_bytes=w.capacity_bytes * ranks, kv_layout="")
                        for w in tier.workers]

    @property
    def prefill_times(self):
        return self.tier.prefill_times

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        self.tier.prefill_begin(row_ids, counts, layers, reserve, continued, forks)

    def prefill_layer(self, layer, k, v):
        self.tier.prefill_layer(layer, k, v)

    def prefill_end(self):
        self.tier.prefill_end()

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self.tier.decode_begin(minibatches, layers, mixed)

    def decode_buffer(self, layer, mb, numel, device, dtype):
        return self.tier.decode_buffer(layer, mb, numel, device, dtype)

    def decode_submit(self, layer, mb, packed):
        self.tier.decode_submit(layer, mb, packed)

    def decode_wait(self, layer, mb):
        return self.tier.decode_wait(layer, mb)

    def decode_end(self):
        s = self.tier.decode_end()
        if s is None:
            return None
        return StepStats(attend_s=s.attend_s, busy_s=s.busy_s, kv_bytes=[b * self.ranks for b in s.kv_bytes],
                         append_s=s.append_s, kv_saved_bytes=[b * self.ranks for b in s.kv_saved_bytes])

    def free(self, seq_ids_by_worker):
        self.tier.free(seq_ids_by_worker)

    def profile_workers(self, seqs, target_bytes):
        out = []
        for r in self.tier.profile_workers(seqs, target_bytes):
            r = dict(r, seconds_per_kv_byte=r["seconds_per_kv_byte"] / self.ranks,
                     bandwidth_GBps=r["bandwidth_GBps"] * self.ranks, capacity_bytes=r["capacity_bytes"] * self.ranks)
            out.append(r)
        return out

    def ping(self, sizes, repeats):
        return self.tier.ping(sizes, repeats)

    def ping_all(self, sizes, repeats):
        return self.tier.ping_all(sizes, repeats)

    def close(self):
        self.tier.close()
