"""The S-worker's side of moving sequences' KV-caches as blobs over MPI (KV_EXPORT / KV_IMPORT,
rworker.protocol.control; the R-worker's side is rworker.kv_transfer). Every wait has the
backend's timeout, so a silent rank is named, never waited on for ever.

    export: per sequence int64[1] size (-1: not held) <- R, then its uint8 chunks <- R
    import: per sequence its uint8 chunks -> R (sizes in the control message), then JSON <- R
"""
from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI

from fastdecode.rpart.base import KVImportError
from rworker.host.wait import wait_all, wait_message
from rworker.kv_transfer import receive_blob
from rworker.protocol import control as P


def receive_exports(comm: MPI.Comm, rank: int, who: str, seq_ids: list[int], chunk: int, policy: str,
                    timeout: float | None) -> tuple[dict[int, bytes], list[int]]:
    """After a KV_EXPORT to `rank`: {seq id: blob} of those it holds, and the ids it does not
    (every answer is read, so none stays queued for a later message)."""
    blobs, missing = {}, []
    size = np.zeros(1, dtype=np.int64)                                            # [1]
    for sid in seq_ids:
        wait_message(comm, rank, P.TAG_KVBLOB, policy, timeout, who=who)
        comm.Recv([size, MPI.INT64_T], source=rank, tag=P.TAG_KVBLOB)
        if size[0] < 0:
            missing.append(sid)
            continue
        blobs[sid] = receive_blob(comm, rank, int(size[0]), chunk, policy, timeout, who).tobytes()
    return blobs, missing


def send_imports(comm: MPI.Comm, rank: int, who: str, blobs: list[bytes], chunk: int, policy: str,
                 timeout: float | None) -> None:
    """After a KV_IMPORT to `rank`: every blob in its chunks, in order."""
    reqs = []
    for blob in blobs:
        view = np.frombuffer(blob, dtype=np.uint8)                                # [size]
        reqs += [comm.Isend([view[s:e], MPI.BYTE], dest=rank, tag=P.TAG_KVBLOB)
                 for s, e in P.blob_chunks(view.size, chunk)]
    wait_all(reqs, policy, timeout, who=who)


def receive_answer(comm: MPI.Comm, rank: int, who: str, policy: str, timeout: float | None) -> dict:
    """The worker's JSON answer to a KV_IMPORT (TAG_INFO)."""
    status = wait_message(comm, rank, P.TAG_INFO, policy, timeout, who=who)
    buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
    comm.Recv([buf, MPI.BYTE], source=rank, tag=P.TAG_INFO)
    return json.loads(buf.tobytes())


def check_answer(answer: dict, rank: int, who: str, seq_ids: list[int]) -> list[bool]:
    """A KV_IMPORT's answer -> per sequence stored; KVImportError naming the worker and the first
    sequence whose blob it refused."""
    stored = [bool(x) for x in answer.get("stored", ())]
    if len(stored) != len(seq_ids):
        raise P.ProtocolError(f"protocol error: {who} answered a KV_IMPORT of {len(seq_ids)} sequences with "
                              f"{len(stored)} results")
    refused = answer.get("refused") or []
    if refused:
        raise KVImportError.of(rank, who, refused, stored)
    return stored
