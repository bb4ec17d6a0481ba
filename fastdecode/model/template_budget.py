"""A time and size budget for the model's chat template, which is code from the model's files.

Jinja's sandbox stops a template from reaching outside it, not from running long or writing
much: two nested loops over `range(100000)` are 10^10 steps, and a loop writing 10^8 characters
would take gigabytes, and minutes to tokenize, while rank 0 serves nothing else. The template's
compiled code runs under a trace function that looks at the clock every 1024 of its line events,
and adds up the text its generator frames yield (a yield is a "return" event carrying the piece);
past the deadline or the character bound it raises TemplateBudgetExceeded. Only the template's
own frames (Jinja names their file `<template>`) are traced, so the rest runs at full speed.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from inspect import CO_GENERATOR

CHAT_TEMPLATE_BUDGET_S = 2.0      # per rendering: a real template takes milliseconds
TEMPLATE_FILE = "<template>"      # the file name Jinja gives code compiled from a string
_CHECK_EVERY = 1024               # line events between looks at the clock
CHARS_PER_TOKEN = 64              # the rendered text's bound per token of context: a token is ~4 characters
MIN_TEMPLATE_CHARS = 1 << 20      # ... and at least this many, for short-context models


def max_template_chars(max_model_len: int) -> int:
    """Characters a rendering may write: the context's worth of text, generously (a prompt longer
    than the context is refused after tokenizing anyway; this bounds what is tokenized to learn it)."""
    return max(MIN_TEMPLATE_CHARS, CHARS_PER_TOKEN * max_model_len)


class TemplateBudgetExceeded(RuntimeError):
    """The chat template ran past its budget (its line gets a 400; the job goes on)."""


def too_long(chars: int, max_chars: int) -> TemplateBudgetExceeded:
    return TemplateBudgetExceeded(f"the model's chat template wrote more than {max_chars:,} characters "
                                  f"({chars:,} so far), more than the model's context can hold")


@contextmanager
def template_budget(seconds: float = CHAT_TEMPLATE_BUDGET_S, max_chars: int = MIN_TEMPLATE_CHARS):
    """Within the block, template code running past `seconds` or yielding more than `max_chars`
    characters raises TemplateBudgetExceeded (this thread only; a trace function already set, a
    debugger's or coverage's, is restored after). A piece yielded through nested generators (a
    block, an include) counts at each level: the bound is generous enough for that."""
    deadline = time.monotonic() + seconds
    events = chars = 0

    def in_template(frame, event, arg):
        nonlocal events, chars
        events += 1
        if event == "return" and isinstance(arg, str) and frame.f_code.co_flags & CO_GENERATOR:
            chars += len(arg)
            if chars > max_chars:
                raise too_long(chars, max_chars)
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
