"""Resume: which input lines earlier runs answered, in bounded memory.

Output rows carry no input line numbers, and vLLM's row schema has no room for them: each row is
bound to the request it answers by its record in OUTPUT.fingerprints (binding.py), the row's
digest and its request's key (fingerprint.py: the line's canonical JSON and the model served;
with the line numbers for a line without a custom_id or repeating an earlier line's). An input
line is answered by the earlier row recorded under its key, or by none: a rerun skips exactly
the lines whose request is unchanged, serves again those whose request changed, and never
matches a row by its position. The first line carrying custom_id X owns X; every later line
carrying X gets a duplicate_custom_id row (written when read).

Rows of earlier runs that are "done" answer their line for good: successes, and errors that
follow from the request and the model alone (DETERMINISTIC_CODES). Any other error
(kv_capacity_exceeded depends on --rworker-mem and the R-worker count; a future 5xx) does not
block a retry: the line is served again and the new row supersedes the old one. Rows that answer
no line of this input are moved out of the output by the final rewrite (generate.py), counted by
cause (MOVED_CAUSES).

The matching state (records, custom_id -> first line, earlier rows, this run's rows by input
line) lives in a scratch SQLite file with a bounded page cache, not in Python sets, so rank 0's
memory does not grow with the input (10 M lines): see bench/e2e/input_memory_bench.py. The file
is held locked (flock) while in use; one that a killed job left behind (unlocked, older than a
minute) is removed by the next job that makes its index in the same directory.
"""
from __future__ import annotations

import fcntl
import glob
import os
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from typing import NamedTuple

import pydantic_core

from fastdecode.batch import binding
from fastdecode.batch.fingerprint import DUPLICATE, NO_ID, PRIMARY, line_key, row_digest
from fastdecode.batch.lock import remove_if_unheld
from fastdecode.batch.output import scan_lines

DETERMINISTIC_CODES = frozenset({"invalid_request", "invalid_url", "invalid_prompt", "context_length_exceeded",
                                 "duplicate_custom_id"})
NEW, DONE, DUP = "new", "done", "duplicate"
CACHE_KIB = 32 << 10      # SQLite page cache: the index's whole memory footprint
SCRATCH_PREFIX, SCRATCH_SUFFIX = "fastdecode-index-", ".sqlite"
STALE_S = 60.0            # a scratch index unlocked for this long was left by a job that ended
# why an earlier row answers no input line: a later row answers its line (a retry); its request
# changed or is not in the input; nothing records what it answers (edited, another program's);
# not an output row at all
MOVED_CAUSES = ("superseded", "unmatched", "unbound", "junk")


class Claim(NamedTuple):
    state: str                 # NEW: serve the line; DONE: an earlier row answers it; DUP: a repeated custom_id
    first: int | None          # DUP: the line that owns the custom_id
    key: bytes                 # what the line's row is recorded under


def row_code(text: bytes) -> tuple[str | None, bool] | None:
    """(error code or None, done) of an output row; None if not a row (a line someone else wrote
    there, however deep or large, is junk: never an error)."""
    facts = row_facts(text)
    return None if facts is None else facts[:2]


def row_facts(text: bytes) -> tuple[str | None, bool, int] | None:
    """(error code or None, done, generated tokens: usage.completion_tokens, else 0) of an output
    row; None if not a row."""
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
    body = resp.get("body") if isinstance(resp, dict) else None
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else 0
    return code, (status == 200 and err is None) or code in DETERMINISTIC_CODES, tokens


def reclaim_scratch(directory: str, now: float | None = None) -> int:
    """Remove scratch indexes in `directory` that no job holds (left by a killed job); -> how many."""
    now = time.time() if now is None else now
    removed = 0
    for path in glob.glob(os.path.join(glob.escape(directory), f"{SCRATCH_PREFIX}*{SCRATCH_SUFFIX}")):
        try:
            if now - os.path.getmtime(path) < STALE_S:
                continue                      # just made: its job may not hold it yet
        except OSError:
            continue
        removed += remove_if_unheld(path, os.unlink)
    return removed


