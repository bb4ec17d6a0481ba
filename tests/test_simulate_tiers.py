"""`fastdecode simulate` with the S-worker's own KV tier: a GPU-only engine's step and capacity,
the tier's attention on the S side of a hybrid step, placement across the tiers as the engine's
(speeds, the learnt S-part base, a CPU store taking only overflow at first), against hand-worked
cases; numba against plain Python; the command line's --rworkers 0."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fastdecode.sim.cli import simulate_args
from fastdecode.sim.core import SimConfig, simulate
from fastdecode.sim.costs import costs_of
from fastdecode.sim.kernel import decode_step
from fastdecode.sim.trace import Trace
from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile, stated_tier
from fastdecode.sizing.schema import (
    MODEL_PRESETS,
    LinkProfile,
    ModelDims,
    Profile,
    RWorkerProfile,
    SWorkerProfile,
    TierProfile,
)

S_LAYER, HEAD, PREFILL_TOKEN = 2e-3, 1e-3, 5e-5
LAYERS, KVB = 4, 2 * 2 * 64 * 2            # the toy model: 4 layers, 2 KV heads x 64, bf16: 512 B per token-layer
TIER_SPB, TIER_CALL, R_SPB = 1e-9, 3e-5, 1e-8


def profile(rworkers: int = 1, tier_tokens: float = 1e9, kind: str = "device", bandwidth: float = 1e30,
            latency: float = 0.0, hop: float = 0.0) -> Profile:
    """An S-part of S_LAYER per layer at any batch, HEAD per step, PREFILL_TOKEN per prompt token;
    R-workers at R_SPB seconds per KV byte, no call overhead; a tier at TIER_SPB plus TIER_CALL per
    call holding `tier_tokens` tokens of every layer."""
    model = ModelDims("toy", LAYERS, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)
    sw = SWorkerProfile("gpu:toy", batch_grid=[1, 4096], layer_time_s=[S_LAYER] * 2, head_time_s=[HEAD] * 2,
                        prefill_prompt_len=[1, 100_000], prefill_token_s=[PREFILL_TOKEN] * 2)
    rw = [RWorkerProfile(f"r{i}", R_SPB, 0.0, 1e12) for i in range(rworkers)]
    tier = TierProfile("device (toy)", TIER_SPB, TIER_CALL, tier_tokens * LAYERS * KVB, kind=kind)
    return Profile(model, sw, rw, LinkProfile(latency_s=latency, bandwidth_Bps=bandwidth, hop_s=hop), device_tier=tier)


def fixed(n: int, prompt: int, gen: int, arrival=None) -> Trace:
    return Trace(np.full(n, prompt, np.int64), np.full(n, gen, np.int64), np.full(n, gen, np.int64),
                 np.zeros(n) if arrival is None else np.asarray(arrival, np.float64))


def run(prof: Profile, trace: Trace, rworkers: int, **cfg):
    cfg = SimConfig(**{"max_batch": 64, "rworkers": rworkers, "depth": 1, **cfg})
    return simulate(costs_of(prof, rworkers, cfg.max_batch), trace, cfg)


def test_gpu_only_step_is_the_s_part_then_the_tiers_attention_every_layer():
    """No R-worker: each layer is the S-part, then the tier's call and its reads of every row's
    KV (prompt + the tokens so far), one after the other on the S-worker; nothing on the link."""
    batch, prompt, gen = 8, 64, 6
    sim = run(profile(rworkers=0), fixed(batch, prompt, gen), rworkers=0)
    st = sim.steps
    for k, got in enumerate(st["decode_s"]):
        tier = TIER_CALL + batch * (prompt + 1 + k) * KVB * TIER_SPB
        assert got == pytest.approx(LAYERS * (S_LAYER + tier) + HEAD, rel=1e-12)
        assert st["tier_busy_s"][k] == pytest.approx(LAYERS * tier, rel=1e-12)
        assert st["tier_kv_tokens"][k] == batch * (prompt + 1 + k)
    assert st["r_busy_s"].shape == (gen - 1, 0) and st["link_out_s"].sum() == 0
    assert st["s_time_s"][0] == pytest.approx(LAYERS * (S_LAYER + TIER_CALL + batch * (prompt + 1) * KVB * TIER_SPB)
                                              + HEAD, rel=1e-12)           # the S-worker is busy with its tier too


def test_gpu_only_batch_is_what_the_tier_holds():
    """A tier of 3 worst cases (prompt + max_tokens = 64 tokens, two pages) runs 3 at a time."""
    sim = run(profile(rworkers=0, tier_tokens=3 * 64), fixed(9, 48, 16), rworkers=0, max_batch=8)
    assert sim.steps["active"].max() == 3 and sim.steps["tokens"].sum() == 9 * 16


def test_hybrid_layer_sends_the_r_rows_then_attends_the_tiers():
    """Depth 1, two rows on the R-worker and two on the tier, a slow link: per layer the S-part,
    then the R-rows' Q, K, V out, their attention and O back (with the hand-off) while the
    S-worker attends its tier's rows: s + max(t, out + r + back + hop). Only the R-rows cross."""
    prof = profile(rworkers=1, bandwidth=1e8, latency=1e-4, hop=2e-4)
    c = costs_of(prof, 1, 8)
    kv = np.array([100, 100, 100, 100])
    worker = np.array([0, 0, 1, 1])                              # 1: the tier
    res = decode_step(kv, kv.astype(float), np.arange(4), worker, 1, 2, 3, c.s_table, 0.0, c.r_token_s, c.r_call_s,
                      c.out_bytes_row, c.back_bytes_row, c.link, c.msg_bytes, c.msg_time, 1)
    m = prof.model
    out = 1e-4 + 2 * m.to_rworker_bytes_per_token() / 1e8        # two rows of Q, K, V: 3.3 ms
    back = 1e-4 + 2 * m.from_rworker_bytes_per_token() / 1e8
    r = 2 * 100 * KVB * R_SPB
    t = TIER_CALL + 2 * 100 * KVB * TIER_SPB
    layer = S_LAYER + max(t, out + r + back + 2e-4)
    assert res[0] == pytest.approx(3 * layer, rel=1e-12)
    assert res[2] == pytest.approx(3 * out, rel=1e-12)           # the link carries the R-rows only
    assert res[1] == pytest.approx(3 * (S_LAYER + t), rel=1e-12)
    assert (res[4], res[5]) == pytest.approx((3 * r, 3 * t), rel=1e-12)
    # a free link, a short row on the R-worker and three long ones on the tier: s + t
    fast = costs_of(profile(rworkers=1), 1, 8)
    kv = np.array([10, 1000, 1000, 1000])
    res = decode_step(kv, kv.astype(float), np.arange(4), np.array([0, 1, 1, 1]), 1, 2, 3, fast.s_table, 0.0,
                      fast.r_token_s, fast.r_call_s, fast.out_bytes_row, fast.back_bytes_row, fast.link,
                      fast.msg_bytes, fast.msg_time, 1)
    r, t = 10 * KVB * R_SPB, TIER_CALL + 3000 * KVB * TIER_SPB       # 0.05 ms, 1.57 ms
    assert res[0] == pytest.approx(3 * (S_LAYER + t), rel=1e-12)


