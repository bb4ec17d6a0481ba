"""The decode hand-off between the S-worker and an R-worker on the same node: shared rows and a doorbell.

Between two ranks of one node MPI moves a decode message through its shared-memory transport in a
rendezvous: request, clear-to-send, data, each step seen only when the other rank's progress
thread polls. Those threads wake every 20-500 us and take cores that the compute on the other
side of the hand-off needs, and a decode step crosses twice per layer. A link skips all of it:

  1. the S-worker writes a mini-batch's q|k|v rows (the wire layout of one worker) into memory
     both ranks map, sets that slot's tick to (step, layer) and writes one byte to a FIFO;
  2. the R-worker, blocked in poll() on the FIFO, wakes, attends from the shared rows into the
     slot's shared output and answers the same way on the other FIFO.
No copy through MPI, no polling thread, no spinning rank. Control messages, prefill K/V and
everything else stay on MPI. A mini-batch whose rows do not fit a slot goes over MPI as before;
both sides apply the same rule (fits) to the counts the DECODE message gave them.

The mapped file: an int64 header [MAGIC, nonce, attached, rows, slots, in_row, out_row, itemsize],
the ticks qkv[slots] and out[slots], then per slot in [rows * in_row] and out [2][rows * out_row]
elements of `itemsize` bytes (out by layer parity). The S-worker creates it and the FIFOs in a
private directory (/dev/shm where there is one), the R-worker attaches and answers the nonce in
the header (which proves the two map the same memory, not two files of one name on two nodes),
and the S-worker unlinks all three at once: nothing is left behind even if the job is killed.
"""
from __future__ import annotations

import mmap
import os
import secrets
import select
import shutil
import tempfile
import time

import numpy as np

from rworker.host.wait import PeerTimeout

MAGIC = 0x4644_4C49_4E4B        # "FDLINK"
HEADER_WORDS = 8
LAYER_BITS = 20                 # tick = step << LAYER_BITS | (layer + 1)
POLL_SLICE_MS = 50              # a waiting side looks at its timeout this often
LINK_MAX_BYTES = 256 << 20      # a link larger than this is not made (MPI carries the rows)


def tick(step: int, layer: int) -> int:
    return (int(step) << LAYER_BITS) | (int(layer) + 1)


def enabled(environ: dict | None = None) -> bool:
    """FASTDECODE_SHM_LINK=0 keeps every hand-off on MPI."""
    return (environ if environ is not None else os.environ).get("FASTDECODE_SHM_LINK", "1") != "0"


