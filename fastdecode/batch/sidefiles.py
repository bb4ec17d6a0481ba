"""The files a `generate` job keeps beside its output, named after the output's real path (a
symlinked output keeps them beside the file it points to):

  OUTPUT.lock             held by the running job (lock.py); names its host and pid
  OUTPUT.fingerprints     the request each row answers (binding.py)
  OUTPUT.inflight         running sequences saved by a stop, continued by the rerun (inflight.py)
  OUTPUT.unmatched.jsonl  rows that answer no input line, moved out by the final rewrite
  *.tmp                   a rewrite in progress (replaces its file atomically)
"""
from __future__ import annotations

import os

SUFFIXES = {".lock": "the output's lock", ".fingerprints": "the output's request fingerprints",
            ".inflight": "the output's saved in-flight sequences", ".unmatched.jsonl": "the output's unmatched rows",
            ".rewrite.tmp": "the output's rewrite in progress", ".fingerprints.tmp": "the fingerprints' rewrite",
            ".inflight.tmp": "the in-flight save in progress"}


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


def rewrite_tmp(output: str) -> str:
    return real(output) + ".rewrite.tmp"


def of_output(output: str) -> dict[str, str]:
    """role -> path of every side file of `output`."""
    base = real(output)
    return {role: base + suffix for suffix, role in SUFFIXES.items()}
