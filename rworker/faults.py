"""Fault injection for tests: FASTDECODE_INJECT_FAULT="<rank>:<point>" raises at that point.

Points: hello, prefill, decode (R-workers), step (the S-worker's engine step).
"""
from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


def check(rank: int, point: str) -> None:
    spec = os.environ.get("FASTDECODE_INJECT_FAULT")
    if spec and spec == f"{rank}:{point}":
        raise InjectedFault(f"injected fault at {point} (FASTDECODE_INJECT_FAULT={spec})")
