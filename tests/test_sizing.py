"""The sizing model against hand-computed cases, and the plan command's interface."""
import dataclasses
import json
import math

import pytest

from fastdecode.sizing import plan
from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile
from fastdecode.sizing.model import held_tokens, kv_tokens_capacity, predict, rworkers_needed, sequences_on_worker
from fastdecode.sizing.schema import MODEL_PRESETS, LinkProfile, Profile, RWorkerProfile, SWorkerProfile

LLAMA7B = MODEL_PRESETS["llama-7b"]
KVB = 2 * 32 * 128 * 2                     # KV bytes per token and layer, bf16: 16384
TOKEN_BYTES = 32 * KVB                     # all 32 layers: 524288


def hand_profile(cpu_GBps=100.0, cpu_mem_GB=200.0, link_GBps=10.0, overhead_s=0.0) -> Profile:
    """Llama-7B with round numbers: T(256)=1 ms, T(1024)=2 ms, T(4096)=8 ms per layer, LM head
    1 ms per step; R-workers at cpu_GBps of attention; link 10 GB/s, 10 us."""
    return Profile(
        model=LLAMA7B,
        s_worker=SWorkerProfile("hand", [256, 1024, 4096], [1e-3, 2e-3, 8e-3], [1e-3] * 3),
        r_workers=[RWorkerProfile("cpu", 1 / (cpu_GBps * 1e9), overhead_s, cpu_mem_GB * 1e9)],
        link=LinkProfile(10e-6, link_GBps * 1e9))


# ---- T(B), E(B) and the knee

def test_layer_time_interpolates_log_log_and_extrapolates_flat_then_linear():
    s = hand_profile().s_worker
    # between (256, 1 ms) and (1024, 2 ms) the log-log slope is log 2 / log 4 = 1/2
    assert s.layer_time(512) == pytest.approx(1e-3 * math.sqrt(2))
    assert s.layer_time(64) == pytest.approx(1e-3)            # below the grid: weights still read
    assert s.layer_time(8192) == pytest.approx(16e-3)          # above: linear in B
    assert s.efficiency(1024) == pytest.approx(512_000)        # E = B / T, tokens/s per layer


def test_knee_is_where_efficiency_reaches_90_percent_of_best():
    # best E = 512,000 (B >= 1024). Between 256 and 1024, E = 256,000 * sqrt(B/256);
    # 0.9 * 512,000 = 460,800 -> sqrt(B/256) = 1.8 -> B = 829.4
    assert 825 <= hand_profile().s_worker.knee() <= 840


# ---- R-workers needed: P = (prompt + S/2) * B * R / T(B) = 1/2 * S * R * E(B) at prompt 0

def test_rworkers_needed_matches_half_S_R_E():
    prof = hand_profile()
    # R = 16384 B * 1e-11 s/B = 1.6384e-7 s per token of context per layer.
    # Depth 1, B = 1024, S = 1024: P = 0.5 * 1024 * 1.6384e-7 * 512,000 = 42.95 -> 43
    R = KVB / 100e9
    assert 0.5 * 1024 * R * 512_000 == pytest.approx(42.95, abs=0.01)
    assert rworkers_needed(prof, 1024, 1024, depth=1) == 43
    # depth 2: mini-batches of 512, T(512) = 1.4142 ms, context 512*512 tokens per mini-batch:
    # P = 512 * 512 * 16384 / (1.4142e-3 * 1e11) = 30.37 -> 31
    assert rworkers_needed(prof, 1024, 1024, depth=2) == 31


def test_prompt_adds_to_the_average_kv_length():
    # prompt 512 + S/2 = 512 -> average 1024 tokens: twice the context, P = 85.9 -> 86
    assert rworkers_needed(hand_profile(), 1024, 1024, prompt_len=512, depth=1) == 86


def test_capacity_sets_the_count_when_memory_is_short():
    # 10 GB per worker = 10e9 / 524288 = 19,073 tokens (page of 1 token in hand_profile).
    # full: a sequence reserves prompt + S = 1024 tokens -> 18 per worker -> 1024 / 18 = 56.9 -> 57
    # grow: the count the stabilized schedule admits (admission.memory_batch), its peak within
    #       memory: F = 1024/16 = 64, each S/2 + F/2 = 544 tokens + 2 of page overhead (pages of 1:
    #       the next token's slot and one of headroom) -> 19073 // 546 = 34; M = round(34*64/1024)
    #       = 2 per F = 2*1024 // 34 = 60 steps, which sustains 2*1024 // 60 = 34 and leaves
    #       19073 // (542 + 2) = 35 room: 34 per worker -> 1024 / 34 = 30.1 -> 31 workers
    prof = hand_profile(cpu_GBps=1e4, cpu_mem_GB=10.0)
    assert 10e9 // TOKEN_BYTES == 19073
    assert rworkers_needed(prof, 1024, 1024, depth=1) == 57
    assert rworkers_needed(prof, 1024, 1024, depth=1, kv_reserve="full") == 57
    assert rworkers_needed(prof, 1024, 1024, depth=1, kv_reserve="grow") == 31


