"""Resume: which input lines earlier runs of the same command have answered, in bounded memory.

The output file is the only state kept between runs; output lines carry no input line numbers,
so each one is matched back to its input line by its kind, exactly:
  - a line without a custom_id gets an error row written when it is read, i.e. in input order:
    the k-th such row of the file answers the k-th input line without a custom_id;
  - the first input line carrying custom_id X owns X: its row is the one row of X whose error
    code is not duplicate_custom_id (a success or any other error);
  - every later line carrying X gets a duplicate_custom_id row, written when read: the k-th such
    row of X answers the (k+1)-th line carrying X.
Rows of earlier runs that are "done" are kept and their input lines skipped: successes, and
errors that follow from the input line and the model alone (DETERMINISTIC_CODES). Any other
error (kv_capacity_exceeded depends on --rworker-mem and the R-worker count; a future 5xx) does
not block a retry: the line is served again and the new row supersedes the old one, which the
final rewrite drops. A row that matches no input line (not JSON, or from another input) is
dropped by the final rewrite too, and counted.

The matching state (custom_id -> first line and duplicate count, earlier rows, this run's rows
by input line) lives in a scratch SQLite file with a bounded page cache, not in Python sets, so
rank 0's memory does not grow with the input (10 M lines): see bench/e2e/input_memory_bench.py.
"""
from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Iterator

import pydantic_core

from fastdecode.batch.output import scan_lines

DETERMINISTIC_CODES = frozenset({"invalid_request", "invalid_url", "invalid_prompt", "context_length_exceeded",
                                 "duplicate_custom_id"})
PRIMARY, DUPLICATE, NO_ID = 0, 1, 2
NO_ID_KEY = ""            # custom_ids are non-empty strings, so "" never collides
NEW, DONE, DUP = "new", "done", "duplicate"
CACHE_KIB = 32 << 10      # SQLite page cache: the index's whole memory footprint


