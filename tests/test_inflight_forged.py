"""Issue 53, item 14: an in-flight save is input, not trusted because its checksum matches (anyone
who can write beside the output can compute one). Forged fields (a seed no sampler takes, a
manifest that is not an object, a finished flag on a sample that had not finished), a deflate
bomb and a large file are each named and ignored, and the rerun serves every line in full, with
the text of an uninterrupted run; reading one costs at most the file's size in memory."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
from conftest import REPO, batch_line, read_output
from inprocess import generate

from fastdecode.batch import inflight

LINES = [batch_line(f"s{i}", {"prompt": f"A story about the number {i}:", "max_tokens": 10, "temperature": 0.8,
                              "seed": 40 + i, "ignore_eos": True}) for i in range(3)]
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


def texts(path) -> dict[str, list[str]]:
    return {r["custom_id"]: [c["text"] for c in r["response"]["body"]["choices"]] for r in read_output(path)}


@pytest.fixture(scope="module")
def job(llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forged")
    inp = tmp / "in.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(tmp / "reference.jsonl")])
    assert code == 0
    return tmp, inp, texts(tmp / "reference.jsonl")


def payload_of(path) -> tuple[dict, dict]:
    data = open(path, "rb").read()[len(inflight.MAGIC) + 32:]
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return json.loads(arrays.pop("manifest").tobytes()), arrays


def write_forged(path, manifest, arrays) -> None:
    """A save with these contents and a checksum that matches them, as a forger would write it."""
    buf = io.BytesIO()
    np.savez(buf, manifest=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
    payload = buf.getvalue()
    with open(path, "wb") as f:
        f.write(inflight.MAGIC + hashlib.sha256(payload).digest() + payload)


def first_request(manifest) -> dict:
    return next(r for line in manifest["lines"] for r in line["requests"] if r is not None)


def set_seed(value):
    def edit(manifest, arrays):
        first_request(manifest)["seed"] = value
        return manifest, arrays
    return edit


def as_list(manifest, arrays):
    return [manifest], arrays


def finished_early(manifest, arrays):
    seq = next(s for line in manifest["lines"] for r in line["requests"] if r for s in r["sequences"]
               if s["finish_reason"] is None)
    seq["finish_reason"] = "length"
    return manifest, arrays


def stopped_then_forged(llm, job, name, edit, capfd):
    tmp, inp, reference = job
    out = tmp / f"{name}.jsonl"
    saved = tmp / f"{name}.jsonl.inflight"
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)], stop_at=4)
    assert code == 75 and saved.exists()
    write_forged(saved, *edit(*payload_of(saved)))
    capfd.readouterr()
    _, rep, code = generate(llm.engine, ["-i", str(inp), "-o", str(out)])
    err = capfd.readouterr().err
    assert code == 0 and rep["state"] == "done", err[-2000:]
    assert texts(out) == reference                       # every row whole, as an uninterrupted run
    return err, rep


@pytest.mark.parametrize("name,edit,why", [
    ("seed-2-70", set_seed(2 ** 70), "seed 1180591620717411303424 is not an integer in [0, 9223372036854775807]"),
    ("seed-minus-1", set_seed(-1), "seed -1 is not an integer in [0, 9223372036854775807]"),
    ("seed-a-string", set_seed("7"), "seed '7' is not an integer"),
    ("manifest-a-list", as_list, "its manifest is a JSON list, not an object"),
])
def test_a_forged_save_with_a_valid_checksum_is_named_and_ignored(llm, job, name, edit, why, capfd):
    err, rep = stopped_then_forged(llm, job, name, edit, capfd)
    assert f"{name}.jsonl.inflight: ignored, not trusted (" in err and why in err, err[-2000:]
    assert rep["this_run"]["continued_sequences"] == 0


def test_a_forged_finished_flag_does_not_cut_a_row_short(llm, job, capfd):
    err, rep = stopped_then_forged(llm, job, "finished-early", finished_early, capfd)
    assert "do not fit its request" in err and "saved as finished (length) where its tokens do not finish it so" in err


# ---------------------------------------------------------------------------- bounded reading

def peak_rss_reading(path) -> tuple[int, int, str]:
    """(RSS before, peak RSS while reading `path` as a save; the reason it gave), in a process of
    its own whose peak is reset first (/proc/self/clear_refs), so that imports do not count."""
    code = textwrap.dedent(f"""
        from fastdecode.batch import inflight

        def kib(field):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                              # the peak (VmHWM) starts again from here
        before = kib("VmRSS")
        try:
            inflight.read({str(path)!r}, {{}})
            why = "trusted"
        except Exception as e:
            why = f"{{type(e).__name__}}: {{e}}"
        print(before, kib("VmHWM"), why)""")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after, why = proc.stdout.split(" ", 2)
    return int(before) << 10, int(after) << 10, why.strip()


def write_save(path, members) -> None:
    """A save whose archive holds `members` (name -> (compression, bytes or a count of zero bytes))."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, (method, data) in members.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            with z.open(info, "w", force_zip64=True) as m:
                if isinstance(data, int):
                    header = io.BytesIO()
                    np.lib.format.write_array_header_1_0(header, {"descr": "<i8", "fortran_order": False,
                                                                  "shape": (data // 8,)})
                    m.write(header.getvalue())
                    zeros = bytes(1 << 20)
                    for _ in range(data >> 20):
                        m.write(zeros)
                else:
                    m.write(data)
    payload = buf.getvalue()
    with open(path, "wb") as f:
        f.write(inflight.MAGIC + hashlib.sha256(payload).digest() + payload)


def npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


MANIFEST = npy(np.frombuffer(json.dumps({"format": inflight.FORMAT, "version": inflight.VERSION,
                                          "lines": []}).encode(), np.uint8))


def test_a_deflate_bomb_is_refused_before_it_is_inflated(tmp_path):
    path = tmp_path / "bomb.jsonl.inflight"
    write_save(path, {"manifest.npy": (zipfile.ZIP_STORED, MANIFEST), "tokens.npy": (zipfile.ZIP_DEFLATED, 768 << 20)})
    assert path.stat().st_size < 4 << 20
    before, after, why = peak_rss_reading(path)
    assert "tokens.npy is compressed" in why, why
    assert after - before < 64 << 20, (before, after)


def test_a_large_save_costs_no_more_than_its_size(tmp_path):
    size = 256 << 20
    path = tmp_path / "large.jsonl.inflight"
    write_save(path, {"manifest.npy": (zipfile.ZIP_STORED, MANIFEST), "tokens.npy": (zipfile.ZIP_STORED, size)})
    before, after, why = peak_rss_reading(path)
    assert "more tokens than its manifest lists" in why, why
    assert after - before < size * 1.3, (before, after)


@pytest.mark.parametrize("header,why", [
    ({"descr": "<i8", "fortran_order": False, "shape": (1 << 40,)}, "promises 1099511627776 values"),
    ({"descr": "|O", "fortran_order": False, "shape": (1,)}, "not numbers"),
])
def test_an_array_header_that_promises_more_than_it_holds_is_refused(tmp_path, header, why):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    path = tmp_path / "header.jsonl.inflight"
    write_save(path, {"manifest.npy": (zipfile.ZIP_STORED, MANIFEST),
                      "tokens.npy": (zipfile.ZIP_STORED, buf.getvalue() + bytes(64))})
    with pytest.raises(inflight.Untrusted, match=why):
        inflight.read(str(path), {})