def test_reservation_rounds_to_pages():
    # pages of 32 tokens: full reserves ceil((100 + 50) / 32) * 32 = 160 tokens; grow holds on
    # average 100 + 25 + 16 (half a page past its length) + 1/2 (the next token) + 32 (headroom)
    w = dataclasses.replace(hand_profile().r_workers[0], page_tokens=32)
    assert held_tokens(w, 50, 100, "full") == 160
    assert held_tokens(w, 50, 100, "grow") == pytest.approx(173.5)
    with pytest.raises(ValueError, match="kv_reserve"):
        held_tokens(w, 50, 100, "lazy")
    # 4,369 tokens, prompt 32, S = 512: full holds 4369 // 544 = 8 whole worst cases; grow what the
    # stabilized schedule admits: F = 32, 4369 // (32 + (512 + 32)/2 + 48.5) = 12; M = round(12*32/512)
    # = 1 per 512 // 12 = 42 steps, 4369 // (32 + 277 + 48.5) = 12 (bench/sizing/reserve_capacity_bench.py)
    assert sequences_on_worker(4369, w, 512, 32, "full") == 8
    assert sequences_on_worker(4369, w, 512, 32, "grow") == 12


def test_no_count_balances_when_call_overhead_exceeds_the_s_part():
    assert rworkers_needed(hand_profile(overhead_s=5e-3), 1024, 1024) is None


# ---- step latency, tokens/s, bound

def test_depth1_step_is_s_plus_r_plus_link():
    p = predict(hand_profile(), 1024, 1024, rworkers=43, depth=1)
    s = 2e-3
    r = 1024 * 512 * KVB / (43 * 100e9)                                    # 1.998 ms
    out = 10e-6 + 1024 * (32 + 64) * 128 * 2 / 10e9                       # Q,K,V: 2.5266 ms
    back = 10e-6 + 1024 * 32 * 128 * 2 / 10e9                              # O: 0.8489 ms
    layer = s + r + out + back                                             # 7.373 ms
    assert p.layer_s == pytest.approx(layer)
    assert p.step_latency_s == pytest.approx(32 * layer + 1e-3)            # 236.9 ms
    assert p.tokens_per_s == pytest.approx(1024 / (32 * layer + 1e-3))     # 4322
    assert p.bound == "link"


def test_a_gpu_s_worker_pays_pcie_both_ways_in_the_link():
    # the depth-1 case above plus device copies at 50 GB/s out and 40 GB/s back
    prof = hand_profile()
    prof.link.device_d2h_Bps, prof.link.device_h2d_Bps = 50e9, 40e9
    p = predict(prof, 1024, 1024, rworkers=43, depth=1)
    base = predict(hand_profile(), 1024, 1024, rworkers=43, depth=1)
    pcie = 1024 * (32 + 64) * 128 * 2 / 50e9 + 1024 * 32 * 128 * 2 / 40e9      # 0.5033 + 0.2097 ms
    assert p.layer_s == pytest.approx(base.layer_s + pcie)
    assert p.link_layer_s == pytest.approx(base.link_layer_s + pcie)


def test_pipelined_step_is_bound_by_the_slowest_side():
    # depth 2, 8 R-workers: per mini-batch s = T(512) = 1.4142 ms,
    # r = 512 * 512 * 16384 / 8e11 = 5.369 ms, link = 1.2683 + 0.4294 = 1.6977 ms.
    # layer = max(2 * 5.369, chain 8.48) = 10.737 ms -> R-bound
    p = predict(hand_profile(), 1024, 1024, rworkers=8, depth=2)
    r = 512 * 512 * KVB / 8e11
    assert p.layer_s == pytest.approx(2 * r)
    assert p.r_layer_s == pytest.approx(2 * r)
    assert p.s_layer_s == pytest.approx(2 * 1e-3 * math.sqrt(2))
    assert p.step_latency_s == pytest.approx(32 * 2 * r + 1e-3)
    assert p.bound == "R"
    # with 64 workers and a fast link the GPU bounds: layer = 2 * 1.4142 ms
    q = predict(hand_profile(link_GBps=1000.0), 1024, 1024, rworkers=64, depth=2)
    assert q.layer_s == pytest.approx(2e-3 * math.sqrt(2))
    assert q.bound == "S"


