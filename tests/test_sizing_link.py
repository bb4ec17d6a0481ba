"""The S<->R link in the sizing model: the fit of a measured table, each R-worker's own link, the
S-worker's path to all of them, link-bound layers against hand-computed values, and what plan
says about the link (text and JSON)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastdecode.sizing import plan
from fastdecode.sizing.link import S_PATH, fit_link, mini_batch_link
from fastdecode.sizing.link_report import link_report
from fastdecode.sizing.model import predict
from fastdecode.sizing.profile import profile_link
from fastdecode.sizing.schema import LinkProfile, ModelDims, Profile, RWorkerProfile, SWorkerProfile

# 2 layers; Q, K, V out (4 + 2·2 heads x 64 x 2 B) = 1024 B per token, O back 4 x 64 x 2 = 512 B
DIMS = ModelDims(name="hand", num_layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512,
                 vocab=1000, dtype_bytes=2)
OUT, BACK = 1024, 512
SIZES = [64, 1 << 20, 4 << 20]


def table(latency_s: float, bandwidth: float) -> list[float]:
    return [latency_s + b / bandwidth for b in SIZES]


def two_worker_link(concurrent_Bps: float) -> LinkProfile:
    """R-worker "fast" at 1 GB/s, "slow" at 0.25 GB/s, 10 us each; the headline is the slow one's."""
    rows = [table(10e-6, 1e9), table(10e-6, 0.25e9)]
    return LinkProfile(10e-6, 0.25e9, message_bytes=SIZES, message_time_s=rows[1], worker_names=["fast", "slow"],
                       worker_message_time_s=rows, worker_latency_s=[10e-6, 10e-6],
                       worker_bandwidth_Bps=[1e9, 0.25e9], concurrent_Bps=concurrent_Bps)


def flat_profile(link: LinkProfile, workers: int = 1) -> Profile:
    """S-part 2 us per sequence and layer (1 ms at B = 500, linear in B: a mini-batch's load
    k·T(B/k) is T(B) at every depth), no LM head; R-workers so fast that their part is
    negligible (1e15 B/s, no call overhead), memory for any batch."""
    s = SWorkerProfile("hand", [1, 4096], [2e-6, 4096 * 2e-6], [0.0, 0.0])
    r = [RWorkerProfile(f"r{i}", 1e-15, 0.0, 1e15) for i in range(workers)]
    return Profile(model=DIMS, s_worker=s, r_workers=r, link=link)


def test_fit_takes_the_bandwidth_from_big_messages():
    # small messages go eagerly (fast per byte), big ones at 1 GB/s: the slope of the big ones
    sizes = [64, 16 << 10, 256 << 10, 1 << 20, 4 << 20]
    times = [5e-6, 6e-6] + [50e-6 + b / 1e9 for b in sizes[2:]]
    latency, bandwidth = fit_link(sizes, times)
    assert latency == pytest.approx(5e-6)
    assert bandwidth == pytest.approx(1e9)
    assert fit_link([64, 1024], [1e-6, 1e-6])[1] == 1e15          # times that do not grow: no link


def test_each_worker_carries_its_share_and_the_slowest_bounds():
    # 2 R-workers of equal attention bandwidth: each holds half the rows. Mini-batch of 1,000
    # rows: 1,024,000 B out, 512,000 B back, half each. Slow worker: 10 us + 512,000 / 0.25e9
    # = 2.058 ms out, 10 us + 256,000 / 0.25e9 = 1.034 ms back: the chain waits for both, the
    # load is the busier direction (out). S path at 4 GB/s: 10 us + 1,024,000 / 4e9 = 0.266 ms.
    link = two_worker_link(concurrent_Bps=4e9)
    workers = flat_profile(link, 2).r_workers
    got = mini_batch_link(link, workers, 1000 * OUT, 1000 * BACK)
    assert got["by"] == "slow"
    assert got["s"] == pytest.approx(2.058e-3 + 1.034e-3)
    assert got["load"] == pytest.approx(2.058e-3) and got["bytes"] == pytest.approx(512_000)
    # the S-worker's path at 0.4 GB/s to both at once: 10 us + 1,024,000 / 0.4e9 = 2.57 ms bounds
    narrow = mini_batch_link(two_worker_link(concurrent_Bps=0.4e9), workers, 1000 * OUT, 1000 * BACK)
    assert narrow["by"] == S_PATH
    assert narrow["load"] == pytest.approx(10e-6 + 1_024_000 / 0.4e9)
    assert narrow["s"] == pytest.approx(20e-6 + 1_536_000 / 0.4e9)


