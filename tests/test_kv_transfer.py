"""Moving sequences' KV-caches as blobs (RBackend.kv_layouts / export_kv / import_kv): the
KV_EXPORT / KV_IMPORT messages round-trip and refuse bad input, blobs split into chunks MPI can
count, and each backend routes a worker index to the side that holds it or refuses it."""
from __future__ import annotations

import numpy as np
import pytest

from fastdecode.rpart.base import KVImportError, RBackend, WorkerInfo
from fastdecode.rpart.sharded_tier import ShardedTier
from fastdecode.rpart.tiered import TieredBackend
from rworker.kv_blobs import import_one
from rworker.protocol import control as P

# ---------------------------------------------------------------- messages


def test_kv_export_round_trips():
    kind, step, hdr, body = P.parse(P.kv_export_message(7, [5, 3, 9], chunk=1000))
    assert (kind, step) == (P.KV_EXPORT, 7)
    move = P.parse_kv_move(kind, hdr, body)
    assert move.seq_ids.tolist() == [5, 3, 9] and move.sizes.size == 0 and move.chunk == 1000


def test_kv_import_round_trips_with_sizes_past_an_mpi_count():
    sizes = [3 << 31, 0, 17]
    kind, _, hdr, body = P.parse(P.kv_import_message(2, [1, 2, 3], sizes))
    move = P.parse_kv_move(kind, hdr, body)
    assert kind == P.KV_IMPORT and move.seq_ids.tolist() == [1, 2, 3] and move.sizes.tolist() == sizes
    assert move.chunk == P.MAX_BLOB_CHUNK


def test_the_new_kinds_have_names():
    assert P.KIND_NAMES[P.KV_EXPORT] == "KV_EXPORT" and P.KIND_NAMES[P.KV_IMPORT] == "KV_IMPORT"
    assert P.KIND_NAMES[P.LINK] == "LINK"
    assert len(set(P.KIND_NAMES.values())) == len(P.KIND_NAMES) == 11


CHUNK_WORD, IDS, SIZES = 5, P.HEADER_WORDS, P.HEADER_WORDS + 3     # of kv_import_message(1, [1, 2, 3], ...)


def _with(i: int, value: int):
    def mutate(m: np.ndarray) -> np.ndarray:
        m[i] = value
        return m
    return mutate


@pytest.mark.parametrize("mutate,needle", [
    (lambda m: np.concatenate([m, [4]]), "body has"),            # a word more than announced
    (lambda m: m[:-1], "body has"),                              # a word less
    (_with(CHUNK_WORD, 0), "chunks of 0 bytes"),
    (_with(CHUNK_WORD, P.MAX_BLOB_CHUNK + 1), "chunks of"),
    (_with(IDS + 2, 1), "twice"),                                # ids [1, 2, 1]
    (_with(SIZES, -5), "-5 bytes"),
    (_with(IDS, -1), "outside"),
])
def test_a_bad_kv_import_is_refused_naming_what(mutate, needle):
    msg = mutate(P.kv_import_message(1, [1, 2, 3], [10, 20, 30]).copy())
    kind, _, hdr, body = P.parse(msg)
    with pytest.raises(P.ProtocolError, match=needle):
        P.parse_kv_move(kind, hdr, body)


def test_a_kv_export_announcing_more_ids_than_it_has_is_refused():
    kind, _, hdr, body = P.parse(P.kv_export_message(1, [4, 5]))
    with pytest.raises(P.ProtocolError, match="KV_EXPORT announces 2"):
        P.parse_kv_move(kind, hdr, body[:1])


def test_a_kv_import_needs_one_size_per_sequence():
    with pytest.raises(ValueError, match="2 blob sizes for 3"):
        P.kv_import_message(1, [1, 2, 3], [10, 20])


@pytest.mark.parametrize("size,chunk,want", [
    (0, 10, []), (10, 10, [(0, 10)]), (25, 10, [(0, 10), (10, 20), (20, 25)]),
    ((1 << 32) + 5, P.MAX_BLOB_CHUNK, [(0, P.MAX_BLOB_CHUNK), (P.MAX_BLOB_CHUNK, 2 * P.MAX_BLOB_CHUNK),
                                       (2 * P.MAX_BLOB_CHUNK, (1 << 32) + 5)]),
])
def test_blob_chunks_cover_the_blob_each_within_an_mpi_count(size, chunk, want):
    got = P.blob_chunks(size, chunk)
    assert got == want
    assert all(0 < e - s <= P.MAX_BLOB_CHUNK for s, e in got)