class ResumeIndex:
    def __init__(self, index_dir: str | None = None, model: str | None = None):
        directory = index_dir or tempfile.gettempdir()
        reclaim_scratch(directory)
        self._hold, self.path = tempfile.mkstemp(prefix=SCRATCH_PREFIX, suffix=SCRATCH_SUFFIX, dir=directory)
        try:
            fcntl.flock(self._hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass                              # a file system without locks: it is still removed on close
        self.model = model                    # the served model's name: part of every line's key
        self.db = sqlite3.connect(self.path, isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "locking_mode=EXCLUSIVE", "temp_store=FILE",
                       f"cache_size=-{CACHE_KIB}"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.executescript("""
            CREATE TABLE bound(digest BLOB PRIMARY KEY, key BLOB) WITHOUT ROWID;
            CREATE TABLE prior(key BLOB PRIMARY KEY, off INTEGER, len INTEGER, code TEXT, done INTEGER,
                               digest BLOB, tokens INTEGER) WITHOUT ROWID;
            CREATE TABLE earlier(off INTEGER PRIMARY KEY, len INTEGER, key BLOB, cause TEXT);
            CREATE TABLE ids(cid TEXT PRIMARY KEY, first_line INTEGER) WITHOUT ROWID;
            CREATE TABLE rows(line INTEGER PRIMARY KEY, off INTEGER, len INTEGER, code TEXT, digest BLOB, key BLOB);
        """)
        self.db.execute("BEGIN")
        self.prior_rows = 0          # rows of earlier runs, junk included
        self.junk = 0                # rows that are not output rows of ours (not JSON, ...)
        self.unbound = 0             # rows without a record of the request they answer
        self.superseded = 0          # earlier rows replaced by a later row of the same request
        self.skipped = 0             # input lines answered by an earlier run
        self.retried = 0             # input lines whose earlier row was a retryable error
        self.prior_tokens = 0        # generated tokens of the earlier done rows (a superseded row's not)
        self.rows_total = 0          # lines in the output file now
        self.complete = True         # False: earlier rows not all indexed, claiming would redo them

    # ------------------------------------------------------------------ earlier runs' rows

    def load(self, path: str, end: int, stop=None) -> bool:
        """Index the output rows in path[0:end] (whole lines: the writer repaired the tail) by
        their records. Returns False if stop() turned true first; then no line may be claimed."""
        db = self.db
        for chunk in binding.records(path):
            db.executemany("INSERT OR REPLACE INTO bound VALUES (?, ?)", chunk)
        for off, text in scan_lines(path):
            if off >= end:
                break
            if stop is not None and self.prior_rows % 10_000 == 0 and stop():
                self.complete = False
                return False
            self.prior_rows += 1
            self._add_earlier(off, text)
        self.rows_total = self.prior_rows
        return True

    def _add_earlier(self, off: int, text: bytes) -> None:
        db = self.db
        facts = row_facts(text)
        digest = row_digest(text)
        found = db.execute("SELECT key FROM bound WHERE digest = ?", (digest,)).fetchone()
        if facts is None or found is None:
            cause = "junk" if facts is None else "unbound"
            self.junk += cause == "junk"
            self.unbound += cause == "unbound"
            db.execute("INSERT INTO earlier VALUES (?, ?, NULL, ?)", (off, len(text), cause))
            return
        (key,), (code, done, tokens) = found, facts
        db.execute("INSERT INTO earlier VALUES (?, ?, ?, 'bound')", (off, len(text), key))
        old = db.execute("SELECT done, tokens FROM prior WHERE key = ?", (key,)).fetchone()
        if old is not None:
            self.superseded += 1
            if old[0] > done:                  # a done row beats a later retryable error
                return
            self.prior_tokens -= old[1] if old[0] else 0
        db.execute("INSERT OR REPLACE INTO prior VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (key, off, len(text), code, int(done), digest, tokens))
        self.prior_tokens += tokens if done else 0

    def done_prior(self) -> int:
        """Earlier rows that answer a request for good: at least one per input line if every line is done."""
        return self.db.execute("SELECT COUNT(*) FROM prior WHERE done = 1").fetchone()[0]

    # ------------------------------------------------------------------ input lines, in input order

    def claim(self, line_no: int, custom_id: str | None, digest: bytes) -> Claim:
        """Whether line line_no (its custom_id and digest: BatchLine's) needs serving."""
        if not self.complete:
            raise RuntimeError("resume index incomplete: earlier rows were not all read")
        if self.model is None:
            raise RuntimeError("resume index: the served model is not set")
        db = self.db
        first = None
        if custom_id is None:
            kind = NO_ID
        elif db.execute("INSERT OR IGNORE INTO ids VALUES (?, ?)", (custom_id, line_no)).rowcount == 1:
            kind = PRIMARY
        else:
            kind = DUPLICATE
            first = db.execute("SELECT first_line FROM ids WHERE cid = ?", (custom_id,)).fetchone()[0]
        key = line_key(self.model, kind, digest, line_no, first)
        if self.prior_rows and self._take(line_no, key):
            self.skipped += 1
            return Claim(DONE, None, key)
        return Claim(DUP if kind == DUPLICATE else NEW, first, key)

    def _take(self, line_no: int, key: bytes) -> bool:
        """Match the earlier row of this request to its line: a done one answers it, a retryable
        one is superseded by the row the retry writes."""
        row = self.db.execute("SELECT off, len, code, done, digest FROM prior WHERE key = ?", (key,)).fetchone()
        if row is None:
            return False
        off, length, code, done, digest = row
        if not done:
            self.retried += 1
            return False
        self.db.execute("DELETE FROM prior WHERE key = ?", (key,))
        self.db.execute("INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?)", (line_no, off, length, code, digest, key))
        return True

    def record(self, line_no: int, off: int, length: int, code: str | None, digest: bytes, key: bytes) -> None:
        """A row this run wrote for input line line_no."""
        self.db.execute("INSERT INTO rows VALUES (?, ?, ?, ?, ?, ?)", (line_no, off, length, code, digest, key))
        self.rows_total += 1

    # ------------------------------------------------------------------ the final rewrite

    def answered(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM rows").fetchone()[0]

    def unanswering(self) -> int:
        """Rows of the file that answer no input line (moved out by the final rewrite)."""
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

    def kept_records(self) -> Iterator[tuple[bytes, bytes]]:
        """(row digest, request key) of every row that answers a line."""
        yield from self.db.execute("SELECT digest, key FROM rows ORDER BY line")

    def moved(self) -> Iterator[tuple[int, int, str]]:
        """(offset, length, cause) of the earlier rows that answer no input line, in file order."""
        self.db.execute("CREATE INDEX IF NOT EXISTS rows_off ON rows(off)")
        self.db.execute("CREATE INDEX IF NOT EXISTS rows_key ON rows(key)")
        yield from self.db.execute("""
            SELECT e.off, e.len, CASE WHEN e.cause != 'bound' THEN e.cause
                                      WHEN EXISTS (SELECT 1 FROM rows r WHERE r.key = e.key) THEN 'superseded'
                                      ELSE 'unmatched' END
            FROM earlier e WHERE NOT EXISTS (SELECT 1 FROM rows r WHERE r.off = e.off) ORDER BY e.off""")

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
            os.close(self._hold)