def test_chain_term_shows_when_the_link_cannot_hide():
    # balanced s = r, link comparable: two mini-batches cannot cover s + r + link
    p = predict(hand_profile(), 1024, 1024, rworkers=31, depth=2)
    s = 1e-3 * math.sqrt(2)
    r = 512 * 512 * KVB / (31 * 100e9)
    link = 20e-6 + 512 * (96 + 32) * 128 * 2 / 10e9
    assert p.layer_s == pytest.approx(max(2 * s, 2 * r, 2 * link, s + r + link))
    assert p.layer_s == pytest.approx(s + r + link)


def test_chain_hand_offs_count_only_where_the_chain_binds():
    # the depth-1 case: every layer is its chain, so a hop of 0.5 ms adds 0.5 ms per layer
    prof = hand_profile()
    prof.link.hop_s = 0.5e-3
    base = predict(hand_profile(), 1024, 1024, rworkers=43, depth=1)
    assert predict(prof, 1024, 1024, rworkers=43, depth=1).layer_s == pytest.approx(base.layer_s + 0.5e-3)
    # depth 2, R-bound with 8 workers: layer = 2 r = 10.737 ms > chain 8.48 + 0.5 ms: unchanged
    r = 512 * 512 * KVB / 8e11
    assert predict(prof, 1024, 1024, rworkers=8, depth=2).layer_s == pytest.approx(2 * r)
    # ... until the hand-offs make the chain longer than two mini-batches of R
    prof.link.hop_s = 3e-3
    s, link = 1e-3 * math.sqrt(2), 20e-6 + 512 * (96 + 32) * 128 * 2 / 10e9
    assert predict(prof, 1024, 1024, rworkers=8, depth=2).layer_s == pytest.approx(s + r + link + 3e-3)


def test_capacity_bound_runs_the_batch_that_fits():
    # 8 workers x 10 GB, 19,073 tokens each (152,587.89 in all).
    # full: 1024 tokens per sequence -> 18 per worker -> 144 fit; grow: 34 per worker (see
    # test_capacity_sets_the_count_when_memory_is_short) -> 272, holding 514 tokens on average
    prof = hand_profile(cpu_mem_GB=10.0)
    assert kv_tokens_capacity(prof, 8) == pytest.approx(80e9 / TOKEN_BYTES)
    for policy, fit, per_seq in (("full", 144, 1024), ("grow", 272, 514)):
        p = predict(prof, 1024, 1024, rworkers=8, depth=2, kv_reserve=policy)
        assert p.kv_tokens_capacity == pytest.approx(152_587.89, abs=0.01)
        assert p.kv_tokens_needed == pytest.approx(1024 * per_seq)
        assert p.batch_run == fit
        assert p.bound == "capacity"
        assert p.tokens_per_s == pytest.approx(fit / p.step_latency_s)
    assert predict(prof, 1024, 1024, rworkers=8, depth=2).batch_run == 144      # generate's default: full


def test_capacity_counts_whole_sequences_per_worker():
    # two workers of 1.5 sequences each hold 2 sequences, not 3
    prof = hand_profile()
    prof.r_workers[0].capacity_bytes = 1.5 * 1024 * TOKEN_BYTES
    assert predict(prof, 8, 1024, rworkers=2, kv_reserve="full").batch_run == 2


def test_mixed_r_workers_share_by_bandwidth():
    # one 100 GB/s and one 300 GB/s worker attend like one 400 GB/s worker (memory for the whole batch)
    prof = hand_profile(cpu_mem_GB=1000.0)
    prof.r_workers = [prof.r_workers[0], dataclasses.replace(prof.r_workers[0], seconds_per_kv_byte=1 / 300e9)]
    p = predict(prof, 1024, 1024, rworkers=2, depth=1)
    assert p.r_layer_s == pytest.approx(1024 * 512 * KVB / 400e9)


# ---- stated hardware