def classify_row(text: bytes) -> tuple[str, int, str | None, bool] | None:
    """(custom_id key, kind, error code or None, done) of an output row; None if not a row (a line
    someone else wrote there, however deep or large, is junk: never an error)."""
    try:
        obj = pydantic_core.from_json(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "custom_id" not in obj or "response" not in obj:
        return None
    err = obj.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    code = code if isinstance(code, str) or code is None else str(code)
    resp = obj.get("response")
    status = resp.get("status_code") if isinstance(resp, dict) else None
    cid = obj["custom_id"]
    if not isinstance(cid, str) or not cid:
        return NO_ID_KEY, NO_ID, code, True
    if code == "duplicate_custom_id":
        return cid, DUPLICATE, code, True
    done = (status == 200 and err is None) or code in DETERMINISTIC_CODES
    return cid, PRIMARY, code, done


class ResumeIndex:
    def __init__(self, index_dir: str | None = None):
        fd, self.path = tempfile.mkstemp(prefix="fastdecode-index-", suffix=".sqlite", dir=index_dir)
        os.close(fd)
        self.db = sqlite3.connect(self.path, isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "locking_mode=EXCLUSIVE", "temp_store=FILE",
                       f"cache_size=-{CACHE_KIB}"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.executescript("""
            CREATE TABLE prior(cid TEXT, kind INTEGER, j INTEGER, off INTEGER, len INTEGER, code TEXT,
                               done INTEGER, PRIMARY KEY (cid, kind, j)) WITHOUT ROWID;
            CREATE TABLE ids(cid TEXT PRIMARY KEY, first_line INTEGER, dups INTEGER) WITHOUT ROWID;
            CREATE TABLE rows(line INTEGER PRIMARY KEY, off INTEGER, len INTEGER, code TEXT);
        """)
        self.db.execute("BEGIN")
        self.prior_rows = 0          # rows of earlier runs, junk included
        self.junk = 0                # rows that are not output rows of ours (not JSON, ...)
        self.superseded = 0          # earlier rows replaced by a later row of the same line
        self.skipped = 0             # input lines answered by an earlier run
        self.retried = 0             # input lines whose earlier row was a retryable error
        self.rows_total = 0          # lines in the output file now
        self._no_id_lines = 0
        self.complete = True         # False: earlier rows not all indexed, claiming would redo them

    # ------------------------------------------------------------------ earlier runs' rows

    def load(self, path: str, end: int, stop=None) -> bool:
        """Index the output rows in path[0:end] (whole lines: the writer repaired the tail).
        Returns False if stop() turned true first; then no line may be claimed."""
        db, no_id = self.db, 0
        for off, text in scan_lines(path):
            if off >= end:
                break
            if stop is not None and self.prior_rows % 10_000 == 0 and stop():
                self.complete = False
                return False
            self.prior_rows += 1
            kind = classify_row(text)
            if kind is None:
                self.junk += 1
                continue
            cid, k, code, done = kind
            if k == NO_ID:
                no_id += 1
                j = no_id
            elif k == DUPLICATE:
                j = db.execute("SELECT COALESCE(MAX(j), 0) FROM prior WHERE cid = ? AND kind = 1", (cid,)).fetchone()[0] + 1
            else:
                j = 0
                old = db.execute("SELECT done FROM prior WHERE cid = ? AND kind = 0", (cid,)).fetchone()
                if old is not None:
                    self.superseded += 1
                    if old[0] > done:          # a done row beats a later retryable error
                        continue
            db.execute("INSERT OR REPLACE INTO prior VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (cid, k, j, off, len(text), code, int(done)))
        self.rows_total = self.prior_rows
        return True

    def done_prior(self) -> int:
        """Earlier rows that answer a line for good: at least one per input line if every line is done."""
        return self.db.execute("SELECT COUNT(*) FROM prior WHERE done = 1").fetchone()[0]

    # ------------------------------------------------------------------ input lines, in input order

    def claim(self, line_no: int, custom_id: str | None) -> tuple[str, int | None]:
        """(NEW, None): serve the line; (DONE, None): an earlier run answered it; (DUP, first_line)."""
        if not self.complete:
            raise RuntimeError("resume index incomplete: earlier rows were not all read")
        db = self.db
        if custom_id is None:
            self._no_id_lines += 1
            key, kind, j, first = NO_ID_KEY, NO_ID, self._no_id_lines, None
        elif db.execute("INSERT OR IGNORE INTO ids VALUES (?, ?, 0)", (custom_id, line_no)).rowcount == 1:
            key, kind, j, first = custom_id, PRIMARY, 0, None
        else:
            db.execute("UPDATE ids SET dups = dups + 1 WHERE cid = ?", (custom_id,))
            first, j = db.execute("SELECT first_line, dups FROM ids WHERE cid = ?", (custom_id,)).fetchone()
            key, kind = custom_id, DUPLICATE
        if self.prior_rows and self._take(line_no, key, kind, j):
            self.skipped += 1
            return DONE, None
        return (DUP, first) if kind == DUPLICATE else (NEW, None)

    def _take(self, line_no: int, key: str, kind: int, j: int) -> bool:
        """Match an earlier row to this line; a done one answers it, a retryable one is superseded."""
        row = self.db.execute("SELECT off, len, code, done FROM prior WHERE cid = ? AND kind = ? AND j = ?",
                              (key, kind, j)).fetchone()
        if row is None:
            return False
        off, length, code, done = row
        if not done:
            self.retried += 1
            return False
        self.db.execute("DELETE FROM prior WHERE cid = ? AND kind = ? AND j = ?", (key, kind, j))
        self.db.execute("INSERT INTO rows VALUES (?, ?, ?, ?)", (line_no, off, length, code))
        return True

    def record(self, line_no: int, off: int, length: int, code: str | None) -> None:
        """A row this run wrote for input line line_no."""
        self.db.execute("INSERT INTO rows VALUES (?, ?, ?, ?)", (line_no, off, length, code))
        self.rows_total += 1

    # ------------------------------------------------------------------ the final rewrite

    def answered(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]

    def dropped(self) -> int:
        """Rows of the file that answer no input line (superseded, junk, foreign)."""
        return self.rows_total - self.answered()

    def in_input_order(self) -> bool:
        last = -1
        for (off,) in self.db.execute("SELECT off FROM rows ORDER BY line"):
            if off < last:
                return False
            last = off
        return True

    def ranges(self, sort: bool) -> Iterator[tuple[int, int]]:
        order = "line" if sort else "off"
        yield from self.db.execute(f"SELECT off, len FROM rows ORDER BY {order}")

    def codes(self, pending_prior: bool) -> dict[str, int]:
        """Rows by error code ("ok" for successes): the answered lines, plus with pending_prior the
        earlier done rows not reached yet (an interrupted run)."""
        out: dict[str, int] = {}
        queries = ["SELECT code, COUNT(*) FROM rows GROUP BY code"]
        if pending_prior:
            queries.append("SELECT code, COUNT(*) FROM prior WHERE done = 1 GROUP BY code")
        for q in queries:
            for code, n in self.db.execute(q):
                out[code or "ok"] = out.get(code or "ok", 0) + n
        return out

    def close(self) -> None:
        try:
            self.db.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)
