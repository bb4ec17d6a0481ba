"""`fastdecode plan` under the balance rule: never behind the card alone, and every socket adds.

The stated hardware is the H100 case of issue 49: Llama-3-8B, prompts of ~1k tokens, ~575
generated, 350 GB/s sockets at 75%, a 25 GB/s link."""
from __future__ import annotations

import json

import pytest

from fastdecode.sizing import plan
from fastdecode.sizing.balance import Workload, balanced_predict, best_count, best_per_sockets, sweep
from fastdecode.sizing.model import predict

H100 = ["--model", "llama-3-8b", "--gpu-profile", "h100", "--cpu-bw", "350", "--cpu-eff", "0.75", "--link-bw", "25",
        "--link-latency", "3", "--context", "575", "--prompt-len", "1017"]
# sockets too slow, behind too slow a link, to help this card
SLOW = ["--model", "llama-3-8b", "--gpu-profile", "h100", "--cpu-bw", "30", "--link-bw", "1", "--link-latency", "300",
        "--context", "575", "--prompt-len", "1017"]


def run_plan(capsys, *argv) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *argv) -> dict:
    code, out, err = run_plan(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def h100_profile():
    return plan.build_profile(plan.parse(H100))


# ---- the best per socket count

def test_every_socket_count_does_at_least_what_the_card_alone_does(capsys):
    rows = plan_json(capsys, *H100, "--rworkers", "0", "1", "2", "4")["sockets"]
    assert [r["rworkers"] for r in rows] == [0, 1, 2, 4]
    card = rows[0]
    assert card["rworker_sequences"] == 0 and card["tier_sequences"] == card["tier_capacity_sequences"]
    for r in rows[1:]:
        assert r["tokens_per_s"] >= card["tokens_per_s"]
        if r["tier_sequences"] == r["tier_capacity_sequences"]:        # the tier full: the sockets add
            assert r["tokens_per_s"] > card["tokens_per_s"] and r["rworker_sequences"] > 0
        assert r["over_card_alone_tokens_per_s"] == pytest.approx(r["tokens_per_s"] - card["tokens_per_s"])
        assert not r["card_alone_best"]
    # every socket adds, and each row says by how much over the one before
    for before, after in zip(rows, rows[1:]):
        assert after["tokens_per_s"] > before["tokens_per_s"]
        assert after["adds_tokens_per_s"] == pytest.approx(after["tokens_per_s"] - before["tokens_per_s"])
    assert rows[0]["adds_tokens_per_s"] is None


def test_at_each_batch_and_depth_the_sockets_do_at_least_what_the_card_alone_does(capsys):
    """Not only the best: at every batch both sweeps weigh, at a stated depth, R-workers filled to
    their balance point never lower tokens/s below the card alone's."""
    for depth in ("1", "2"):
        alone = {r["batch"]: r["tokens_per_s"]
                 for r in plan_json(capsys, *H100, "--rworkers", "0", "--pipeline-depth", depth)["sweep"]}
        for sockets in ("1", "4"):
            rows = plan_json(capsys, *H100, "--rworkers", sockets, "--pipeline-depth", depth)["sweep"]
            common = [r for r in rows if r["batch"] in alone]
            assert len(common) >= 8
            for r in common:
                assert r["pipeline_depth"] == min(int(depth), r["batch"])
                assert r["tokens_per_s"] >= alone[r["batch"]] * (1 - 1e-9), (sockets, depth, r["batch"])


def test_best_per_sockets_is_the_best_of_the_sweep_and_the_card_alone_comes_first():
    prof = h100_profile()
    rows = best_per_sockets(prof, [4, 1], 575, 1017)
    assert [r["rworkers"] for r in rows] == [0, 1, 4]               # the card alone added, counts in order
    for r in rows:
        swept = sweep(prof, Workload(575, 1017), r["rworkers"])
        assert r["tokens_per_s"] == pytest.approx(max(p.tokens_per_s for p in swept))
        assert r["pipeline_depth"] in (1, 2) and r["batches_weighed"] == len(swept)
    # a stated depth is kept
    assert {r["pipeline_depth"] for r in best_per_sockets(prof, [1, 4], 575, 1017, depth=2)} == {2}


def test_the_sockets_report_as_a_table(capsys):
    code, out, _ = run_plan(capsys, *H100, "--rworkers", "0", "1", "2", "4", "8", "16")
    assert code == 0
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["R-workers", "tokens/s"])
    table = [line.split() for line in lines[head + 1:head + 7]]
    assert [row[0] for row in table] == ["0", "1", "2", "4", "8", "16"]
    assert table[0][2:4] == ["-", "-"] and all(row[2].startswith("+") for row in table[1:])
    assert "add nothing here" not in out


