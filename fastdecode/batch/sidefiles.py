"""The files a `generate` job keeps beside its output, named after the output's real path (a
symlinked output keeps them beside the file it points to):

  OUTPUT.lock             held by the running job (lock.py); names its host and pid
  OUTPUT.fingerprints     the request each row answers (binding.py)
  OUTPUT.inflight         running sequences saved by a stop, continued by the rerun (inflight.py)
  OUTPUT.inflight.kv      their KV-cache, reloaded by the rerun (inflight_kv.py, --save-kv-on-stop)
  OUTPUT.unmatched.jsonl  rows that answer no input line, moved out by the final rewrite
  NAME.XXXXXXXX.tmp       a rewrite of OUTPUT (NAME: OUTPUT.rewrite), OUTPUT.fingerprints or
                          OUTPUT.inflight in progress: a random name, replaces its file atomically

None of them is written through a symbolic link (filemode.py): a link in the place of one is an
error naming it, found before any compute (paths.py).
"""
from __future__ import annotations

import glob
import os
import stat

SUFFIXES = {".lock": "the output's lock", ".fingerprints": "the output's request fingerprints",
            ".inflight": "the output's saved in-flight sequences", ".inflight.kv": "the output's saved in-flight KV",
            ".unmatched.jsonl": "the output's unmatched rows"}
TEMP_OF = (".rewrite", ".fingerprints", ".inflight", ".inflight.kv")      # NAME.XXXXXXXX.tmp: OUTPUT + one of these


def real(output: str) -> str:
    return os.path.realpath(output)


def lock_path(output: str) -> str:
    return real(output) + ".lock"


def fingerprints_path(output: str) -> str:
    return real(output) + ".fingerprints"


def inflight_path(output: str) -> str:
    return real(output) + ".inflight"


def unmatched_path(output: str) -> str:
    return real(output) + ".unmatched.jsonl"


def rewrite_base(output: str) -> str:
    """What the output's rewrite's temporary file is named after (NAME.XXXXXXXX.tmp)."""
    return real(output) + ".rewrite"


def leftover_temps(output: str) -> list[str]:
    """Temporary files of the output's rewrites that a crash left (regular files only)."""
    found = []
    for suffix in TEMP_OF:
        for path in glob.glob(glob.escape(real(output) + suffix) + ".????????.tmp"):
            try:
                if stat.S_ISREG(os.lstat(path).st_mode):
                    found.append(path)
            except OSError:
                pass
    return found


def of_output(output: str) -> dict[str, str]:
    """role -> path of every side file of `output`."""
    base = real(output)
    return {role: base + suffix for suffix, role in SUFFIXES.items()}