def test_placement_learns_the_s_part_before_weighing_the_tier():
    """As the engine: before any decode step the device tier's base is 0, so the first sequence
    goes there (its reads at 10x an R-worker's speed); after the first step the base is that step's
    S-part (4 x 2 ms + 1 ms = 9 ms). Without the balance rule a second sequence goes to the
    R-worker, where its own part ends sooner (108 tokens at 48.8 k tokens/s = 2.2 ms, against 9 ms +
    216 tokens at 488 k/s); with it (the default), to the tier: at depth 1 the S-worker waits for
    the R-worker's 2.2 ms, while the tier's rows add 0.2 ms to the step."""
    sim = run(profile(rworkers=1), fixed(2, 100, 16, arrival=[0.0, 1e-9]), rworkers=1, balance=False)
    st = sim.steps
    assert st["kv_tokens"][0, 0] == 0 and st["tier_kv_tokens"][0] == 101           # step 1: A on the tier
    assert st["kv_tokens"][1, 0] == 101 and st["tier_kv_tokens"][1] == 102          # step 2: B on the R-worker
    st = run(profile(rworkers=1), fixed(2, 100, 16, arrival=[0.0, 1e-9]), rworkers=1).steps
    assert st["kv_tokens"][:2, 0].tolist() == [0, 0] and st["tier_kv_tokens"][:2].tolist() == [101, 203]
    # a CPU S-worker's own store takes only what the R-workers cannot hold until a step has timed the S-part
    sim = run(profile(rworkers=1, kind="local"), fixed(2, 100, 16, arrival=[0.0, 1e-9]), rworkers=1)
    assert sim.steps["kv_tokens"][0, 0] == 101 and sim.steps["tier_kv_tokens"][0] == 0


def test_numba_and_plain_python_agree_with_a_tier():
    pytest.importorskip("numba")
    from fastdecode.sim.trace import synthetic_trace
    gpu, model = GPU_PRESETS["h100"], MODEL_PRESETS["llama-3-8b"]
    prof = stated_profile(gpu, model, 100.0, 64.0, link_bw_GBps=5.0, device_tier=stated_tier(gpu, model, 4.0))
    trace = synthetic_trace(200, "uniform:16:600", "lognormal:60:0.8", max_tokens=200, rate=40.0, seed=4)
    runs = [simulate(costs_of(prof, 2, 96), trace, SimConfig(rworkers=2, max_batch=96, schedule="stabilized",
                                                              use_numba=use)) for use in (True, False)]
    a, b = runs
    for key in a.steps:
        assert np.array_equal(a.steps[key], b.steps[key]), key
    assert a.steps["tier_kv_tokens"].max() > 0 and a.steps["kv_tokens"].max() > 0      # both tiers used


def test_simulate_command_runs_a_gpu_only_engine(capsys):
    from fastdecode.cli import build_parser
    args = build_parser().parse_args(["simulate", "--model", "llama-3-8b", "--gpu-profile", "h100", "--rworkers", "0",
                                      "--requests", "60", "--prompt-len", "256", "--output-len", "32"])
    doc = simulate_args(args)
    s = doc["summary"]
    assert s["requests_finished"] == 60 and s["tier_kv_share"] == 1.0
    assert s["utilisation"]["r_workers"] == [] and s["utilisation"]["device_tier"] > 0
    assert doc["setting"]["rworkers"] == 0 and doc["setting"]["device_tier"]["kind"] == "device"
    json.dumps(doc)                                          # the document is plain JSON
    args = build_parser().parse_args(["simulate", "--model", "llama-3-8b", "--gpu-profile", "h100", "--cpu-bw", "100",
                                      "--rworkers", "0", "--no-device-kv", "--requests", "4"])
    from fastdecode.sim.cli import run as run_cli
    assert run_cli(args) == 2 and "--rworkers 0 needs" in capsys.readouterr().err
