"""A sequence's KV moved as a blob is the sequence: exported from one store and imported into the
same or another (local mode's in-process store, or an R-worker over MPI), its next decode steps
give bitwise the outputs the original gives; a blob that does not fit is refused with False, a
corrupted one with an error naming the worker, a silent worker with an error naming its rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import MPIEXEC, REPO

from fastdecode.model.config import ModelConfig
from fastdecode.rpart.base import KVImportError
from fastdecode.rpart.local import LocalBackend

LAYERS, HQ, HKV, D = 2, 4, 2, 16
SCRIPT = os.path.join(REPO, "tests", "mpi_scripts", "kv_move.py")
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def local(hkv: int = HKV, capacity: int = 1 << 24) -> LocalBackend:
    c = ModelConfig("llama", LAYERS, HQ * D, HQ, hkv, D, 64, 100, 1e-5, 10000.0, 4096, False)
    return LocalBackend(c, "fp32", threads=1, capacity_bytes=capacity)


def rand(rng, *shape) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def prefill(b: LocalBackend, seqs: dict[int, int], rng) -> None:
    rows = np.concatenate([np.full(n, s, np.int64) for s, n in seqs.items()])           # [tokens]
    b.prefill_begin(rows, [len(rows)])
    for layer in range(LAYERS):
        b.prefill_layer(layer, rand(rng, len(rows), HKV, D), rand(rng, len(rows), HKV, D))
    b.prefill_end()


def decode(backends: list[LocalBackend], ids: list[int], rng) -> list[list[torch.Tensor]]:
    """One step of the same rows on every backend -> per backend, per layer O [n, Hq, D]."""
    n, outs = len(ids), [[] for _ in backends]
    for b in backends:
        b.decode_begin([(np.array(ids, np.int64), [n])], LAYERS)
    for layer in range(LAYERS):
        packed = torch.cat([rand(rng, n, h, D).reshape(-1) for h in (HQ, HKV, HKV)])    # [q | k | v]
        for b, out in zip(backends, outs):
            b.decode_submit(layer, 0, packed.clone())
            out.append(b.decode_wait(layer, 0))
    for b in backends:
        b.decode_end()
    return outs


def same(outs: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))


def test_a_sequence_moved_between_local_stores_decodes_bitwise_alike():
    rng = np.random.default_rng(0)
    a, b = local(), local()
    assert a.kv_layouts() == b.kv_layouts() and a.kv_layouts()[0] is not None
    prefill(a, {1: 40, 2: 7, 3: 70}, rng)
    decode([a], [1, 2, 3], rng)
    blobs = a.export_kv([[1, 2, 3]])[0]
    assert sorted(blobs) == [1, 2, 3] and all(isinstance(x, bytes) for x in blobs.values())
    assert b.import_kv(0, [1, 2, 3], [blobs[1], blobs[2], blobs[3]]) == [True, True, True]
    for _ in range(3):                          # across a page boundary for sequence 3 (70 -> 74 tokens)
        assert same(decode([a, b], [1, 2, 3], rng))
    a.free([[2]])                               # back into the same store, after a free
    assert a.import_kv(0, [2], [b.export_kv([[2]])[0][2]]) == [True]
    assert same(decode([a, b], [3, 2], rng))
    b.free([[1, 2, 3]])
    assert b.store.num_seqs() == 0


def test_an_import_past_capacity_is_false_and_stores_nothing_of_it():
    rng = np.random.default_rng(1)
    a = local()
    prefill(a, {1: 5, 2: 200}, rng)
    blobs = a.export_kv([[1, 2]])[0]
    page = a.store.page_bytes
    small = local(capacity=3 * LAYERS * HKV * page)     # 3 pages per (layer, head): 96 tokens
    assert small.import_kv(0, [2, 1], [blobs[2], blobs[1]]) == [False, True]
    assert small.store.num_seqs() == 1
    assert same(decode([a, small], [1], rng))


def test_a_refused_blob_names_the_store_and_the_sequence_after_trying_every_blob():
    rng = np.random.default_rng(2)
    a = local()
    prefill(a, {1: 5, 2: 9}, rng)
    blobs = a.export_kv([[1, 2]])[0]
    bad = bytearray(blobs[1])
    bad[:16] = bytes(16)
    b = local()
    with pytest.raises(KVImportError, match="in-process store \\(rank 0\\) refused the KV blob of sequence 7") as e:
        b.import_kv(0, [7, 2], [bytes(bad), blobs[2]])
    assert e.value.stored == [False, True] and b.store.num_seqs() == 1
    with pytest.raises(KVImportError, match="sequence 2"):                  # an id it holds
        b.import_kv(0, [2], [blobs[2]])
    other = local(hkv=1)                                                    # another geometry
    assert other.kv_layouts() != a.kv_layouts()
    with pytest.raises(KVImportError, match="sequence 1"):
        other.import_kv(0, [1], [blobs[1]])
    with pytest.raises(KeyError):
        a.export_kv([[5]])


def _mpi(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run([MPIEXEC, "-n", "3", sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=120, env={**ENV, **(env or {})})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, json.loads(lines[-1]) if lines else None


def test_kv_moves_between_r_workers_over_mpi():
    proc, r = _mpi()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert r["layouts"][0] is not None and r["layouts"][0] == r["layouts"][1]
    assert r["blob_bytes"]["2"] > 10 * 1000                 # in several chunks of 1000 bytes
    assert r["stored"] == [True, False]                     # 102 does not fit worker 1
    assert r["equal"] == [True, True, True]                 # sequence 1 on worker 0, its copy 101 on worker 1
    assert r["corrupt"]["rank"] == 2 and r["corrupt"]["seq"] == 103 and r["corrupt"]["stored"] == [False]
    assert r["corrupt"]["text"].startswith("rank 2 (R-worker on ")
    assert "refused the KV blob of sequence 103" in r["corrupt"]["text"]
    assert "sequence 999 on rank 2" in r["missing"]
    assert r["reimported"] == [True]                        # after FREE, the id comes back


def test_a_worker_silent_at_an_import_is_named_not_waited_on():
    proc, r = _mpi("hang", env={"FASTDECODE_INJECT_FAULT": "2:kv_import:hang"})
    assert proc.returncode != 0
    assert r is not None and r["timeout"].startswith("no message from rank 2 (R-worker on "), proc.stderr[-3000:]
