"""Issue 53, item 13: the files a job keeps beside its output are never written through a
symbolic link. A link (planted, or dangling) where a side file, a temporary file or a lock
belongs is a usage error naming it, before any compute; one planted while the job runs is
refused as it is opened; temporary files get a random name, so a link at any fixed name is
never followed."""
from __future__ import annotations

import os

import pytest
from conftest import batch_line, run_fastdecode

from fastdecode.batch import binding, inflight, lock
from fastdecode.batch.filemode import LinkRefused
from fastdecode.batch.output import OutputWriter, append_rows, rewrite
from fastdecode.batch.paths import check_paths, hold_outputs
from fastdecode.cli import build_parser
from fastdecode.engine.continuation import RequestState, SequenceState

KEEP = "the victim's own text\n"


@pytest.fixture
def files(tmp_path):
    inp, out, victim = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "victim.txt"
    inp.write_text(batch_line("r0", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}) + "\n")
    victim.write_text(KEEP)
    return inp, out, victim


def refused(inp, out, *flags):
    args = build_parser().parse_args(["generate", "-i", str(inp), "-o", str(out), *flags])
    try:
        with pytest.raises(ValueError) as e:
            check_paths(args)
            hold_outputs(args)
    finally:
        lock.release_all()
    return str(e.value)


@pytest.mark.parametrize("name", ["out.jsonl.lock", "out.jsonl.fingerprints", "out.jsonl.inflight",
                                  "out.jsonl.unmatched.jsonl", "out.jsonl.summary.json.tmp", "stats.json.lock"])
def test_a_link_where_a_side_file_belongs_is_refused_before_compute(files, name):
    inp, out, victim = files
    link = out.parent / name
    link.symlink_to(victim)
    message = refused(inp, out, "--stats-json", str(out.parent / "stats.json"), "--overwrite")
    assert f"{link} is a symbolic link (to {victim})" in message and "never through a link" in message
    assert victim.read_text() == KEEP and link.is_symlink()


def test_a_dangling_link_creates_no_file_elsewhere(files, tmp_path):
    inp, out, _ = files
    elsewhere = tmp_path / "elsewhere" / "created.txt"
    elsewhere.parent.mkdir()
    (tmp_path / "out.jsonl.lock").symlink_to(elsewhere)
    assert f"{tmp_path / 'out.jsonl.lock'} is a symbolic link" in refused(inp, out)
    assert not elsewhere.exists()
    with pytest.raises(LinkRefused):                     # the lock itself, if the check is raced
        lock.hold(str(tmp_path / "out.jsonl.lock"), "output out.jsonl")
    assert not elsewhere.exists()


def test_the_command_names_the_link_and_exits_2(files):
    inp, out, victim = files
    (out.parent / "out.jsonl.lock").symlink_to(victim)
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet"], timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{out}.lock is a symbolic link (to {victim})" in proc.stderr
    assert victim.read_text() == KEEP and not out.exists()


def test_links_planted_while_the_job_runs_are_never_written_through(files):
    """After the checks: the fingerprints opened under --overwrite, the in-flight save, the
    rewrites (at the temporary names earlier versions used) and the unmatched rows."""
    inp, out, victim = files
    fp = out.parent / "out.jsonl.fingerprints"
    fp.symlink_to(victim)
    with pytest.raises(LinkRefused, match="out.jsonl.fingerprints is a symbolic link"):
        OutputWriter(str(out), str(inp), overwrite=True)
    fp.unlink()
    writer = OutputWriter(str(out), str(inp), overwrite=True)
    writer.write({"custom_id": "r0", "response": {"status_code": 200}}, b"k" * 16)
    writer.close()
    for fixed in ("out.jsonl.inflight.tmp", "out.jsonl.rewrite.tmp", "out.jsonl.fingerprints.tmp"):
        (out.parent / fixed).symlink_to(victim)
    state = RequestState(7, "0" * 32, [SequenceState(0, [1, 2, 3])])
    assert inflight.save(str(out) + ".inflight", str(out), {"model": "m"}, {b"x" * 16: ("r0", [state])}) == (1, 3)
    rewrite(str(out), [(0, os.path.getsize(out))])
    binding.compact(str(out), iter([(b"d" * 16, b"k" * 16)]))
    assert victim.read_text() == KEEP
    for name in ("out.jsonl.inflight", "out.jsonl", "out.jsonl.fingerprints"):
        assert not (out.parent / name).is_symlink() and (out.parent / name).is_file()
    assert inflight.read(str(out) + ".inflight", {"model": "m"})[b"x" * 16][1][0].sequences[0].output_ids == [1, 2, 3]
    unmatched = out.parent / "out.jsonl.unmatched.jsonl"
    unmatched.symlink_to(victim)
    with pytest.raises(LinkRefused):
        append_rows(str(out), [(0, os.path.getsize(out))], str(unmatched))
    assert victim.read_text() == KEEP
    leftover = sorted(p.name for p in out.parent.iterdir() if p.name.endswith(".tmp") and not p.is_symlink())
    assert leftover == []


def test_temporary_files_a_crash_left_are_removed_with_the_output_opened(files):
    inp, out, victim = files
    out.write_text("")
    left = out.parent / "out.jsonl.rewrite.ab12cd34.tmp"
    left.write_text("left by a crash\n")
    linked = out.parent / "out.jsonl.inflight.zz99yy88.tmp"
    linked.symlink_to(victim)
    OutputWriter(str(out), str(inp)).close()
    assert not left.exists() and linked.is_symlink() and victim.read_text() == KEEP