def test_stated_a10_layer_time_from_the_datasheet():
    # Llama-7B layer: 2 * (4096*96*128 + 4096*4096 + 3*4096*11008) = 404,750,336 FLOP/token.
    # B = 1024 on an A10 (125 TFLOP/s at 62%): 4.1446e11 / 7.75e13 = 5.348 ms; weight stream
    # 404.75 MB / (600 GB/s * 0.8) = 0.843 ms, far below, so the soft max is the compute time.
    prof = stated_profile(GPU_PRESETS["a10"], LLAMA7B, cpu_bw_GBps=150, cpu_mem_GB=256)
    assert LLAMA7B.layer_flops_per_token() == 404_750_336
    assert prof.s_worker.layer_time(1024) == pytest.approx(404_750_336 * 1024 / 7.75e13, rel=1e-4)
    # R-worker: 150 GB/s x 0.66 = 99 GB/s of attention; 256 GB less 10% reserve
    assert prof.r_workers[0].bandwidth() == pytest.approx(99e9)
    assert prof.r_workers[0].capacity_bytes == pytest.approx(230.4e9)


def test_h100_preset_uses_the_measured_anchors_for_the_llama2_7b_shape():
    prof = stated_profile(GPU_PRESETS["h100"], MODEL_PRESETS["llama-2-7b"], 119, 126)
    assert prof.s_worker.layer_time(1024) == pytest.approx(0.65e-3)
    assert prof.s_worker.layer_time(4096) == pytest.approx(2.631e-3)
    # the fitted roofline reproduces those anchors within 5%
    for b, ms in [(256, 0.245), (1024, 0.65), (16384, 10.592)]:
        assert GPU_PRESETS["h100"].layer_time(LLAMA7B, b) == pytest.approx(ms * 1e-3, rel=0.05)


def test_gqa_needs_fewer_r_workers():
    gqa = stated_profile(GPU_PRESETS["a10"], MODEL_PRESETS["llama-3-8b"], 150, 256)
    mha = stated_profile(GPU_PRESETS["a10"], LLAMA7B, 150, 256)
    assert rworkers_needed(gqa, 1024, 1024) < rworkers_needed(mha, 1024, 1024)


def test_profile_json_round_trip_and_validation(tmp_path):
    prof = hand_profile()
    prof.link.message_bytes, prof.link.message_time_s = [1024, 1 << 20], [12e-6, 110e-6]
    back = Profile.from_json(prof.to_json())
    assert back == prof
    assert back.link.time(1024) == pytest.approx(12e-6)            # measured table
    # past the table: its largest point plus the rest at the bandwidth
    assert back.link.time(1 << 30) == pytest.approx(110e-6 + ((1 << 30) - (1 << 20)) / 10e9)
    assert back.link.time(512) == pytest.approx(10e-6 + 512 / 10e9)   # below it: latency + size / bandwidth
    extra = json.loads(prof.to_json())
    extra["r_workers"][0]["measured_at"] = "2026-11-22"          # metadata is ignored
    assert Profile.from_dict(extra) == prof
    bad = json.loads(prof.to_json())
    bad["schema"] = "something-else/9"
    with pytest.raises(ValueError):
        Profile.from_dict(bad)
    bad = json.loads(prof.to_json())
    bad["r_workers"][0]["seconds_per_kv_byte"] = 0
    with pytest.raises(ValueError):
        Profile.from_dict(bad)


# ---- the command

