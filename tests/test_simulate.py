"""`fastdecode simulate`'s timing against hand-worked cases and the sizing model's steady state
(fastdecode/sizing/model.py), its admission against the controllers' own rules, and numba against
the plain-Python loop."""
from __future__ import annotations

import numpy as np
import pytest

from fastdecode.sim.core import SimConfig, simulate, weighted_percentile
from fastdecode.sim.costs import costs_of
from fastdecode.sim.kernel import decode_step, snake_split
from fastdecode.sim.trace import Trace
from fastdecode.sizing.model import layer_times
from fastdecode.sizing.schema import LinkProfile, ModelDims, Profile, RWorkerProfile, SWorkerProfile

S_LAYER, HEAD, PREFILL_TOKEN = 2e-3, 1e-3, 5e-5


def profile(layers=4, spb=1e-9, bandwidth=1e30, latency=0.0, workers=1, hop=0.0, capacity=1e12) -> Profile:
    """A profile whose S-part costs S_LAYER per layer at any batch up to 4096 (flat table), the head
    HEAD per step, prefill PREFILL_TOKEN per prompt token; R-workers `spb` seconds per KV byte, no
    call overhead; a link of `bandwidth` B/s and `latency` s."""
    model = ModelDims("toy", layers, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000)
    sw = SWorkerProfile("cpu:toy", batch_grid=[1, 4096], layer_time_s=[S_LAYER] * 2, head_time_s=[HEAD] * 2,
                        prefill_prompt_len=[1, 100_000], prefill_token_s=[PREFILL_TOKEN] * 2)
    rw = [RWorkerProfile(f"r{i}", seconds_per_kv_byte=spb, call_overhead_s=0.0, capacity_bytes=capacity)
          for i in range(workers)]
    return Profile(model, sw, rw, LinkProfile(latency_s=latency, bandwidth_Bps=bandwidth, hop_s=hop))


def fixed_trace(n: int, prompt: int, gen: int) -> Trace:
    return Trace(np.full(n, prompt, np.int64), np.full(n, gen, np.int64), np.full(n, gen, np.int64), np.zeros(n))


def run(prof, trace, **cfg):
    cfg = SimConfig(**{"max_batch": 64, "rworkers": len(prof.r_workers), **cfg})
    return simulate(costs_of(prof, cfg.rworkers, cfg.max_batch), trace, cfg)


@pytest.mark.parametrize("batch, prompt, gen", [(8, 64, 16), (32, 200, 40)])
def test_depth1_one_rworker_is_the_analytic_chain_every_step(batch, prompt, gen):
    """Depth 1: each layer is S, then R, one after the other; over a fixed batch's life the KV a
    sequence attends averages prompt + S/2 (tokens prompt+1 .. prompt+S-1 over S-1 decode steps),
    as the model's layer_times assumes, so the decode time is (S-1) steps of its layer plus the heads."""
    prof = profile(spb=2e-8)
    sim = run(prof, fixed_trace(batch, prompt, gen), depth=1)
    model = layer_times(prof, batch, gen, prompt, 1, depth=1)
    decode = sim.steps["decode_s"]
    assert decode.size == gen - 1                        # the first token comes from the prefill
    assert decode.sum() == pytest.approx((gen - 1) * (prof.model.num_layers * model["layer"] + HEAD), rel=1e-9)
    assert sim.steps["prefill_s"][0] == pytest.approx(batch * prompt * PREFILL_TOKEN)
    kv_tok = prof.model.kv_bytes_per_token_layer(2)
    first = prof.model.num_layers * (S_LAYER + batch * (prompt + 1) * kv_tok * 2e-8) + HEAD
    assert decode[0] == pytest.approx(first, rel=1e-12)
    wall = sim.steps["t_s"][-1]
    assert wall == pytest.approx(batch * prompt * PREFILL_TOKEN + decode.sum(), rel=1e-12)


def test_depth2_s_bound_is_the_analytic_layer_plus_one_drain():
    """Depth 2, R faster than S: the S-worker never waits within the step, so L layers take
    L x (2 S-parts) = L x the model's layer; the step ends with the heads and the wait for the
    last mini-batch's attention: decode = L*layer + max(head/2, r_mb) + head/2."""
    prof = profile(layers=6, spb=1e-9)
    batch, prompt, gen = 16, 100, 6
    sim = run(prof, fixed_trace(batch, prompt, gen), depth=2)
    kv_tok = prof.model.kv_bytes_per_token_layer(2)
    for k, got in enumerate(sim.steps["decode_s"]):
        r_mb = batch // 2 * (prompt + 1 + k) * kv_tok * 1e-9
        assert r_mb < S_LAYER
        model = layer_times(prof, batch, gen, prompt, 1, depth=2)
        assert model["bound"] == "S" and model["layer"] == pytest.approx(2 * S_LAYER)
        assert got == pytest.approx(6 * model["layer"] + max(HEAD / 2, r_mb) + HEAD / 2, rel=1e-12)


