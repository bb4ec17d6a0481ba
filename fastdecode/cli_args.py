"""argparse as the `fastdecode` command needs it: an unknown option is the error reported, with
the closest known option, before a required one is missed (argparse checks `required` first, so
`--inptu x` would read "-i/--input is required").

Options are declared as usual; `required=True` on an option of a sub-command is checked after the
whole command line was read. An error is one line, first and alone (argparse's usage block, a
screen long for `generate`, would bury it), then where the options are listed. A vLLM flag that is
not fastdecode's is named with the flag that means the same here (vllm_args.py's MEANINGS), before
any flag spelled like it.
"""
from __future__ import annotations

import argparse
import difflib


class CommandParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deferred_required: list[argparse.Action] = []
        self.commands: dict[str, CommandParser] = {}

    def add_argument(self, *names, **kwargs):
        action = super().add_argument(*names, **kwargs)
        if action.required and action.option_strings:
            self.deferred_required.append(action)
        return action

    def parse_known_args(self, args=None, namespace=None):
        # required options stay marked so for --help and usage, but are checked in parse_args
        for action in self.deferred_required:
            action.required = False
        try:
            return super().parse_known_args(args, namespace)
        finally:
            for action in self.deferred_required:
                action.required = True

    def option_names(self) -> list[str]:
        """Every option string this parser knows, its argument groups' included (argparse keeps
        them in one table shared with its groups, and has no public way to list it)."""
        return list(self._option_string_actions)

    def add_subparsers(self, **kwargs):
        action = super().add_subparsers(**kwargs)
        add_parser = action.add_parser

        def add_command(name, **kw):
            sub = add_parser(name, **kw)
            self.commands[name] = sub
            return sub
        action.add_parser = add_command
        return action

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: `{self.prog} --help` lists the options\n")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        command = self.commands.get(getattr(ns, "command", None) or "")
        parser = command or self
        if extras:
            parser.error(unrecognized_message(extras, parser.option_names() + self.option_names()))
        for action in parser.deferred_required:
            if getattr(ns, action.dest, None) is None:
                parser.error(f"the following arguments are required: {'/'.join(action.option_strings)}")
        return ns


def unrecognized_message(extras: list[str], known: list[str]) -> str:
    """argparse's message, with "did you mean --x?" for each unknown option close to a known one."""
    from fastdecode.vllm_args import MEANINGS
    hints = []
    for word in extras:
        if not word.startswith("-") or word in ("-", "--"):
            continue
        name = word.split("=", 1)[0]
        same = MEANINGS.get(name)
        close = [same] if same in known else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        if close:
            hints.append((name, close[0]))
    text = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{text}; did you mean {hints[0][1]}?"
    return text + "".join(f"; {name}: did you mean {close}?" for name, close in hints)
