"""The command line's habits, round two: vLLM's flag names as aliases or refusals naming why, a
"did you mean" that names the flag with that meaning, the error line first and alone, pipes both
ways (-i -, -o -, /dev/stdout through a pipe, a FIFO, /dev/zero), a UTF-8 BOM, whole lines and
`Throughput:` last under mpiexec, one MPI rank saying it runs local mode."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

import pytest
from conftest import MPIEXEC, REPO, batch_line, read_output, run_fastdecode

from fastdecode.cli import build_parser


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


LINES = [batch_line(f"r{i}", {"prompt": f"Item {i}: the", "max_tokens": 3, "temperature": 0}) for i in range(3)]


@pytest.fixture
def three(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(line + "\n" for line in LINES))
    return path


# ---------------------------------------------------------------------------- flags

def test_vllm_flag_names_are_aliases():
    args = parse(["generate", "-i", "a", "-o", "b", "--max-num-seqs", "7", "--no-enable-prefix-caching"])
    assert args.max_batch == 7 and args.prefix_sharing is False
    args = parse(["generate", "-i", "a", "-o", "b", "--revision", "v2", "--tokenizer", "org/tok"])
    assert (args.revision, args.tokenizer) == ("v2", "org/tok")


def test_did_you_mean_names_the_flag_with_that_meaning(capsys):
    err = usage_error(["generate", "-i", "a", "-o", "b", "--kv-cache-dtype", "bf16"], capsys)
    assert "unrecognized arguments: --kv-cache-dtype bf16; did you mean --kv-dtype?" in err, err
    err = usage_error(["generate", "-i", "a", "-o", "b", "--max-nun-seqs", "4"], capsys)
    assert "did you mean --max-num-seqs?" in err and "--max-n?" not in err, err
    err = usage_error(["generate", "-i", "a", "-o", "b", "--enable-chunked-prefill"], capsys)
    assert "did you mean --max-num-batched-tokens?" in err, err


def test_the_error_line_comes_first_and_alone(capsys):
    err = usage_error(["generate", "-i", "a", "-o", "b", "--no-such-flag"], capsys)
    lines = err.strip().splitlines()
    assert lines[0].startswith("fastdecode generate: error: unrecognized arguments: --no-such-flag"), err
    assert len(lines) == 2 and "`fastdecode generate --help` lists the options" in lines[1], err
    assert "usage:" not in err


@pytest.mark.parametrize("flag, needle", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2 needs 2 MPI ranks for the S-worker, and the job has 1"),
    (["--gpu-memory-utilization", "1.5"], "expected a fraction in (0, 1], got '1.5'"),
    (["--quantization", "int4"], "argument --quantization/-q: invalid choice: 'int4'"),
    (["--trust-remote-code"], "--trust-remote-code is not supported by fastdecode: fastdecode runs its own"),
    (["--enforce-eager", "--cuda-graphs"], "--enforce-eager contradicts --cuda-graphs"),
])
def test_vllm_flags_without_a_meaning_exit_2_naming_why(three, tmp_path, flag, needle):
    proc = run_fastdecode(["generate", "-i", str(three), "-o", str(tmp_path / "o.jsonl"), *flag], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"fastdecode: error: {needle}" or needle in proc.stderr.strip().splitlines()[0], \
        proc.stderr
    # argparse's own refusals add the one hint line; fastdecode's checks say it in one
    assert proc.stderr.strip().splitlines()[1:] in ([], ["fastdecode generate: `fastdecode generate --help` lists "
                                                         "the options"]), proc.stderr


def test_vllm_flags_at_their_defaults_are_accepted():
    from fastdecode.vllm_args import check_flags
    args = parse(["generate", "-i", "a", "-o", "b", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
                  "--pipeline-parallel-size", "1", "--enforce-eager"])
    assert check_flags(args) is None


# ---------------------------------------------------------------------------- pipes

def fastdecode_cmd(args: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return [sys.executable, "-m", "fastdecode", *args], env


def test_stdin_in_stdout_out(three, tmp_path):
    cmd, env = fastdecode_cmd(["generate", "-i", "-", "-o", "-", "--quiet"])
    work, scratch = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    proc = subprocess.run(cmd, input=three.read_bytes(), capture_output=True, env=env, cwd=work, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    rows = [line for line in proc.stdout.decode().splitlines()]
    assert [__import__("json").loads(r)["custom_id"] for r in rows] == ["r0", "r1", "r2"]     # only rows, in order
    err = proc.stderr.decode()
    assert err.strip().splitlines()[-1].startswith("Throughput:")         # the report went to stderr
    assert os.listdir(work) == [] and os.listdir(scratch) == []           # no '-' file, no summary, no scratch


def test_stdin_into_a_file_resumes_on_the_rerun(three, tmp_path):
    """-i - spools stdin to a new scratch file each run; the output is bound to stdin ("-"), not to
    that file: the rerun with the same lines finds them answered (not another input), and one with
    a line changed serves that line alone again."""
    out = tmp_path / "out.jsonl"
    cmd, env = fastdecode_cmd(["generate", "-i", "-", "-o", str(out), "--quiet"])
    first = subprocess.run(cmd, input=three.read_bytes(), capture_output=True, env=env, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr.decode()[-2000:]
    again = subprocess.run(cmd, input=three.read_bytes(), capture_output=True, env=env, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert "already answered" in again.stderr.decode()
    changed = LINES[:2] + [batch_line("r2", {"prompt": "Item 2: a different", "max_tokens": 3, "temperature": 0})]
    third = subprocess.run(cmd, input="".join(x + "\n" for x in changed).encode(), capture_output=True, env=env,
                           cwd=tmp_path, timeout=300)
    assert third.returncode == 0, third.stderr.decode()[-2000:]
    assert [r["custom_id"] for r in read_output(str(out))] == ["r0", "r1", "r2"]


def test_summary_of_stdout_rows_goes_to_a_named_file(three, tmp_path):
    summary = tmp_path / "run.json"
    cmd, env = fastdecode_cmd(["generate", "-i", str(three), "-o", "-", "--quiet", "--summary-json", str(summary)])
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert len(proc.stdout.decode().splitlines()) == 3
    assert __import__("json").loads(summary.read_text())["state"] == "done"


def test_dev_stdout_through_a_pipe_is_stdout_and_writes_nothing_into_dev(three, tmp_path):
    before = set(os.listdir("/dev"))
    cmd, env = fastdecode_cmd(["generate", "-i", str(three), "-o", "/dev/stdout", "--quiet"])
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert "Traceback" not in proc.stderr.decode()
    assert len(proc.stdout.decode().splitlines()) == 3
    assert set(os.listdir("/dev")) == before


def test_dev_stderr_on_a_pipe_is_refused_with_exit_2(three, tmp_path):
    cmd, env = fastdecode_cmd(["generate", "-i", str(three), "-o", "/dev/stderr"])
    proc = subprocess.run(cmd, capture_output=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and b"is not a regular file" in proc.stderr and b"Traceback" not in proc.stderr


def test_a_fifo_is_read_and_dev_zero_is_named(three, tmp_path):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "wb") as f:
            f.write(three.read_bytes())
    writer = threading.Thread(target=feed)
    writer.start()
    out = tmp_path / "out.jsonl"
    proc = run_fastdecode(["generate", "-i", str(fifo), "-o", str(out), "--quiet"], timeout=300)
    writer.join(timeout=10)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["custom_id"] for r in read_output(out)] == ["r0", "r1", "r2"]
    proc = run_fastdecode(["generate", "-i", "/dev/zero", "-o", str(out)], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("fastdecode: error: input /dev/zero is a character device, not a file: give a "
                                   "JSONL file, or - (stdin) or a pipe"), proc.stderr


def test_a_utf8_bom_does_not_cost_line_1(tmp_path):
    from fastdecode.batch.jsonl import read_lines
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\n" for line in LINES).encode())
    lines = list(read_lines(str(path)))
    assert [(line.line_no, line.custom_id, line.error) for line in lines] == [(1, "r0", None), (2, "r1", None),
                                                                             (3, "r2", None)]


# ---------------------------------------------------------------------------- whole lines, mpirun

def test_whole_lines_write_a_line_at_once(monkeypatch):
    from fastdecode.launch.streams import whole_lines

    class Raw(io.RawIOBase):
        def __init__(self):
            self.writes = []

        def writable(self):
            return True

        def write(self, b):
            self.writes.append(bytes(b))
            return len(b)
    raw = Raw()
    stream = io.TextIOWrapper(raw, write_through=True)           # as PYTHONUNBUFFERED makes stderr
    monkeypatch.setattr(sys, "stderr", stream)
    print("before", file=sys.stderr)
    assert raw.writes == [b"before", b"\n"]                        # two pieces: another line can land between
    raw.writes.clear()
    whole_lines()
    print("fastdecode: a line", file=sys.stderr)
    print("Throughput: 1 requests/s", file=sys.stderr)
    assert raw.writes == [b"fastdecode: a line\n", b"Throughput: 1 requests/s\n"]


def test_under_mpiexec_lines_are_whole_and_throughput_comes_last(three, tmp_path):
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    cmd, env = fastdecode_cmd(["generate", "-i", str(three), "-o", str(tmp_path / "o.jsonl"),
                               "--progress-interval", "0.2"])
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run([MPIEXEC, "-n", "3", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                          cwd=REPO, timeout=300)
    text = proc.stdout.decode()
    assert proc.returncode == 0, text[-3000:]
    lines = [line for line in text.splitlines() if line.strip()]
    assert all(line.startswith(("fastdecode: ", "Throughput: ")) for line in lines), text[-3000:]
    assert sum("Throughput:" in line for line in lines) == 1 and lines[-1].startswith("Throughput: "), text[-3000:]


def test_one_mpi_rank_says_it_runs_local_mode(three, tmp_path):
    if MPIEXEC is None:
        pytest.skip("no MPI launcher")
    proc = run_fastdecode(["generate", "-i", str(three), "-o", str(tmp_path / "o.jsonl")], ranks=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fastdecode: one MPI rank: local mode, the R-part runs in this process (no R-workers)" in proc.stderr
    alone = run_fastdecode(["generate", "-i", str(three), "-o", str(tmp_path / "p.jsonl")], timeout=300)
    assert alone.returncode == 0 and "one MPI rank" not in alone.stderr
