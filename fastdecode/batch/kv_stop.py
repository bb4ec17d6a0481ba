"""On a stop, after OUTPUT.inflight is saved: the KV of the sequences it saves running, exported from
their workers and written beside it (inflight_kv.py), so the rerun reloads it instead of
recomputing it. `--save-kv-on-stop` says when: auto (where the KV takes at most half the free space
beside the output), always (whatever fits), never.

Only a sequence decoding on a worker that can export its KV (an R-worker's or local mode's store,
not the S-worker's own tier) is saved; the rest, and all of them where the KV is not saved, are
recomputed by the rerun as before. Nothing here can lose the token save: a failure is one line and
the KV file is left out.
"""
from __future__ import annotations

import sys

from fastdecode.batch import inflight, inflight_kv
from fastdecode.engine.sequence import Status


def running_on_workers(runner, layouts: list[bytes | None]) -> dict[int, list[tuple]]:
    """Per worker, the in-flight lines' sequences it holds that it can export:
    (sequence, line key, the prompt's place in the line)."""
    by_worker: dict[int, list[tuple]] = {}
    for pending in {id(p): p for p, _ in runner.pending.values()}.values():
        for k, req in enumerate(pending.requests):
            for seq in req.sequences:
                if seq.status is Status.RUNNING and seq.output_ids and seq.worker >= 0 and \
                        layouts[seq.worker] is not None:
                    by_worker.setdefault(seq.worker, []).append((seq, pending.key, k))
    return by_worker


def save(job, engine, mode: str) -> tuple[int, int]:
    """Export and write the KV of the sequences `job`'s stop saved; -> (sequences, bytes)."""
    path = inflight_kv.kv_path(job.inflight_path)
    bound = inflight_kv.inflight_digest(job.inflight_path, inflight.MAGIC)
    if mode == "never" or bound is None or job.runner is None:
        inflight_kv.discard(path)
        return 0, 0
    try:
        carried = job.saved.carried_kv() if job.saved is not None else []     # lines this run did not reach
        layouts = engine.backend.kv_layouts()
        by_worker = running_on_workers(job.runner, layouts)
        estimate = sum(s.kv_len for seqs in by_worker.values() for s, _, _ in seqs) * engine.kv_bytes_per_token
        why = inflight_kv.room_for(path, estimate + sum(len(it.blob) for it in carried), mode)
        if why is not None:
            print(f"fastdecode: {path}: the KV in flight is not saved ({why}); the rerun recomputes it",
                      file=sys.stderr, flush=True)
            inflight_kv.discard(path)
            return 0, 0
        items = list(carried)
        for w, seqs in sorted(by_worker.items()):         # one worker at a time: its KV alone in memory
            ask = [[s.seq_id for s, _, _ in seqs] if v == w else [] for v in range(len(layouts))]
            blobs = engine.backend.export_kv(ask)[w]
            items += [inflight_kv.Item(key, k, s.sample_index, s.kv_len, layouts[w], blobs[s.seq_id])
                      for s, key, k in seqs]
        nbytes = inflight_kv.save(path, job.writer.path, bound, items)
    except Exception as e:  # noqa: BLE001 - the token save stands; only the reload is lost
        inflight_kv.discard(path)
        print(f"fastdecode: {path}: could not save the KV in flight ({type(e).__name__}: {e}); the rerun "
              f"recomputes it", file=sys.stderr, flush=True)
        return 0, 0
    if items:
        print(f"fastdecode: saved the KV of {len(items)} sequence(s) ({nbytes / 2**20:.1f} MiB) to {path}; the "
              f"rerun reloads it", file=sys.stderr, flush=True)
    return len(items), nbytes
