"""OUTPUT.inflight.kv (batch/inflight_kv.py): the KV a stop saves beside OUTPUT.inflight, bound to
it, every field and every sequence's bytes checked before the rerun trusts them (the reload end to
end: test_kv_reload.py)."""
from __future__ import annotations

import json
import struct

import pytest

from fastdecode.batch import inflight_kv
from fastdecode.batch.inflight_read import Untrusted


def items():
    return [inflight_kv.Item(b"\x01" * 16, 0, 0, 40, b"layout-a", bytes(range(200))),
            inflight_kv.Item(b"\x02" * 16, 1, 3, 7, b"layout-a", b"\xff" * 33)]


def test_saved_kv_reads_back_bound_to_its_inflight_file(tmp_path):
    path = str(tmp_path / "out.jsonl.inflight.kv")
    nbytes = inflight_kv.save(path, str(tmp_path / "out.jsonl"), "ab" * 32, items())
    assert nbytes == (tmp_path / "out.jsonl.inflight.kv").stat().st_size
    saved = inflight_kv.SavedKV(path, "ab" * 32)
    rec = saved.take(b"\x02" * 16, 1, 3)
    assert rec.tokens == 7 and bytes(rec.blob()) == b"\xff" * 33
    assert rec.refusal(7, b"layout-a") is None
    assert "layout differs" in rec.refusal(7, b"layout-b")
    assert "covers 7 tokens, the sequence 8" in rec.refusal(8, b"layout-a")
    assert "own tier" in rec.refusal(7, None)
    assert saved.take(b"\x02" * 16, 1, 3) is None          # taken once
    assert bytes(saved.take(b"\x01" * 16, 0, 0).blob()) == bytes(range(200))


def test_kv_of_another_inflight_file_is_ignored_and_named(tmp_path, capfd):
    path = str(tmp_path / "o.inflight.kv")
    inflight_kv.save(path, str(tmp_path / "o"), "ab" * 32, items())
    assert inflight_kv.SavedKV(path, "cd" * 32).records == {}
    assert "saved with another OUTPUT.inflight" in capfd.readouterr().err


@pytest.mark.parametrize("damage", ["blob-byte", "index-json", "index-length", "entry-past-end", "magic"])
def test_damaged_kv_is_refused_where_it_is_found(tmp_path, capfd, damage):
    path = tmp_path / "o.inflight.kv"
    inflight_kv.save(str(path), str(tmp_path / "o"), "ab" * 32, items())
    raw = bytearray(path.read_bytes())
    head = len(inflight_kv.MAGIC)
    (n,) = struct.unpack("<Q", raw[head:head + 8])
    if damage == "blob-byte":
        raw[-1] ^= 1                                       # the second sequence's last byte
    elif damage == "index-json":
        raw[head + 8] = ord("]")
    elif damage == "index-length":
        raw[head:head + 8] = struct.pack("<Q", len(raw))
    elif damage == "entry-past-end":
        index = json.loads(raw[head + 8:head + 8 + n])
        index["sequences"][0]["length"] = 10 ** 9
        body = json.dumps(index).encode()
        raw = raw[:head] + struct.pack("<Q", len(body)) + body + raw[head + 8 + n:]
    else:
        raw[0] ^= 1
    path.write_bytes(bytes(raw))
    saved = inflight_kv.SavedKV(str(path), "ab" * 32)
    if damage == "blob-byte":                              # found when the sequence's bytes are taken
        assert bytes(saved.take(b"\x01" * 16, 0, 0).blob()) == bytes(range(200))
        with pytest.raises(Untrusted, match="checksum"):
            saved.take(b"\x02" * 16, 1, 3).blob()
    else:
        assert saved.records == {}
        assert "ignored, not trusted" in capfd.readouterr().err


def test_room_for_says_why_kv_is_not_saved(tmp_path):
    path = str(tmp_path / "o.inflight.kv")
    assert inflight_kv.room_for(path, 1 << 20, "auto") is None
    assert inflight_kv.room_for(path, 1 << 20, "never") == "--save-kv-on-stop never"
    assert "GiB free beside the output" in inflight_kv.room_for(path, 1 << 62, "always")
    assert "auto saves up to half" in inflight_kv.room_for(path, 1 << 62, "auto")
