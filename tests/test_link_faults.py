"""Link faults between emulated nodes (docs/emulated_nodes.md): a partition (rank 1's fabric link
taken down mid-job) ends the job within --timeout naming the rank, exit 75, finished rows kept,
and the rerun with the link back completes; a link slowed 100x mid-job slows the job and loses
nothing. Every job runs under a subprocess timeout: none can hang the suite."""
from __future__ import annotations

import json
import time

import pytest
from conftest import batch_line, read_output
from emulated import delta, emulated_cluster, needs_emulated_nodes

N_LINES, MAX_TOKENS = 8, 8
TIMEOUT_S = 5
# after --timeout: rank 0's wait polls (50 ms), abort_job's pause (0.5 s) and Hydra's teardown
# of the ranks through the management network (about a second), on a machine shared with others
SLACK_S = 15
RATE, SLOW_RATE = "200mbit", "2mbit"     # a 100x slowdown, slow enough to bound this machine's steps
SLOW_RATE_BIT, TBF_BURST = 2 * 10**6, 16 << 10     # netns_links.qdisc_args: burst of a slow tbf

cluster = emulated_cluster("tf", 3, "--rate", RATE)
pytestmark = needs_emulated_nodes


@pytest.fixture(scope="module")
def requests_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "in.jsonl"
    path.write_text("".join(batch_line(f"r{i}", {"prompt": f"Count to {i}:", "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, "ignore_eos": True}) + "\n"
                            for i in range(N_LINES)))
    return path


def generate(cluster, inp, out, timeout_s: float, ranks: int = 3) -> list[str]:
    return cluster.fastdecode(["generate", "-i", str(inp), "-o", str(out), "--quiet", "--max-batch", "2",
                               "--timeout", str(timeout_s)], ranks=ranks)


def texts(out) -> dict[str, str]:
    rows = read_output(str(out))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    assert len({r["custom_id"] for r in rows}) == len(rows)
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows}


@pytest.fixture(scope="module")
def unshaped(cluster, requests_file, tmp_path_factory):
    """The reference: the same job over the same links, nothing happening to them; its rows' texts
    and the seconds from its second row to its end (the part the faults act on)."""
    out = tmp_path_factory.mktemp("reference") / "out.jsonl"
    job = cluster.start(generate(cluster, requests_file, out, 60))
    try:
        wait_rows(job, out, 2)
        t0 = time.monotonic()
        _, err = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err[-3000:]
    got = texts(out)
    assert sorted(got) == sorted(f"r{i}" for i in range(N_LINES))
    return got, time.monotonic() - t0


def wait_rows(job, out, n: int, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while (not out.exists() or out.read_bytes().count(b"\n") < n) and job.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None and out.read_bytes().count(b"\n") >= n, "the job ended (or stalled) before it wrote rows"


def test_a_partitioned_rworker_ends_the_job_naming_it_and_the_rerun_completes(cluster, requests_file, unshaped,
                                                                             tmp_path):
    out = tmp_path / "out.jsonl"
    job = cluster.start(generate(cluster, requests_file, out, TIMEOUT_S))
    try:
        wait_rows(job, out, 2)
        cluster.link(1, "down")
        t0 = time.monotonic()
        _, err = job.communicate(timeout=TIMEOUT_S + 120)
        took = time.monotonic() - t0
    finally:
        if job.poll() is None:
            job.kill()
        cluster.link(1, "up")
    assert job.returncode == 75, (job.returncode, err[-3000:])
    assert took < TIMEOUT_S + SLACK_S, f"the job outlived the partition by {took:.1f} s (--timeout {TIMEOUT_S})"
    assert f"no reply from rank 1 (R-worker on fd-{cluster.name}-n1) within {TIMEOUT_S} s" in err, err[-3000:]
    report = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert report["state"] == "failed" and report["failed_rank"] == 1 and report["exit_code"] == 75, report
    kept = texts(out)
    assert 2 <= len(kept) < N_LINES and all(kept[k] == unshaped[0][k] for k in kept)

    again = cluster.run(generate(cluster, requests_file, out, 60), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["custom_id"] for r in read_output(str(out))] == [f"r{i}" for i in range(N_LINES)]
    assert texts(out) == unshaped[0]


def test_a_link_slowed_100x_mid_job_slows_it_and_loses_nothing(cluster, requests_file, unshaped, tmp_path):
    # rank 1 the only R-worker: with two, the balance rule may place every sequence on rank 2 (which
    # one learns the faster on a shared machine is chance), and nothing would cross the slowed link
    out = tmp_path / "out.jsonl"
    job = cluster.start(generate(cluster, requests_file, out, 60, ranks=2))
    try:
        wait_rows(job, out, 2)
        cluster.shape(1, "--rate", SLOW_RATE)
        before, t0 = cluster.counters(), time.monotonic()
        _, err = job.communicate(timeout=300)
        took, after = time.monotonic() - t0, cluster.counters()
    finally:
        if job.poll() is None:
            job.kill()
        cluster.shape(1, "--rate", RATE)
    assert job.returncode == 0, (job.returncode, err[-3000:])
    assert texts(out) == unshaped[0]
    # what crossed rank 1's slowed link after the change cannot have crossed faster than its rate
    # (plus one burst): the link, not the compute, bounded the rest of this job
    moved = max(delta(before, after, 1, "fabric").values())
    link_bound_s = (moved - TBF_BURST) * 8 / SLOW_RATE_BIT
    assert link_bound_s > unshaped[1], ("the unshaped job's rest took longer than the slowed link's bound: "
                                        "too little crossed it to tell (a longer job, a slower rate)")
    assert took >= link_bound_s, (took, link_bound_s)
    held = after[1]["shaper"]
    assert held["to_node"]["overlimits"] > 0 or held["from_node"]["overlimits"] > 0, held
