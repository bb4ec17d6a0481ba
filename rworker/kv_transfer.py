"""A worker's side of moving sequences' KV-caches as its store's blobs (KV_EXPORT / KV_IMPORT,
rworker.protocol.control): a stopped job saves them, its rerun gives them back instead of
recomputing the prompts. What a blob does to the store is rworker.kv_blobs (local mode's too).

    KV_EXPORT: per sequence int64[1] blob size (-1: not held), then its uint8 chunks    (TAG_KVBLOB)
    KV_IMPORT: per sequence its uint8 chunks in (sizes from the control message), then the JSON
               answer {"stored": [n] bool, "refused": [[seq id, why], ...]}              (TAG_INFO)
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from rworker.host.wait import wait_all
from rworker.kv_blobs import import_one
from rworker.protocol import control as P

S_NAME = "rank 0 (S-worker)"


def send_blobs(comm: MPI.Comm, store, held: set[int], move: P.KVMove, policy: str, timeout: float | None) -> None:
    """KV_EXPORT: each sequence's size, then its blob in chunks, one sequence at a time (one blob
    in this rank's memory at once)."""
    for sid in move.seq_ids.tolist():
        blob = store.export_seq(sid) if sid in held else None
        view = np.frombuffer(blob, dtype=np.uint8) if blob is not None else np.zeros(0, np.uint8)   # [size]
        comm.Send([np.array([view.size if blob is not None else -1], np.int64), MPI.INT64_T], dest=0,
                  tag=P.TAG_KVBLOB)
        reqs = [comm.Isend([view[s:e], MPI.BYTE], dest=0, tag=P.TAG_KVBLOB)
                for s, e in P.blob_chunks(view.size, move.chunk)]
        wait_all(reqs, policy, timeout, who=S_NAME)


def receive_blob(comm: MPI.Comm, source: int, size: int, chunk: int, policy: str, timeout: float | None,
                 who: str) -> np.ndarray:
    """One blob of `size` bytes in its chunks from `source` -> uint8 [size]; ProtocolError when a
    chunk is shorter than announced."""
    buf = np.empty(size, dtype=np.uint8)                                        # [size]
    ranges = P.blob_chunks(size, chunk)
    reqs = [comm.Irecv([buf[s:e], MPI.BYTE], source=source, tag=P.TAG_KVBLOB) for s, e in ranges]
    statuses = [MPI.Status() for _ in reqs]
    wait_all(reqs, policy, timeout, who=who, statuses=statuses)
    for (s, e), st in zip(ranges, statuses):
        if st.Get_count(MPI.BYTE) != e - s:
            raise P.ProtocolError(f"protocol error: a KV blob chunk of {st.Get_count(MPI.BYTE)} bytes from {who}, "
                                  f"expected {e - s}")
    return buf


def receive_blobs(comm: MPI.Comm, store, held: set[int], move: P.KVMove, policy: str,
                  timeout: float | None) -> dict:
    """KV_IMPORT: each blob in turn, into the store as it lands -> the JSON answer."""
    stored, refused = [], []
    for sid, size in zip(move.seq_ids.tolist(), move.sizes.tolist()):
        blob = receive_blob(comm, 0, size, move.chunk, policy, timeout, S_NAME)
        ok, why = import_one(store, sid, blob, held)      # the store reads any contiguous buffer
        stored.append(ok)
        if why:
            refused.append([sid, why])
    return {"stored": stored, "refused": refused}