def test_without_a_concurrent_figure_all_messages_share_the_slowest_path():
    # not measured (stated hardware, an older profile): the whole mini-batch over the slow table
    link = two_worker_link(concurrent_Bps=0.0)
    got = mini_batch_link(link, flat_profile(link, 2).r_workers, 1000 * OUT, 1000 * BACK)
    assert got["by"] == "slow"
    assert got["s"] == pytest.approx(2 * 10e-6 + 1_536_000 / 0.25e9)
    assert got["load"] == pytest.approx(10e-6 + 1_024_000 / 0.25e9)


def test_link_bound_layer_and_what_plan_says_about_it():
    # B = 1000, depth 2: a mini-batch of 500 sends 512,000 B out, 256,000 back; at 0.25 GB/s (no
    # latency) 2.048 ms out, 1.024 ms back, against the S-part's 1 ms. Load: the busier direction,
    # 2 x 2.048 ms; chain 1 + 3.072 ms: layer = max(2 x 1, 2 x 2.048, 1 + 3.072) = 4.096 ms,
    # link-bound. Over a free link the layer is 2 ms: the link adds 2.096 ms a layer.
    prof = flat_profile(LinkProfile(0.0, 0.25e9))
    p = predict(prof, 1000, 64, rworkers=1, depth=2)
    assert p.bound == "link"
    assert p.layer_s == pytest.approx(4.096e-3, rel=1e-6)
    rep = link_report(prof, 1000, 64, 0, 1, 2)
    assert rep["link_next_side"] == "S"
    assert rep["link_over_next"] == pytest.approx(2.048, rel=1e-6)
    assert rep["link_exposed_s"] == pytest.approx(2 * 2.096e-3, rel=1e-6)
    assert rep["link_hidden"] is False
    assert rep["link_hiding_depth"] is None       # its load exceeds the S-part's (2 ms) at every depth
    # balance: 1,024,000 B out per layer in 2 ms of S-part -> 0.512 GB/s
    assert rep["link_balance_Bps"] == pytest.approx(0.512e9, rel=1e-6)


def test_a_link_below_the_other_side_is_hidden_from_depth_two():
    # at 2 GB/s a mini-batch of 500 takes 0.384 ms: depth 1 pays s + link = 2 + 0.768 ms a layer
    # (2 ms over a free link), depth 2 max(2 x 1, 2 x 0.384, 1 + 0.384) = 2 ms, as if free
    prof = flat_profile(LinkProfile(0.0, 2e9))
    flat = link_report(prof, 1000, 64, 0, 1, 1)
    assert flat["link_hidden"] is False
    assert flat["link_exposed_s"] == pytest.approx(2 * 0.768e-3, rel=1e-6)   # depth 1: the whole batch's 0.768 ms
    deep = link_report(prof, 1000, 64, 0, 1, 2)
    assert deep["link_hidden"] is True and deep["link_exposed_s"] == pytest.approx(0.0, abs=1e-12)
    assert flat["link_hiding_depth"] == deep["link_hiding_depth"] == 2


def test_a_latency_above_the_other_side_cannot_balance():
    prof = flat_profile(LinkProfile(2e-3, 1e12))        # 2 ms each way per message, S-part 1 ms
    assert link_report(prof, 10, 64, 0, 1, 2)["link_balance_Bps"] is None


