"""The output JSONL file: whole lines appended and flushed as requests finish; rewritten at the end.

A line is written in one piece and flushed, so what is finished is on disk even if the job dies.
A crash can still cut the last line short (a kill between two write calls of a long line, a node
lost before the page cache reached the disk): opening the file for appending first cuts it back
to its last newline, so every run starts from whole lines. The final rewrite (input order, or
moving out rows that answer no input line) goes to a temporary file beside the real file (a
symlinked output stays a link to it), with the output's mode and owner, that replaces the output
atomically. Rows moved out are appended to OUTPUT.unmatched.jsonl first, as they were: a crash
between the two may leave them there twice, never nowhere. Temporary files an earlier rewrite
left (a crash) are removed when the output is opened: the output itself is whole.

Each row's record (binding.py: its digest and the key of the request it answers) is written and
flushed before the row; both are fsynced together.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator

from fastdecode.batch import binding
from fastdecode.batch.filemode import fsync_dir, open_like, open_no_link, temp_like
from fastdecode.batch.fingerprint import row_digest
from fastdecode.batch.sidefiles import leftover_temps, rewrite_base
from rworker.host import faults

FSYNC_EVERY_S = 10.0      # bound what a lost node can take with it; a kill loses nothing flushed


def repair_tail(path: str, chunk: int = 1 << 16) -> int:
    """Cut a partial last line (no trailing newline) off `path`; return the bytes removed."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            block = f.read(end - start)
            nl = block.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
        return size - keep


def scan_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line with its newline) of every line, streamed."""
    off = 0
    with open(path, "rb") as f:
        for data in f:
            yield off, data
            off += len(data)


class OutputWriter:
    """The output, opened for appending rows (and their records) for `input_path` with `model`
    (its identity: model/identity.py); raises binding.ForeignOutput if the output answers another
    input or was made with another model."""

    def __init__(self, path: str, input_path: str, overwrite: bool = False, model: dict | None = None):
        binding.check(path, input_path, overwrite, model)
        self.path = path = os.path.realpath(path)          # write where a symlink points
        for left in leftover_temps(path):
            os.remove(left)
            print(f"fastdecode: {path}: removed {os.path.basename(left)}, left by an unfinished rewrite (the "
                  f"output itself is whole)", file=sys.stderr, flush=True)
        if overwrite or not os.path.exists(path):
            open(path, "wb").close()
            self.repaired = 0
        else:
            self.repaired = repair_tail(path)
            if self.repaired:
                print(f"fastdecode: {path}: removed a partial last line ({self.repaired} bytes) left by an "
                      f"interrupted run; that request is redone", file=sys.stderr, flush=True)
        self.f = open(path, "ab")
        self.start_size = self.f.tell()      # rows before this offset are earlier runs'
        try:
            self.record = binding.Recorder(path, input_path, fresh=self.start_size == 0, model=model)
        except BaseException:
            self.f.close()
            raise
        self.count = 0
        self._last_sync = time.monotonic()

    def write(self, obj: dict, key: bytes) -> tuple[int, int, bytes]:
        """Append one row answering the request `key`; return its (byte offset, length with the
        newline, digest)."""
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        digest = row_digest(data)
        self.record.add(digest, key)
        off = self.f.tell()
        self.f.write(data)
        self.f.flush()
        self.count += 1
        return off, len(data), digest

    def sync(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_sync >= FSYNC_EVERY_S:
            self.record.sync()
            os.fsync(self.f.fileno())
            self._last_sync = now

    def close(self) -> None:
        self.record.close()
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


def rewrite(path: str, ranges: Iterable[tuple[int, int]]) -> int:
    """Replace `path` by the byte ranges (offset, length) of it, in the order given; atomic: on an
    error (a full disk) the temporary file is removed and `path` is as it was."""
    path = os.path.realpath(path)
    dst, tmp = temp_like(rewrite_base(path), path)
    n = 0
    try:
        with dst, open(path, "rb") as src:
            for off, length in ranges:
                src.seek(off)
                dst.write(src.read(length))
                n += 1
            dst.flush()
            os.fsync(dst.fileno())
        faults.check(0, "rewrite")
        os.replace(tmp, path)
        fsync_dir(path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return n


def append_rows(src_path: str, ranges: Iterable[tuple[int, int]], dst_path: str) -> int:
    """Append the byte ranges of src_path to dst_path (created with src_path's mode), durably."""
    n = 0
    new = not os.path.exists(dst_path)
    dst = open_like(dst_path, src_path, "ab") if new else \
        os.fdopen(open_no_link(dst_path, os.O_WRONLY | os.O_APPEND), "ab")
    with dst, open(src_path, "rb") as src:
        for off, length in ranges:
            src.seek(off)
            dst.write(src.read(length))
            n += 1
        dst.flush()
        os.fsync(dst.fileno())
    if new:
        fsync_dir(dst_path)
    return n
