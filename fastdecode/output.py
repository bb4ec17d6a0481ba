"""The output JSONL file: lines appended and flushed as requests finish, sorted at the end.

Every line is written whole and flushed, so what is finished is on disk even if the job dies.
An index (input line number, byte offset, length) per written line lets `finalize` rewrite the
file in input order, atomically (write to a temporary file, then rename).
"""
from __future__ import annotations

import json
import os
from array import array


class OutputWriter:
    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "ab")
        self.index_line = array("q")    # input line number of each written line
        self.index_off = array("q")     # its byte offset in the file
        self.index_len = array("q")     # its length in bytes, newline included
        self.count = 0

    def write(self, line_no: int, obj: dict) -> None:
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
        off = self.f.tell()
        self.f.write(data)
        self.f.flush()
        self.index_line.append(line_no)
        self.index_off.append(off)
        self.index_len.append(len(data))
        self.count += 1

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()

    def finalize(self, sort: bool = True) -> None:
        """Close; with sort, rewrite the lines of this run in input-line order."""
        self.close()
        if not sort or self.count == 0:
            return
        order = sorted(range(self.count), key=self.index_line.__getitem__)
        if order == list(range(self.count)):
            return
        tmp = f"{self.path}.sorting.{os.getpid()}"
        with open(self.path, "rb") as src, open(tmp, "wb") as dst:
            for i in order:
                src.seek(self.index_off[i])
                dst.write(src.read(self.index_len[i]))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)
