"""The same-node decode link (rworker/host/shm_link.py): both ends in one process, no MPI job."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from rworker.host.shm_link import LAYER_BITS, ShmLink, enabled, tick
from rworker.host.wait import PeerTimeout
from rworker.protocol import control as P

IN_ROW, OUT_ROW = 15 * 8, 9 * 8         # (Hq + 2 Hkv) D and Hq D of a 9/3-head model with D = 8


@pytest.fixture
def pair():
    s = ShmLink.create(rows=16, slots=2, in_row=IN_ROW, out_row=OUT_ROW, itemsize=2)
    r = ShmLink.attach(s.directory, s.nonce, IN_ROW, OUT_ROW)
    yield s, r
    s.unlink()
    s.close()
    r.close()


def test_both_ends_map_the_same_rows_and_the_answer_confirms_it(pair):
    s, r = pair
    assert s.confirmed()
    rows = np.frombuffer(s.qkv_buffer(1), dtype=np.uint16, count=3 * IN_ROW)
    rows[:] = np.arange(rows.size) % 65521
    seen = np.frombuffer(r.qkv_buffer(1), dtype=np.uint16, count=3 * IN_ROW)
    assert np.array_equal(seen, rows)
    for parity in (0, 1):                     # outputs: their own memory per slot and parity
        np.frombuffer(r.out_buffer(1, parity), dtype=np.uint16, count=OUT_ROW)[:] = 7 + parity
    assert not np.frombuffer(s.qkv_buffer(1), dtype=np.uint16, count=16 * IN_ROW)[3 * IN_ROW:].any()
    for parity in (0, 1):
        assert (np.frombuffer(s.out_buffer(1, parity), dtype=np.uint16, count=OUT_ROW) == 7 + parity).all()
    assert not np.frombuffer(s.out_buffer(0, 0), dtype=np.uint16, count=16 * OUT_ROW).any()


def test_a_ring_wakes_the_waiting_end_with_that_layer(pair):
    s, r = pair
    woke = []

    def r_side():
        for layer in range(3):
            r.wait(0, tick(5, layer), timeout=10, who="rank 0 (S-worker)")
            woke.append(layer)
            r.ring(0, tick(5, layer))

    t = threading.Thread(target=r_side)
    t.start()
    for layer in range(3):
        time.sleep(0.01)
        assert woke == list(range(layer))       # it waits for the ring, not past it
        s.ring(0, tick(5, layer))
        s.wait(0, tick(5, layer), timeout=10, who="rank 1 (R-worker)")
    t.join(10)
    assert woke == [0, 1, 2]
    assert tick(6, 0) > tick(5, (1 << LAYER_BITS) - 2)     # a later step outranks every layer of this one


def test_a_silent_peer_is_named_after_the_timeout(pair):
    s, _ = pair
    start = time.perf_counter()
    with pytest.raises(PeerTimeout, match=r"no reply from rank 1 \(R-worker\) within 0 s"):
        s.wait(0, tick(1, 0), timeout=0.2, who="rank 1 (R-worker)")
    assert 0.2 <= time.perf_counter() - start < 5


def test_rings_nobody_reads_never_block_the_ringer(pair):
    s, r = pair
    for i in range(100_000):                  # more wake-ups than a FIFO holds
        s.ring(1, i + 1)
    r.wait(1, 100_000, timeout=1, who="S")    # the latest value is there
    with pytest.raises(BlockingIOError):      # and the stale wake-ups were drained with it
        os.read(r._rd, 1)


def test_a_link_of_another_job_or_shape_is_refused(pair):
    s, _ = pair
    with pytest.raises(OSError, match="not this job's link"):
        ShmLink.attach(s.directory, s.nonce + 2, IN_ROW, OUT_ROW)
    with pytest.raises(OSError, match="rows of 120/72 elements, this worker's are 120/64"):
        ShmLink.attach(s.directory, s.nonce, IN_ROW, 64)
    with pytest.raises(FileNotFoundError):
        ShmLink.attach(s.directory + "-gone", s.nonce, IN_ROW, OUT_ROW)


def test_unlink_leaves_nothing_behind_and_the_ends_still_talk(pair):
    s, r = pair
    s.unlink()
    assert not os.path.exists(s.directory)
    s.ring(0, 3)
    r.wait(0, 3, timeout=1, who="S")


def test_fits_bounds_rows_and_slots(pair):
    s, _ = pair
    assert s.fits(0, 16) and s.fits(1, 1)
    assert not s.fits(0, 17) and not s.fits(2, 4) and not s.fits(0, 0)


def test_too_large_a_link_is_not_made():
    with pytest.raises(OSError, match="larger than"):
        ShmLink.create(rows=1 << 20, slots=2, in_row=4096, out_row=4096, itemsize=2)


def test_the_switch():
    assert enabled({}) and enabled({"FASTDECODE_SHM_LINK": "1"})
    assert not enabled({"FASTDECODE_SHM_LINK": "0"})


def test_link_message_round_trip():
    for path in ("/dev/shm/fastdecode-link-x", "/tmp/fastdecode-link-abcdefgh", "/tmp/é"):
        kind, _, hdr, body = P.parse(P.link_message(path, 12345))
        assert kind == P.LINK and P.parse_link(hdr, body) == (path, 12345)
    msg = P.link_message("/tmp/abc", 1)
    msg[5] = 40                               # header word b: claims a longer path than its body holds
    kind, _, hdr, body = P.parse(msg)
    with pytest.raises(P.ProtocolError, match="LINK with a path of 40 bytes in 1 words"):
        P.parse_link(hdr, body)