def test_where_the_card_alone_is_best_plan_says_so(capsys):
    rows = plan_json(capsys, *SLOW, "--rworkers", "0", "4")["sockets"]
    assert rows[1]["card_alone_best"] and rows[1]["rworker_sequences"] == 0
    assert rows[1]["tokens_per_s"] == pytest.approx(rows[0]["tokens_per_s"])
    code, out, _ = run_plan(capsys, *SLOW, "--rworkers", "0", "4")
    assert code == 0
    assert (f"4 R-workers add nothing here: the card alone is best ({rows[0]['tokens_per_s']:,.0f} tokens/s); "
            "the R-workers would take sequences only past their balance point") in out
    code, out, _ = run_plan(capsys, *SLOW, "--rworkers", "1")       # one count: its best, in the same words
    assert code == 0 and "1 R-worker adds nothing here: the card alone is best" in out


# ---- one socket count: the sweep from batch 1 and the balance point

def test_a_single_count_sweeps_from_batch_1_to_memory_and_says_its_best(capsys):
    d = plan_json(capsys, *H100, "--rworkers", "4")
    rows, best = d["sweep"], d["best"]
    batches = [r["batch"] for r in rows]
    assert batches[0] == 1 and rows[0]["batch_run"] == 1 and rows[0]["tokens_per_s"] > 0
    assert d["batch"] == d["knee_batch"] and d["knee_batch"] in batches         # the knee still heads --json
    assert 222 in batches                                                       # where the tier fills
    assert best["batch_run"] in batches                                         # where the R-workers balance
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in rows)
    assert (best["tier_sequences"], best["rworkers"]) == (222, 4) and best["rworker_sequences"] > 0
    # offered more than the balance point, the run stays there: the rest waits, memory is only a cap
    past = [r for r in rows if r["batch"] > best["batch_run"]]
    assert past and all(r["batch_run"] == best["batch_run"] and r["balance_waiting"] > 0 for r in past)
    assert all(r["bound"] != "capacity" for r in past[:-1])
    code, out, _ = run_plan(capsys, *H100, "--rworkers", "4")
    assert code == 0 and f"best: {best['tokens_per_s']:,.0f} tokens/s at batch {best['batch_run']}" in out


def test_a_single_count_with_a_batch_prices_that_batch(capsys):
    d = plan_json(capsys, *H100, "--rworkers", "4", "--batch", "2048")
    assert (d["rworkers"], d["batch"], d["pipeline_depth"]) == (4, 2048, 2)    # generate's depth for one batch
    assert d["tier_sequences"] == 222 and d["balance_waiting"] > 0
    assert d["batch_run"] == d["tier_sequences"] + d["rworker_sequences"] < 2048
    code, out, _ = run_plan(capsys, *H100, "--rworkers", "4", "--batch", "2048")
    assert code == 0 and f"balance: {d['batch_run']:,} sequences run" in out and "wait" in out


# ---- the rule itself

def test_the_balance_rule_cuts_the_rworkers_where_one_more_stops_raising_tokens_per_s():
    prof = h100_profile()
    work = Workload(575, 1017)
    for depth in (1, 2):
        run = balanced_predict(prof, 4096, work, 4, depth)
        placed = predict(prof, 4096, 575, 1017, 4, depth)                       # placement fills memory
        assert run.tokens_per_s > placed.tokens_per_s and run.batch_run < placed.batch_run
        one_more = balanced_predict(prof, run.batch_run + 1, work, 4, depth)
        assert one_more.tokens_per_s <= run.tokens_per_s * (1 + 1e-9)


def test_without_a_tier_every_sequence_memory_holds_runs():
    prof = plan.build_profile(plan.parse([*H100, "--no-device-kv"]))
    for batch in (64, 1024, 8192):
        assert balanced_predict(prof, batch, Workload(575, 1017), 4, 2) == predict(prof, batch, 575, 1017, 4, 2)


def test_best_count_finds_the_peak_and_prefers_fewer_on_a_tie():
    peak = {b: -(b - 37) ** 2 for b in range(101)}
    assert best_count(peak.__getitem__, 0, 100) == 37
    assert best_count(lambda b: b, 0, 100) == 100 and best_count(lambda b: -b, 0, 100) == 0
    assert best_count(lambda b: min(b, 10), 0, 100) == 10


@pytest.mark.parametrize("argv, message", [
    (["--rworkers", "0", "-2"], "--rworkers must be >= 0"),
    (["--pipeline-depth", "0"], "--pipeline-depth must be >= 1"),
])
def test_bad_counts_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run_plan(capsys, *H100, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err