@pytest.mark.parametrize("size,chunk", [(-1, 10), (10, 0), (10, P.MAX_BLOB_CHUNK + 1)])
def test_blob_chunks_refuse_a_negative_size_or_a_chunk_mpi_cannot_count(size, chunk):
    with pytest.raises(ValueError):
        P.blob_chunks(size, chunk)

# ---------------------------------------------------------------- one blob into a store


class FakeStore:
    """export_seq / import_seq as kvstore's API says, on a dict (capacity: blobs held at most)."""

    def __init__(self, capacity: int = 10, signature: bytes = b"geo"):
        self.seqs: dict[int, bytes] = {}
        self.capacity, self.signature = capacity, signature

    def layout_signature(self) -> bytes:
        return self.signature

    def export_seq(self, sid: int) -> bytes:
        return self.signature + self.seqs[sid]

    def import_seq(self, sid: int, blob: bytes) -> bool:
        if not blob.startswith(self.signature) or sid in self.seqs:
            raise ValueError(f"not a blob of this geometry, or sequence {sid} held")
        if len(self.seqs) >= self.capacity:
            return False
        self.seqs[sid] = blob[len(self.signature):]
        return True

    def free(self, sid: int) -> None:
        del self.seqs[sid]


def test_import_one_tracks_what_the_worker_holds():
    store, held = FakeStore(capacity=1), {7}
    assert import_one(store, 7, b"geoX", held) == (False, "sequence 7 is already held here")
    assert import_one(store, 1, b"geoX", held) == (True, "") and held == {1, 7}
    assert import_one(store, 2, b"geoY", held) == (False, "")             # past capacity: no reason
    stored, why = import_one(store, 3, b"junk", held)
    assert not stored and "geometry" in why and held == {1, 7}

# ---------------------------------------------------------------- routing by worker index


class FakeBackend(RBackend):
    """Workers holding FakeStores (layout b"geo"), or none that can move KV (layout None)."""

    def __init__(self, n: int, movable: bool = True, tier: str = ""):
        self.workers = [WorkerInfo(rank=i + 1, host="h", threads=1, isa="x", capacity_bytes=1 << 30, tier=tier,
                                   kv_layout=b"geo".hex() if movable else "") for i in range(n)]
        self.stores = [FakeStore() for _ in range(n)]
        self.movable = movable

    def export_kv(self, seq_ids_by_worker):
        if not self.movable:
            return super().export_kv(seq_ids_by_worker)
        return [{s: st.export_seq(s) for s in ids} for st, ids in zip(self.stores, seq_ids_by_worker)]

    def import_kv(self, worker, seq_ids, blobs):
        if not self.movable:
            return super().import_kv(worker, seq_ids, blobs)
        return [import_one(self.stores[worker], s, b)[0] for s, b in zip(seq_ids, blobs)]


def test_a_tiered_backend_routes_by_worker_index_and_its_device_tier_refuses():
    others, tier = FakeBackend(2), FakeBackend(1, movable=False, tier="device (cuda:0)")
    b = TieredBackend(others, tier)
    assert b.kv_layouts() == [b"geo", b"geo", None]
    assert b.import_kv(1, [4, 5], [b"geoA", b"geoB"]) == [True, True]
    assert others.stores[1].seqs == {4: b"A", 5: b"B"} and not others.stores[0].seqs
    assert b.export_kv([[], [5], []]) == [{}, {5: b"geoB"}, {}]
    with pytest.raises(ValueError, match="worker 0 \\(device \\(cuda:0\\)\\) cannot import"):
        b.import_kv(2, [6], [b"geoC"])
    with pytest.raises(ValueError, match="cannot export"):
        b.export_kv([[], [], [5]])
    assert b.import_kv(2, [], []) == []                    # nothing asked of it: nothing refused
    with pytest.raises(ValueError, match="2 lists of sequences for 3 workers"):
        b.export_kv([[], []])


def test_a_sharded_tier_neither_exports_nor_imports():
    inner = FakeBackend(1)
    sharded = ShardedTier(inner, ranks=2)
    assert inner.kv_layouts() == [b"geo"] and sharded.kv_layouts() == [None]
    with pytest.raises(ValueError, match="cannot import"):
        sharded.import_kv(0, [1], [b"geoA"])
    assert sharded.export_kv([[]]) == [{}]


def test_an_import_error_names_the_rank_and_the_first_refused_sequence():
    e = KVImportError.of(2, "rank 2 (R-worker on h)", [[9, "bad blob"], [11, "bad too"]], [True, False, False])
    assert isinstance(e, ValueError) and (e.rank, e.seq_id, e.stored) == (2, 9, [True, False, False])
    assert str(e) == "rank 2 (R-worker on h) refused the KV blob of sequence 9: bad blob (and 1 more sequences' blobs)"