def test_link_bound_layers_cost_the_link_per_direction():
    """A slow link: depth 1 pays S + out + R + back per layer, the model's chain exactly; at depth
    2 each direction of the (full-duplex) link serves both mini-batches per layer, so the steady
    layer is 2 x the Q,K,V message (the busier direction), as the sizing model says too."""
    m = profile().model
    batch, kv = 16, 50
    out_b, back_b = batch // 2 * m.to_rworker_bytes_per_token(), batch // 2 * m.from_rworker_bytes_per_token()
    bw = out_b / (4 * S_LAYER)                  # the Q,K,V of a mini-batch: 4 S-parts; the output: less
    t_out, t_back = out_b / bw, back_b / bw
    assert t_back < t_out

    def decode(layers, depth):
        c = costs_of(profile(layers=layers, bandwidth=bw, spb=1e-12), 1, 64)
        kv_len = np.full(batch, kv, np.int64)
        return decode_step(kv_len, kv_len.astype(float), np.arange(batch), np.zeros(batch, np.int64), depth, 1,
                           layers, c.s_table, 0.0, c.r_token_s, c.r_call_s, c.out_bytes_row, c.back_bytes_row,
                           c.link, c.msg_bytes, c.msg_time)[0]

    per_layer = decode(20, 2) - decode(10, 2)
    assert per_layer / 10 == pytest.approx(2 * t_out, rel=1e-9)
    # (prompt 0: the model's link also carries the prompts' K, V, which this engine sends at prefill)
    model = layer_times(profile(bandwidth=bw, spb=1e-12), batch, 2 * kv, 0, 1, depth=2)
    assert model["bound"] == "link"
    assert model["layer"] == pytest.approx(2 * t_out, rel=1e-3)
    r = batch * kv * m.kv_bytes_per_token_layer(2) * 1e-12            # the whole batch in one call
    chain = S_LAYER + 2 * t_out + 2 * t_back + r                       # depth 1: one message of the batch each way
    assert (decode(20, 1) - decode(10, 1)) / 10 == pytest.approx(chain, rel=1e-9)


def test_snake_split_is_the_engines():
    torch_runner = pytest.importorskip("fastdecode.engine.runner")
    rng = np.random.default_rng(3)
    for n, depth in [(1, 2), (7, 2), (16, 3), (33, 4), (5, 8)]:
        kv = rng.integers(1, 40, n)
        ids = rng.permutation(n) + 10
        mb = snake_split(kv, ids, depth)
        want = torch_runner.split_by_r_load(kv, ids, depth)
        assert [np.flatnonzero(mb == i).tolist() for i in range(len(want))] == [w.tolist() for w in want]


def test_fifo_admits_a_full_batch_when_the_last_one_ends():
    """FIFO with fixed lengths: max_batch start together (one prefill), generate gen tokens (the
    first at prefill, gen-1 decode steps) and the next max_batch start in the step after."""
    gen, batch = 9, 8
    sim = run(profile(), fixed_trace(40, 32, gen), max_batch=batch, schedule="fifo")
    assert sim.admitted_step.tolist() == [1 + (i // batch) * (gen - 1) for i in range(40)]
    assert sim.steps["tokens"].sum() == 40 * gen
    assert sim.steps["active"].max() == batch


def test_stabilized_ramps_in_micro_batches_and_steadies_the_load():
    """The stabilized schedule opens B*F/S slots every F steps instead of B at once, so the ages
    spread and the R-workers' KV load swings less than under FIFO's fixed batches."""
    trace = fixed_trace(400, 32, 64)
    fifo = run(profile(), trace, max_batch=32, schedule="fifo")
    stab = run(profile(), trace, max_batch=32, schedule="stabilized")
    admitted = np.bincount(stab.admitted_step)[1:]
    assert admitted[0] == 32 * 4 // 64                  # F = 64/16 = 4 steps: M = B*F/S = 2
    for sim in (fifo, stab):
        assert sim.steps["tokens"].sum() == 400 * 64 and (sim.finish_s > 0).all()

    def cv(sim):
        kv = sim.steps["kv_tokens"].sum(axis=1)
        mid = kv[len(kv) // 4: 3 * len(kv) // 4]
        return mid.std() / mid.mean()
    assert cv(stab) < 0.5 * cv(fifo)


def test_prefill_budget_splits_admissions_over_steps():
    """--max-prefill-tokens: the first prompt always, then prompts while the chunk stays within it."""
    sim = run(profile(), fixed_trace(6, 100, 4), max_prefill_tokens=250, max_batch=64)
    assert sim.admitted_step.tolist() == [1, 1, 2, 2, 3, 3]
    assert sim.steps["prefill_s"][:3] == pytest.approx([200 * PREFILL_TOKEN] * 3)


def test_arrivals_wait_and_token_gaps_are_the_engines():
    """A request arriving later starts at its arrival; the gap between a sequence's first two tokens is
    the decode of its first step, later ones whole steps (prefills of others included)."""
    trace = Trace(np.array([10, 10]), np.array([3, 3]), np.array([3, 3]), np.array([0.0, 5.0]))
    sim = run(profile(), trace, depth=1)
    st = sim.steps
    assert sim.admitted_step.tolist() == [1, 3]
    assert st["t_s"][2] == pytest.approx(5.0 + 10 * PREFILL_TOKEN + st["decode_s"][2])
    gaps = np.repeat(sim.gap_s, sim.gap_count)
    want = [st["decode_s"][0], st["t_s"][1] - st["t_s"][0], st["decode_s"][2], st["t_s"][3] - st["t_s"][2]]
    assert sorted(gaps) == pytest.approx(sorted(want))


def test_weighted_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    v, c = rng.random(50), rng.integers(0, 6, 50)
    for q in (0, 1, 50, 90, 99, 100):
        assert weighted_percentile(v, c, q) == pytest.approx(np.percentile(np.repeat(v, c), q), rel=1e-12)


def test_capacity_holds_the_batch_down():
    """R-worker memory for 3 worst cases (prompt + max_tokens, whole pages) runs 3 at a time."""
    prof = profile(layers=2)
    per_token = prof.model.kv_bytes_per_token_layer(2) * 2
    prof.r_workers[0].capacity_bytes = 3 * 64 * per_token
    sim = run(prof, fixed_trace(9, 48, 16), max_batch=8)
    assert sim.steps["active"].max() == 3 and sim.steps["tokens"].sum() == 9 * 16
