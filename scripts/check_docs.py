#!/usr/bin/env python3
"""Check that the commands in README.md and docs/*.md run as written.

    python3 scripts/check_docs.py                 # parse: flags, files, links (seconds)
    python3 scripts/check_docs.py --run           # and run every bash/python block, in order
    python3 scripts/check_docs.py --run --fast    # only blocks without mpirun/sbatch/install/pytest
    python3 scripts/check_docs.py --run --benchmarks   # the benchmark blocks too (hours)

Blocks are fenced ```bash or ```python. A block whose opening comment lines say `# needs a GPU`
or `# needs SLURM` runs only where CUDA or `sbatch` is available; one that says `# benchmark` (a
result's reproduction) only with --benchmarks. Every block is parsed. The
README's test command is what CI runs (.ci/run), so --run leaves pytest to CI. Commands run in
--workdir (default: the repository root); another directory gets links to the repository's
top-level entries, so relative paths work and outputs land there.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SLOW = ("mpirun", "mpiexec", "sbatch", "install.sh", "pytest")
REPO_PATH = re.compile(r"(?<![\w/.-])((?:scripts|examples|bench|docs|tests|fastdecode|rworker|csrc)/[\w./-]*[\w/])")


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    def header(self) -> list[str]:
        """The comment lines a block opens with (its markers)."""
        lines = self.text.strip().splitlines()
        return [line for line in lines[:next((i for i, x in enumerate(lines) if not x.startswith("#")), len(lines))]]

    @property
    def needs(self) -> str | None:
        for line in self.header():
            m = re.match(r"#\s*needs (a GPU|SLURM)", line)
            if m:
                return m.group(1)
        return None

    @property
    def benchmark(self) -> bool:
        return any(line.startswith("# benchmark") for line in self.header())


def blocks(doc: Path) -> list[Block]:
    found, lang, start, body = [], None, 0, []
    for i, line in enumerate(doc.read_text().splitlines(), start=1):
        fence = re.match(r"^```(\w*)", line)
        if fence and lang is None:
            lang, start, body = fence.group(1) or "text", i, []
        elif line.startswith("```") and lang is not None:
            if lang in ("bash", "python"):
                found.append(Block(doc, start, lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line)
    return found


# ------------------------------------------------------------------ parse

def commands(block: Block) -> list[list[str]]:
    """Each simple command of a bash block as argv (comments and line continuations removed)."""
    text = re.sub(r"\\\n\s*", " ", block.text)
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + [";"]:
            if w in ("&&", "||", ";", "|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def fastdecode_argv(cmd: list[str]) -> list[str] | None:
    """The arguments after `fastdecode` in `[mpirun -n N] fastdecode ...` or `python3 -m fastdecode ...`."""
    words = [w for w in cmd if "=" not in w or w.startswith("-")]       # drop VAR=value prefixes
    for i, w in enumerate(words):
        if w == "fastdecode":
            return words[i + 1:]
        if w == "-m" and i + 1 < len(words) and words[i + 1] == "fastdecode":
            return words[i + 2:]
    return None


def check_parse(block: Block) -> list[str]:
    problems = []
    if block.lang == "python":
        try:
            compile(block.text, block.where, "exec")
        except SyntaxError as e:
            problems.append(f"{block.where}: python does not compile: {e}")
        return problems
    sys.path.insert(0, str(REPO))
    from fastdecode.cli import build_parser
    for cmd in commands(block):
        argv = fastdecode_argv(cmd)
        if argv is not None:
            try:
                build_parser().parse_args(argv)
            except SystemExit as e:
                if e.code:
                    problems.append(f"{block.where}: `fastdecode {' '.join(argv)}` does not parse")
    for path in REPO_PATH.findall(block.text):
        if not (REPO / path).exists():
            problems.append(f"{block.where}: {path} does not exist")
    return problems


def check_links(doc: Path) -> list[str]:
    """Relative links resolve to files, and #anchors to headings of the target."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"\w+://", target):
            problems.append(f"{doc.relative_to(REPO)}: links outside the repository: {target}")
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            problems.append(f"{doc.relative_to(REPO)}: broken link {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{doc.relative_to(REPO)}: no heading for #{anchor} in {dest.relative_to(REPO)}")
    return problems


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+\s+(.*)$", doc.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in heads}


# ------------------------------------------------------------------ run

def available(need: str | None) -> bool:
    if need == "SLURM":
        return shutil.which("sbatch") is not None and subprocess.run(
            ["sinfo"], capture_output=True).returncode == 0
    if need == "a GPU":
        try:
            import torch
        except ImportError:
            return False
        return torch.cuda.is_available()
    return True


def workdir(path: str | None) -> Path:
    if not path:
        return REPO
    wd = Path(path).resolve()
    wd.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name != ".git" and not (wd / entry.name).exists():
            (wd / entry.name).symlink_to(entry)
    return wd


def run_block(block: Block, cwd: Path, timeout: float) -> str | None:
    """None if the block ran cleanly, else what went wrong."""
    if block.lang == "python":
        argv = [sys.executable, "-c", block.text]
    else:
        script = "\n".join(line for line in block.text.splitlines() if "python3 -m pytest" not in line)
        argv = ["bash", "-eo", "pipefail", "-c", script]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"{block.where}: still running after {timeout:.0f} s"
    if proc.returncode:
        return f"{block.where}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-1500:]}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="store_true", help="run the blocks, not only parse them")
    ap.add_argument("--fast", action="store_true", help=f"with --run: skip blocks using {', '.join(SLOW)}")
    ap.add_argument("--benchmarks", action="store_true", help="with --run: the `# benchmark` blocks too")
    ap.add_argument("--workdir", help="where commands run (default: the repository root)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per block")
    args = ap.parse_args(argv)
    problems, ran, skipped = [], 0, []
    cwd = workdir(args.workdir) if args.run else REPO
    for doc in DOCS:
        problems += check_links(doc)
        for block in blocks(doc):
            problems += check_parse(block)
            if not args.run:
                continue
            if not available(block.needs):
                skipped.append(f"{block.where} (needs {block.needs})")
            elif block.benchmark and not args.benchmarks:
                skipped.append(f"{block.where} (benchmark)")
            elif args.fast and any(word in block.text for word in SLOW):
                skipped.append(f"{block.where} (slow)")
            else:
                start = time.perf_counter()
                failure = run_block(block, cwd, args.timeout)
                ran += 1
                print(f"{'FAIL' if failure else 'ok  '} {block.where} ({time.perf_counter() - start:.1f} s)", flush=True)
                if failure:
                    problems.append(failure)
    for s in skipped:
        print(f"skip {s}")
    for p in problems:
        print(p, file=sys.stderr)
    print(f"check_docs: {len(DOCS)} documents, {ran} blocks run, {len(skipped)} skipped, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
