"""Under `mpiexec -n 3`: rank 0 drives an MPIBackend over two real R-workers and prints, as JSON,
what moving sequences' KV between them gave (tests/test_kv_transfer_mpi.py checks it).

Worker 0 (rank 1) has room for everything, worker 1 (rank 2) for one short sequence only. Rank 0
prefills sequences 1 (5 tokens) and 2 (70 tokens) on worker 0, decodes a step, exports both, and
imports them into worker 1 as 101 and 102 (102 does not fit there); then decodes 1 on worker 0
and 101 on worker 1 with the same rows (their outputs must be equal), gives worker 1 a corrupted
blob, asks worker 1 for a sequence it does not hold, and frees and re-imports 101. Blobs travel in
chunks of 1000 bytes (several messages each).

`kv_move.py hang` (with FASTDECODE_INJECT_FAULT=2:kv_import:hang): worker 1 stops answering at
the import; rank 0, with a 3 s timeout, prints the error naming it and aborts the job."""
import json
import sys

import numpy as np
import torch
from mpi4py import MPI

from fastdecode.model.config import ModelConfig
from fastdecode.rpart.base import KVImportError
from fastdecode.rpart.mpi import MPIBackend
from rworker.host.wait import PeerTimeout, abort_job, node_layout
from rworker.worker import run

LAYERS, HQ, HKV, D = 2, 4, 2, 16
PAGE = 32 * D * 4 * 2                          # one page: 32 tokens of one (layer, kv head), K and V, fp32
CAPACITY = {1: 16 << 20, 2: 10 * PAGE}          # worker 1: a 6-token sequence (4 pages), not a 71-token one (12)
comm = MPI.COMM_WORLD
if comm.Get_rank() != 0:
    sys.exit(run(comm, threads=1, capacity_bytes=CAPACITY[comm.Get_rank()], timeout=20))

node_layout(comm)
config = ModelConfig("llama", LAYERS, HQ * D, HQ, HKV, D, 64, 100, 1e-5, 10000.0, 4096, False)
b = MPIBackend(comm, config, "fp32", D ** -0.5, r_threads=1, policy="sleep", timeout=20)
b.blob_chunk = 1000
rng = np.random.default_rng(0)
rand = lambda *shape: torch.from_numpy(rng.standard_normal(shape).astype(np.float32))   # noqa: E731
result = {"layouts": [x.hex() if x else None for x in b.kv_layouts()]}


def prefill(seqs: dict[int, int], counts: list[int]) -> None:
    rows = np.concatenate([np.full(n, s, np.int64) for s, n in seqs.items()])          # [tokens]
    b.prefill_begin(rows, counts)
    for layer in range(LAYERS):
        b.prefill_layer(layer, rand(len(rows), HKV, D), rand(len(rows), HKV, D))
    b.prefill_end()


def decode(ids: list[int], counts: list[int], same_rows: bool = False) -> list[np.ndarray]:
    """One step -> per layer O [n, Hq, D]; same_rows: every row gets the first row's q, k, v."""
    n = len(ids)
    b.decode_begin([(np.array(ids, np.int64), counts)], LAYERS)
    outs = []
    for layer in range(LAYERS):
        q, k, v = rand(n, HQ, D), rand(n, HKV, D), rand(n, HKV, D)
        if same_rows:
            q, k, v = (x[:1].expand_as(x).contiguous() for x in (q, k, v))
        at, parts = 0, []
        for c in counts:                         # the wire layout: per worker [q | k | v] of its rows
            parts += [x[at:at + c].reshape(-1) for x in (q, k, v)]
            at += c
        packed = torch.cat(parts)
        buf = b.decode_buffer(layer, 0, packed.numel(), torch.device("cpu"), torch.float32)
        buf.copy_(packed)
        b.decode_submit(layer, 0, buf)
        outs.append(b.decode_wait(layer, 0).numpy().copy())
    b.decode_end()
    return outs


prefill({1: 5, 2: 70}, [75, 0])
decode([1, 2], [2, 0])
blobs = b.export_kv([[1, 2], []])[0]
if sys.argv[1:] == ["hang"]:
    b.timeout = 3.0
    try:
        b.import_kv(1, [101], [blobs[1]])
    except PeerTimeout as e:
        print(json.dumps({"timeout": str(e)}), flush=True)
    abort_job(comm, 3)                           # worker 1 hangs: only an abort ends the job
result["blob_bytes"] = {str(s): len(x) for s, x in blobs.items()}
result["stored"] = b.import_kv(1, [101, 102], [blobs[1], blobs[2]])
result["equal"] = []
for _ in range(3):                               # the original on worker 0, its copy on worker 1
    outs = decode([1, 101], [1, 1], same_rows=True)
    result["equal"].append(all(np.array_equal(o[0], o[1]) for o in outs))
bad = bytearray(blobs[1])
bad[:16] = bytes(16)
try:
    b.import_kv(1, [103], [bytes(bad)])
except KVImportError as e:
    result["corrupt"] = {"text": str(e), "rank": e.rank, "seq": e.seq_id, "stored": e.stored}
try:
    b.export_kv([[], [999]])
except KeyError as e:
    result["missing"] = str(e)
b.free([[], [101]])
result["reimported"] = b.import_kv(1, [101], [blobs[1]])
decode([1, 101], [1, 1])
b.close()
print(json.dumps(result), flush=True)