def run_plan(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


STATED = ["--gpu-profile", "a10", "--model", "llama-7b", "--cpu-bw", "150"]


def test_plan_json_has_the_promised_keys(capsys):
    code, out, _ = run_plan(capsys, *STATED, "--batch", "1024", "--context", "1024", "--json")
    assert code == 0
    d = json.loads(out)
    for key in ("rworkers_needed", "step_latency_s", "tokens_per_s", "bound", "kv_tokens_capacity",
                "step_latency_depth1_s", "knee_batch"):
        assert key in d
    assert d["bound"] in {"S", "R", "link", "capacity"}
    assert d["rworkers"] == d["rworkers_needed"]


def test_plan_sweep_marks_the_knee(capsys):
    code, out, _ = run_plan(capsys, *STATED, "--json")
    d = json.loads(out)
    assert code == 0 and d["batch"] == d["knee_batch"]
    assert d["knee_batch"] in [r["batch"] for r in d["sweep"]]
    code, text, _ = run_plan(capsys, *STATED)
    assert code == 0 and "<- knee" in text


def test_plan_reads_a_profile_file(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(hand_profile().to_json())
    code, out, _ = run_plan(capsys, "--profile", str(path), "--batch", "1024", "--rworkers", "8",
                            "--json")
    assert code == 0
    assert json.loads(out)["step_latency_s"] == pytest.approx(
        predict(hand_profile(), 1024, 1024, rworkers=8).step_latency_s)
    # what-if: a faster CPU replaces the profiled R-worker
    code, out, _ = run_plan(capsys, "--profile", str(path), "--batch", "1024", "--cpu-bw", "1000",
                            "--cpu-eff", "1", "--json")
    assert json.loads(out)["rworkers_needed"] == rworkers_needed(hand_profile(cpu_GBps=1000), 1024, 1024)


def test_plan_prices_the_kv_reservation(tmp_path, capsys):
    # 8 workers x 10 GB: full reservation holds 144 sequences of prompt + S = 1024, grow 272
    path = tmp_path / "profile.json"
    path.write_text(hand_profile(cpu_mem_GB=10.0).to_json())
    args = ["--profile", str(path), "--batch", "1024", "--context", "1024", "--rworkers", "8"]
    code, out, _ = run_plan(capsys, *args, "--json")
    d = json.loads(out)
    assert code == 0 and d["kv_reserve"] == "full" and d["bound"] == "capacity"
    assert (d["batch_run"], d["batch_run_if_grow"]) == (144, 272)
    code, out, _ = run_plan(capsys, *args, "--kv-reserve", "grow", "--json")
    d = json.loads(out)
    assert d["kv_reserve"] == "grow" and d["batch_run"] == 272 and "batch_run_if_grow" not in d
    code, text, _ = run_plan(capsys, *args)
    assert code == 0 and "memory holds 144" in text and "--kv-reserve grow" in text and "memory holds 272" in text


@pytest.mark.parametrize("argv", [
    ["--model", "llama-7b"],                                          # no hardware
    [*STATED, "--batch", "0"],
    [*STATED, "--context", "-5"],
    [*STATED, "--rworkers", "0", "--no-device-kv"],                  # no KV anywhere (0 with a tier: GPU-only)
    [*STATED, "--cpu-bw", "-1"],
    ["--gpu-profile", "no-such-gpu", "--model", "llama-7b", "--cpu-bw", "100"],
    ["--gpu-profile", "a10", "--model", "no-such-model", "--cpu-bw", "100"],
    ["--profile", "/nonexistent/profile.json"],
])
def test_plan_bad_input_is_one_line_and_exit_2(capsys, argv):
    code, out, err = run_plan(capsys, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "error" in err


def test_plan_rejects_a_profile_measured_for_another_model(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(hand_profile().to_json())
    code, _, err = run_plan(capsys, "--profile", str(path), "--model", "llama-13b")
    assert code == 2 and "--gpu-profile" in err


def test_plan_unparsable_number_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        plan.main([*STATED, "--batch", "many"])
    assert e.value.code == 2


def test_plan_reads_an_hf_config(tmp_path, capsys):
    cfg = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = run_plan(capsys, "--gpu-profile", "a10", "--model", str(tmp_path), "--cpu-bw", "30",
                            "--batch", "64", "--pipeline-depth", "2", "--json")
    assert code == 0
    d = json.loads(out)
    expected = stated_profile(GPU_PRESETS["a10"], MODEL_PRESETS["smollm2-135m"], 30, 256)
    assert d["tokens_per_s"] == pytest.approx(predict(expected, 64, 1024).tokens_per_s)


def test_prompts_add_prefill_to_the_s_worker_and_their_kv_to_the_link():
    # prompt 512, S = 1024, B = 1024: 1024/1024 = 1 sequence starts per step -> 512 prompt tokens.
    # Prefill: 32 layers * 512 tokens / 512,000 tokens/s (best E) = 32 ms per step; their K, V
    # cross as each layer computes them, one after another: 10 us + 32 * 512 * 16384 B / 10 GB/s
    # = 26.85 ms, less.
    # Link, depth 1: out = 10 us + 1024 * 24576 B / 10 GB/s = 2.5266 ms, back = 0.8489 ms.
    # Average context 512 + 1024/2 = 1024 tokens on 86 workers:
    # r = 1024 * 1024 * 16384 / 8.6e12 = 1.9976 ms; s = T(1024) = 2 ms.
    p = predict(hand_profile(), 1024, 1024, prompt_len=512, rworkers=86, depth=1)
    assert p.prefill_s == pytest.approx(32 * 512 / 512_000)
    out = 10e-6 + 1024 * 24576 / 10e9
    back = 10e-6 + 1024 * 8192 / 10e9
    r = 1024 * 1024 * KVB / (86 * 100e9)
    assert p.layer_s == pytest.approx(2e-3 + r + out + back)
    assert p.step_latency_s == pytest.approx(32 * p.layer_s + 1e-3 + 0.032)
    # over a 1 GB/s link the prompt's K, V take longer than its compute: 10 us + 32 * 8.389 ms
    slow = predict(hand_profile(link_GBps=1.0), 1024, 1024, prompt_len=512, rworkers=86, depth=1)
    assert slow.prefill_s == pytest.approx(10e-6 + 32 * 512 * KVB / 1e9)


def test_a_measured_prefill_cost_replaces_the_dense_estimate():
    # Profiled: 10 us per prompt token at prompt 128, 30 us at 2048 (prompt attention grows).
    # Prompt 1088 lies halfway: 20 us. B = 1024, S = 1024: 1 sequence starts per step -> 1088
    # prompt tokens -> 21.76 ms of prefill per step, whatever the dense layers' best efficiency
    # (over a link fast enough that the prompt's K, V take less).
    prof = hand_profile(link_GBps=1000.0)
    prof.s_worker.prefill_prompt_len, prof.s_worker.prefill_token_s = [128, 2048], [10e-6, 30e-6]
    p = predict(prof, 1024, 1024, prompt_len=1088, rworkers=86, depth=1)
    assert p.prefill_s == pytest.approx(1088 * 20e-6)
    assert predict(prof, 1024, 1024, prompt_len=64, rworkers=86).prefill_s == pytest.approx(64 * 10e-6)


def test_prefill_cost_follows_the_chunk_size():
    # Prompt table at 2,048-token chunks: 10 us/token at prompt 128, 30 us at 2048 (-> 20 us at
    # 1088). Chunk table at prompt 128: 8 / 10 / 13 us at chunks 512 / 2048 / 8192. A chunk
    # adds its dense-part difference: chunk 8192 -> 20 + (13 - 10) = 23 us; chunk 1024 (halfway
    # in log between 512 and 2048) -> 20 + (9 - 10) = 19 us. A link fast enough for the K, V.
    prof = hand_profile(link_GBps=1000.0)
    sw = prof.s_worker
    sw.prefill_prompt_len, sw.prefill_token_s, sw.prefill_chunk = [128, 2048], [10e-6, 30e-6], 2048
    sw.prefill_chunk_grid, sw.prefill_chunk_token_s, sw.prefill_chunk_prompt_len = [512, 2048, 8192], [8e-6, 10e-6, 13e-6], 128
    assert sw.prefill_time_per_token(1088, 8192) == pytest.approx(23e-6)
    assert sw.prefill_time_per_token(1088, 1024) == pytest.approx(19e-6)
    assert sw.prefill_time_per_token(1088) == pytest.approx(20e-6)          # no chunk given: the table's
    assert sw.prefill_time_per_token(1088, 1 << 20) == pytest.approx(23e-6)  # flat past the grid
    # predict: explicit chunk, and the default (B/16 prompts = 69,632 tokens, capped at 8192)
    p = predict(prof, 1024, 1024, prompt_len=1088, rworkers=86, depth=1, prefill_chunk=1024)
    assert p.prefill_s == pytest.approx(1088 * 19e-6)
    assert predict(prof, 1024, 1024, prompt_len=1088, rworkers=86, depth=1).prefill_s == pytest.approx(1088 * 23e-6)
    # B = 16, prompt 128: B/16 = one prompt per chunk = 128 tokens, below the grid -> flat at 8 us
    assert predict(prof, 16, 1024, prompt_len=128, rworkers=86).prefill_s == pytest.approx(16 * 128 / 1024 * 8e-6)
    # round trip through JSON keeps the tables
    again = Profile.from_json(prof.to_json()).s_worker
    assert again.prefill_time_per_token(1088, 8192) == pytest.approx(23e-6)


def test_profile_rejects_a_chunk_table_out_of_order():
    d = hand_profile().to_dict()
    d["s_worker"]["prefill_chunk_grid"], d["s_worker"]["prefill_chunk_token_s"] = [2048, 512], [1e-5, 1e-5]
    with pytest.raises(ValueError, match="prefill_chunk_grid"):
        Profile.from_dict(d)


def test_profile_rejects_a_prefill_table_of_unequal_length():
    d = hand_profile().to_dict()
    d["s_worker"]["prefill_prompt_len"], d["s_worker"]["prefill_token_s"] = [16, 128], [1e-5]
    with pytest.raises(ValueError, match="prefill_prompt_len"):
        Profile.from_dict(d)