class ShmLink:
    """One S-worker <-> R-worker link. `side` is "s" or "r": which FIFO this end reads."""

    def __init__(self, directory: str, side: str, fd_buf: int, nonce: int):
        self.directory, self.side, self.nonce = directory, side, nonce
        self._map = mmap.mmap(fd_buf, 0)
        os.close(fd_buf)
        head = np.frombuffer(self._map, dtype=np.int64, count=HEADER_WORDS)
        self.header = head
        self.rows, self.slots, self.in_row, self.out_row, self.itemsize = (int(x) for x in head[3:8])
        self.ticks = np.frombuffer(self._map, dtype=np.int64, count=2 * self.slots, offset=HEADER_WORDS * 8)
        self._base = (HEADER_WORDS + 2 * self.slots) * 8
        self._slot_bytes = self.rows * (self.in_row + 2 * self.out_row) * self.itemsize
        mine, theirs = ("to_s", "to_r") if side == "s" else ("to_r", "to_s")
        self._rd = os.open(os.path.join(directory, mine), os.O_RDWR | os.O_NONBLOCK)
        self._wr = os.open(os.path.join(directory, theirs), os.O_RDWR | os.O_NONBLOCK)
        self._poll = select.poll()
        self._poll.register(self._rd, select.POLLIN)

    # ------------------------------------------------------------------ making and joining

    @classmethod
    def create(cls, rows: int, slots: int, in_row: int, out_row: int, itemsize: int) -> "ShmLink":
        """The S-worker's end: a fresh file and FIFOs. OSError where the memory cannot be had."""
        size = (HEADER_WORDS + 2 * slots) * 8 + slots * rows * (in_row + 2 * out_row) * itemsize
        if size > LINK_MAX_BYTES:
            raise OSError(f"a link of {size >> 20} MiB is larger than {LINK_MAX_BYTES >> 20} MiB")
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        directory = tempfile.mkdtemp(prefix="fastdecode-link-", dir=base)
        try:
            fd = os.open(os.path.join(directory, "rows"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)        # a full /dev/shm fails here, not as SIGBUS later
            except OSError:
                os.close(fd)
                raise
            for name in ("to_r", "to_s"):
                os.mkfifo(os.path.join(directory, name), 0o600)
            nonce = secrets.randbits(62)
            os.pwrite(fd, np.array([MAGIC, nonce, 0, rows, slots, in_row, out_row, itemsize], np.int64).tobytes(), 0)
            return cls(directory, "s", fd, nonce)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    @classmethod
    def attach(cls, directory: str, nonce: int, in_row: int, out_row: int) -> "ShmLink":
        """The R-worker's end. OSError naming what does not match (another node's path, a shape)."""
        fd = os.open(os.path.join(directory, "rows"), os.O_RDWR)
        link = cls(directory, "r", fd, nonce)
        h = link.header
        if int(h[0]) != MAGIC or int(h[1]) != nonce:
            link.close()
            raise OSError(f"{directory}: not this job's link (another node's memory)")
        if (link.in_row, link.out_row) != (in_row, out_row):
            link.close()
            raise OSError(f"{directory}: rows of {link.in_row}/{link.out_row} elements, this worker's are "
                          f"{in_row}/{out_row}")
        h[2] = nonce + 1                       # the answer the S-worker reads back
        return link

    def confirmed(self) -> bool:
        """S-worker: the R-worker answered in the shared header."""
        return int(self.header[2]) == self.nonce + 1

    def unlink(self) -> None:
        """Remove the names; both ends keep what they opened."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        for fd in (self._rd, self._wr):
            try:
                os.close(fd)
            except OSError:
                pass
        self._rd = self._wr = -1

    # ------------------------------------------------------------------ rows

    def fits(self, slot: int, rows: int) -> bool:
        return 0 <= slot < self.slots and 0 < rows <= self.rows

    def _offset(self, slot: int, part: int) -> int:
        """Byte offset of slot's in rows (part 0) or out rows of parity part - 1."""
        elems = (0, self.rows * self.in_row, self.rows * (self.in_row + self.out_row))[part]
        return self._base + slot * self._slot_bytes + elems * self.itemsize

    def qkv_buffer(self, slot: int):
        """The slot's q|k|v rows as a writable buffer of rows * in_row elements."""
        off = self._offset(slot, 0)
        return memoryview(self._map)[off:off + self.rows * self.in_row * self.itemsize]

    def out_buffer(self, slot: int, parity: int):
        off = self._offset(slot, 1 + parity)
        return memoryview(self._map)[off:off + self.rows * self.out_row * self.itemsize]

    # ------------------------------------------------------------------ the doorbell

    def ring(self, slot: int, value: int) -> None:
        """Publish slot's rows (q|k|v from the S side, O from the R side) as `value` and wake the peer."""
        self.ticks[slot if self.side == "s" else self.slots + slot] = value
        try:
            os.write(self._wr, b"\x01")
        except BlockingIOError:                # the FIFO is full of wake-ups the peer has not read yet
            pass

    def wait(self, slot: int, value: int, timeout: float | None, who: str) -> None:
        """Block until the peer rang slot with `value` or later; PeerTimeout naming `who` after `timeout` s."""
        index = self.slots + slot if self.side == "s" else slot
        start = time.perf_counter()
        while True:
            self._drain()
            if self.ticks[index] >= value:
                return
            if self._poll.poll(POLL_SLICE_MS):
                continue
            if timeout is not None and time.perf_counter() - start > timeout:
                raise PeerTimeout(f"no reply from {who} within {timeout:.0f} s")

    def _drain(self) -> None:
        try:
            os.read(self._rd, 1 << 16)          # a FIFO holds 64 KiB: one read empties it
        except BlockingIOError:
            pass