def test_plan_names_the_worker_whose_link_bounds(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(flat_profile(two_worker_link(concurrent_Bps=4e9), 2).to_json())
    args = ["--profile", str(path), "--batch", "1000", "--context", "64", "--rworkers", "2"]
    assert plan.main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bound"] == "link" and out["link_bound_by"] == "slow"
    # per mini-batch of 500 the slow worker carries 250 rows: 256,000 B out, 128,000 back,
    # 10 us + 1.024 ms and 10 us + 0.512 ms; the load is out's, the chain waits for both:
    # layer = max(2 x 1, 2 x 1.034, 1 + 1.556) ms; balance: 512,000 B out per layer in 2 ms of S-part
    assert out["link_layer_s"] == pytest.approx(2 * 1.034e-3, rel=1e-6)
    assert out["layer_s"] == pytest.approx(1e-3 + 1.556e-3, rel=1e-3)
    assert out["link_balance_Bps"] == pytest.approx(512_000 / (2e-3 - 2 * 10e-6), rel=1e-6)
    assert out["link_hiding_depth"] is None
    assert plan.main(args) == 0
    text = capsys.readouterr().out
    assert "the slowest of 2 R-workers' links, slow's" in text
    assert "over slow's link" in text and "no pipeline depth hides it" in text


def test_a_stated_link_replaces_every_workers_table(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(flat_profile(two_worker_link(concurrent_Bps=4e9), 2).to_json())
    assert plan.main(["--profile", str(path), "--batch", "1000", "--context", "64", "--rworkers", "2",
                      "--link-bw", "100", "--link-latency", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["link_bound_by"] == "the link" and out["link_hidden"] is True
    assert out["link_layer_s"] == pytest.approx(2 * 512_000 / 100e9, rel=1e-6)   # 2 mini-batches' out, one path


def test_profile_keeps_every_workers_table_and_the_slowest_heads_it():
    sizes = [64, 1 << 20, 4 << 20]
    rows = [table(5e-6, 2e9), table(8e-6, 0.5e9), table(6e-6, 1e9)]
    together = [1e-3 + 3 * b / 0.6e9 for b in sizes[-2:]]     # the S-worker's path: 0.6 GB/s in all
    backend = SimpleNamespace(ping=lambda s, repeats: rows, ping_all=lambda s, repeats: together,
                              workers=[SimpleNamespace(rank=i + 1, host=f"n{i + 1}", tier="") for i in range(3)])
    link = profile_link(SimpleNamespace(backend=backend, device=torch.device("cpu")), sizes, 1, log=lambda m: None)
    assert link.worker_names == ["rank1@n1", "rank2@n2", "rank3@n3"]
    assert link.worker_message_time_s == rows
    assert link.worker_bandwidth_Bps == pytest.approx([2e9, 0.5e9, 1e9])
    assert link.message_time_s == rows[1] and link.bandwidth_Bps == pytest.approx(0.5e9)
    assert link.latency_s == pytest.approx(8e-6 + 64 / 0.5e9)
    assert link.concurrent_Bps == pytest.approx(0.6e9)
    assert link.worker_name(link.slowest_worker()) == "rank2@n2"
    back = Profile.from_json(flat_profile(link, 3).to_json())
    assert back.link == link


def test_a_profile_whose_worker_tables_do_not_match_is_refused():
    d = flat_profile(two_worker_link(4e9), 2).to_dict()
    d["link"]["worker_message_time_s"][1] = d["link"]["worker_message_time_s"][1][:2]
    with pytest.raises(ValueError, match="every R-worker needs"):
        Profile.from_dict(d)


def test_a_busy_link_runs_at_the_fitted_rate_even_where_the_table_shows_a_burst():
    # a shaper's token bucket passes an isolated 64 KiB message at line rate (0.1 ms in the
    # table) while big messages show the 12.5 MB/s it sustains: the chain takes the table's time,
    # the load at least latency + size / rate (5.24 ms for 64 KiB out)
    sizes, times = [64, 1 << 16, 1 << 20, 4 << 20], [50e-6, 100e-6, 50e-6 + (1 << 20) / 12.5e6, 50e-6 + (4 << 20) / 12.5e6]
    latency, rate = fit_link(sizes, times)
    link = LinkProfile(latency, rate, message_bytes=sizes, message_time_s=times)
    got = mini_batch_link(link, flat_profile(link).r_workers, 1 << 16, 1 << 15)
    assert rate == pytest.approx(12.5e6)
    assert got["s"] == pytest.approx(100e-6 + float(np.interp(1 << 15, sizes, times)))
    assert got["load"] == pytest.approx(50e-6 + (1 << 16) / 12.5e6)
