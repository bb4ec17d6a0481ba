"""A time budget for the model's chat template, which is code from the model's files.

Jinja's sandbox stops a template from reaching outside it, not from running long: two nested
loops over `range(100000)` are 10^10 steps, and rank 0 would serve nothing else meanwhile. The
template's compiled code runs under a trace function that looks at the clock every 1024 of its
line events and raises TemplateBudgetExceeded past the deadline; only the template's own frames
(Jinja names their file `<template>`) are traced, so the rest of the render runs at full speed.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

CHAT_TEMPLATE_BUDGET_S = 2.0      # per rendering: a real template takes milliseconds
TEMPLATE_FILE = "<template>"      # the file name Jinja gives code compiled from a string
_CHECK_EVERY = 1024               # line events between looks at the clock


class TemplateBudgetExceeded(RuntimeError):
    """The chat template ran past its budget (its line gets a 400; the job goes on)."""


@contextmanager
def template_budget(seconds: float = CHAT_TEMPLATE_BUDGET_S):
    """Within the block, template code running past `seconds` raises TemplateBudgetExceeded
    (this thread only; a trace function already set, a debugger's or coverage's, is restored after)."""
    deadline = time.monotonic() + seconds
    events = 0

    def in_template(frame, event, arg):
        nonlocal events
        events += 1
        if events % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise TemplateBudgetExceeded(f"the model's chat template ran past its budget of {seconds:g} s")
        return in_template

    def on_call(frame, event, arg):
        return in_template if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
