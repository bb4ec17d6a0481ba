"""The R-part as two tiers: the R-workers (over MPI, or the host's own store) and the S-worker's
own KV tier beside them, one more worker to placement and the engine.

The tier is the last worker, so in every batch (rows grouped by worker, in worker order) its rows
come last: a decode buffer is [the R-workers' blocks | the tier's block] in the wire layout, and
the R-workers' backend gets the head of the very buffer it handed out (on a CPU S-worker its MPI
send buffer: nothing is copied), the tier the tail. Per layer the R-workers' rows leave first,
then the tier attends its own (queued on the GPU's compute stream, or on a CPU S-worker in turn
on its own thread), so the R-workers' round trip runs beside the tier's attention.

    workers: [R-worker 0 .. R-worker R-1 | tier]
    decode buffer of a mini-batch: [q|k|v of the R-workers' rows (their layout) | q|k|v of the tier's rows]
"""
from __future__ import annotations

import torch

from fastdecode.rpart.base import PrefillTimes, RBackend, StepStats


def _split_grouped(grouped, n_head: int):
    """(ids, values..., counts per worker) grouped by worker -> the head's (first n_head workers)
    and the tail's (the tier) parts, or None where a side has none."""
    if grouped is None:
        return None, None
    *arrays, per_worker = grouped
    rows = sum(per_worker[:n_head])
    head = (*[a[:rows] for a in arrays], list(per_worker[:n_head]))
    tail = (*[a[rows:] for a in arrays], list(per_worker[n_head:]))
    return head, tail


class TieredBackend(RBackend):
    def __init__(self, others: RBackend, tier: RBackend):
        self.others, self.tier = others, tier
        self.workers = list(others.workers) + list(tier.workers)
        self.num_others = len(others.workers)
        self.prefill_times = PrefillTimes()
        self._mb_rows: list[tuple[int, int]] = []      # per mini-batch: (R-workers' rows, tier's rows)
        self._elems = 0                                # q|k|v elements of one row
        self._pf_rows = (0, 0)
        self.tier_decode_rows = 0                      # rows the tier attended / prefilled: they never
        self.tier_prefill_rows = 0                     # crossed a link (the byte counters leave them out)

    @property
    def tier_index(self) -> int:
        return self.num_others

    @property
    def bytes_sent(self) -> int:            # activation payload on the link (the tier puts none there)
        return getattr(self.others, "bytes_sent", 0)

    @property
    def bytes_received(self) -> int:
        return getattr(self.others, "bytes_received", 0)

    # ------------------------------------------------------------------ prefill

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        r = self.num_others
        n_head = int(sum(counts[:r]))
        self._pf_rows = (n_head, int(sum(counts[r:])))
        self.tier_prefill_rows += self._pf_rows[1]
        res_head, res_tail = _split_grouped(reserve, r)
        fork_head, fork_tail = _split_grouped(forks, r)
        if n_head:
            self.others.prefill_begin(row_ids[:n_head], list(counts[:r]), layers, res_head, continued, fork_head)
        if self._pf_rows[1]:
            self.tier.prefill_begin(row_ids[n_head:], list(counts[r:]), layers, res_tail, continued, fork_tail)

    def prefill_layer(self, layer, k, v):
        n_head, n_tail = self._pf_rows
        if n_head:
            self.others.prefill_layer(layer, k[:n_head], v[:n_head])
        if n_tail:
            self.tier.prefill_layer(layer, k[n_head:], v[n_head:])

    def prefill_end(self):
        n_head, n_tail = self._pf_rows
        times = PrefillTimes()
        for side, rows in ((self.others, n_head), (self.tier, n_tail)):
            if rows:
                side.prefill_end()
                t = side.prefill_times
                times.pack_s += t.pack_s
                times.wait_s += t.wait_s
                times.append_s += t.append_s
        self.prefill_times = times

    # ------------------------------------------------------------------ decode

    def decode_begin(self, minibatches, layers=0, mixed=None):
        r = self.num_others
        self._mb_rows = [(int(sum(c[:r])), int(sum(c[r:]))) for _, c in minibatches]
        self.tier_decode_rows += sum(t for _, t in self._mb_rows)
        self.others.decode_begin([(ids[:h], list(c[:r])) for (ids, c), (h, _) in zip(minibatches, self._mb_rows)],
                                 layers, None if mixed is None else list(mixed[:r]))
        self.tier.decode_begin([(ids[h:], list(c[r:])) for (ids, c), (h, _) in zip(minibatches, self._mb_rows)],
                               layers, None if mixed is None else list(mixed[r:]))

    def decode_buffer(self, layer, mb, numel, device, dtype):
        rows = sum(self._mb_rows[mb])
        self._elems = numel // rows if rows else 0
        if self._mb_rows[mb][0]:        # the R-workers' own buffer, long enough for the tier's rows too
            return self.others.decode_buffer(layer, mb, numel, device, dtype)
        return self.tier.decode_buffer(layer, mb, numel, device, dtype)

    def decode_submit(self, layer, mb, packed):
        n_head, _ = self._mb_rows[mb]
        split = n_head * self._elems
        self.others.decode_submit(layer, mb, packed[:split])        # leaves first: its round trip is the longer
        if self._mb_rows[mb][1]:            # an empty call would still wake the tier's kernel threads
            self.tier.decode_submit(layer, mb, packed[split:])

    def decode_wait(self, layer, mb):
        n_head, n_tail = self._mb_rows[mb]
        if not n_tail:
            return self.others.decode_wait(layer, mb)                 # [n_head, Hq, D]
        o_tier = self.tier.decode_wait(layer, mb)                     # [n_tail, Hq, D]
        o_head = self.others.decode_wait(layer, mb)                   # [n_head, Hq, D]
        if not n_head:
            return o_tier
        return torch.cat([o_head, o_tier.to(device=o_head.device, dtype=o_head.dtype)])

    def decode_end(self):
        a, b = self.others.decode_end(), self.tier.decode_end()
        if a is None or b is None:
            return a or b
        return StepStats(*(getattr(a, f) + getattr(b, f) for f in StepStats.__dataclass_fields__))

    def free(self, seq_ids_by_worker):
        r = self.num_others
        if any(seq_ids_by_worker[:r]):
            self.others.free(seq_ids_by_worker[:r])
        if any(seq_ids_by_worker[r:]):
            self.tier.free(seq_ids_by_worker[r:])

    # ------------------------------------------------------------------ KV hand-over: by worker index

    def export_kv(self, seq_ids_by_worker):
        r = self.num_others
        if len(seq_ids_by_worker) != self.num_workers:
            raise ValueError(f"export_kv: {len(seq_ids_by_worker)} lists of sequences for {self.num_workers} workers")
        return self.others.export_kv(seq_ids_by_worker[:r]) + self.tier.export_kv(seq_ids_by_worker[r:])

    def import_kv(self, worker, seq_ids, blobs):
        r = self.num_others
        if worker < r:
            return self.others.import_kv(worker, seq_ids, blobs)
        return self.tier.import_kv(worker - r, seq_ids, blobs)

    # ------------------------------------------------------------------ profiling, lifecycle

    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]:
        return self.others.profile_workers(seqs, target_bytes) + self.tier.profile_workers(seqs, target_bytes)

    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]:
        return self.others.ping(sizes, repeats) + self.tier.ping(sizes, repeats)

    def ping_all(self, sizes: list[int], repeats: int) -> list[float]:
        return self.others.ping_all(sizes, repeats)       # the tier puts nothing on the link

    def close(self):
        try:
            self.others.close()
        finally:
            self.tier.close()
