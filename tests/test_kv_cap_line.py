"""The start-up line's host KV figure reads as what it is: a cap the store fills page by page
(not memory taken at start-up), with what set it (--rworker-mem, or the memory available)."""
from __future__ import annotations

from types import SimpleNamespace

from fastdecode.engine.rpart_setup import log_tiers
from fastdecode.rpart.base import WorkerInfo

GIB = 1 << 30


def engine(rworker_mem=None, layout=None, n_workers=1):
    workers = [WorkerInfo(rank=i, host="h", threads=2, isa="avx2", capacity_bytes=int(19.4 * GIB) // n_workers)
               for i in range(n_workers)]
    return SimpleNamespace(backend=SimpleNamespace(workers=workers), layout=layout, tier_index=None,
                           tier=SimpleNamespace(why_off="local mode: the in-process store is the whole R-part"),
                           kv_dtype="fp16", args=SimpleNamespace(rworker_mem=rworker_mem))


def line(capsys, eng) -> str:
    log_tiers(eng)
    return capsys.readouterr().err.strip()


def test_local_mode_says_the_host_store_is_a_cap_of_available_memory(capsys):
    text = line(capsys, engine())
    assert text.startswith("fastdecode: KV tiers: 1 host store up to 19.4 GiB; no S-worker tier")
    assert "The host store's figure is a cap, not an allocation: pages are taken as sequences grow" in text
    assert "the memory available at start-up less a reserve (10%, at least 1 GiB) (--rworker-mem sets it)" in text
    assert "\n" not in text                                   # still one line


def test_rworker_mem_named_as_the_cap(capsys):
    text = line(capsys, engine(rworker_mem=8 * GIB, layout=(2,), n_workers=2))
    assert "2 R-workers up to 19.4 GiB" in text
    assert "The R-workers' figure is a cap, not an allocation" in text
    assert "up to --rworker-mem, 8.0 GiB a store" in text and "available" not in text


def test_r_workers_share_their_node(capsys):
    text = line(capsys, engine(layout=(2,), n_workers=2))
    assert "shared among the KV holders of a node" in text
