"""The sizing model with shared prefixes (issue 32) against hand-computed cases, plan's flags for
them, the profile field that prices them, and the kernel timing that measures it."""
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest

from fastdecode.sizing import plan
from fastdecode.sizing.model import held_tokens, predict, rworkers_needed, sequences_on_worker
from fastdecode.sizing.profile import profile_workers
from fastdecode.sizing.schema import MODEL_PRESETS, LinkProfile, Profile, RWorkerProfile, SWorkerProfile
from rworker.bench import measure_attention
from rworker.kvstore import KVStore

KVB = 2 * 32 * 128 * 2                     # Llama-7B KV bytes per token and layer, bf16: 16384
TOKEN_BYTES = 32 * KVB                     # all 32 layers


def hand_profile(ratio=1.0, cpu_mem_GB=200.0) -> Profile:
    """Llama-7B with round numbers: T(256)=1 ms, T(1024)=2 ms, T(4096)=8 ms per layer, LM head
    1 ms per step; R-workers at 100 GB/s of attention, no call overhead; link 10 GB/s, 10 us."""
    return Profile(
        model=MODEL_PRESETS["llama-7b"],
        s_worker=SWorkerProfile("hand", [256, 1024, 4096], [1e-3, 2e-3, 8e-3], [1e-3] * 3),
        r_workers=[RWorkerProfile("cpu", 1 / 100e9, 0.0, cpu_mem_GB * 1e9, shared_cost_ratio=ratio)],
        link=LinkProfile(10e-6, 10e9))


# The workload of the cases below: S = 1024, prompts of 1152 tokens whose first 1024 are shared
S, PROMPT, SHARED = 1024, 1152, 1024


# ---- no prefix: the unshared model, unchanged

@pytest.mark.parametrize("policy", ["full", "grow"])
@pytest.mark.parametrize("group", [None, 1, 7])
def test_no_shared_prefix_is_the_unshared_model(policy, group):
    prof = hand_profile(ratio=0.25, cpu_mem_GB=10.0)
    for batch, prompt, depth in ((1024, 0, 2), (300, 512, 1), (64, 1152, 3)):
        base = predict(prof, batch, S, prompt, rworkers=8, depth=depth, kv_reserve=policy).to_dict()
        same = predict(prof, batch, S, prompt, rworkers=8, depth=depth, kv_reserve=policy,
                       shared_prefix=0, prefix_group=group).to_dict()
        group_keys = ("prefix_group",)
        assert {k: v for k, v in same.items() if k not in group_keys} == \
            {k: v for k, v in base.items() if k not in group_keys}
    # the R-part stays mini·(prompt + S/2) tokens: depth 2, 8 workers, B = 1024, prompt 0
    p = predict(hand_profile(ratio=0.25), 1024, S, 0, rworkers=8, depth=2, shared_prefix=0)
    assert p.r_layer_s == pytest.approx(2 * 512 * 512 * KVB / 8e11, rel=1e-12)


# ---- the formulas, by hand

def test_sharing_lowers_the_r_part_as_the_formula_says():
    # depth 2, B = 1024: mini-batches m = 512; groups of 64 -> 16 groups, each with members in
    # both mini-batches -> c = 16 per mini-batch.
    # tokens = m·(prompt - shared + S/2) + c·shared + (m - c)·shared·ρ
    #        = 512·(128 + 512) + 16·1024 + 496·1024·0.25 = 327,680 + 16,384 + 126,976 = 471,040
    # (unshared: 512·(1152 + 512) = 851,968). 8 workers at 100 GB/s: r = tokens·KVB / 8e11 per mini-batch
    prof = hand_profile(ratio=0.25)
    p = predict(prof, 1024, S, PROMPT, rworkers=8, depth=2, shared_prefix=SHARED, prefix_group=64)
    assert 512 * (128 + 512) + 16 * 1024 + 496 * 1024 * 0.25 == 471_040
    assert p.r_layer_s == pytest.approx(2 * 471_040 * KVB / 8e11)
    plain = predict(prof, 1024, S, PROMPT, rworkers=8, depth=2)
    assert plain.r_layer_s == pytest.approx(2 * 851_968 * KVB / 8e11)
    assert (p.shared_prefix, p.prefix_group, p.shared_cost_ratio) == (SHARED, 64, 0.25)


def test_a_group_larger_than_the_mini_batch_streams_its_prefix_once_per_mini_batch():
    # default group = the batch (1024) > m = 512: c = max(1, 512/1024) = 1 group per mini-batch
    # tokens = 512·640 + 1·1024 + 511·1024·0.5 = 327,680 + 1,024 + 261,632 = 590,336
    p = predict(hand_profile(ratio=0.5), 1024, S, PROMPT, rworkers=8, depth=2, shared_prefix=SHARED)
    assert p.prefix_group == 1024
    assert p.r_layer_s == pytest.approx(2 * 590_336 * KVB / 8e11)


def test_kv_held_counts_the_prefix_once_per_group():
    # full, pages of 32: own part 128 + S = 1152 tokens (36 whole pages) + 1024/64 = 16 -> 1168;
    # grow: own prompt 128 + 16 = 144, + S/2 = 512, + (3·32 + 1)/2 = 48.5 of page overhead -> 704.5
    w = dataclasses.replace(hand_profile().r_workers[0], page_tokens=32)
    assert held_tokens(w, S, PROMPT, "full", SHARED, 64) == 1168
    assert held_tokens(w, S, PROMPT, "grow", SHARED, 64) == pytest.approx(704.5)
    assert held_tokens(w, S, PROMPT, "full") == 2176                       # unshared: 1152 + 1024
    # 10 GB per worker = 19,073 tokens: 19073 // 1168 = 16 sequences, against 19073 // 2176 = 8
    assert 10e9 // TOKEN_BYTES == 19073
    assert sequences_on_worker(19073, w, S, PROMPT, "full", SHARED, 64) == 16
    assert sequences_on_worker(19073, w, S, PROMPT, "full") == 8
    # predict: the batch's reservation, hand_profile's pages of 1 token: 1024 · (128 + 1024 + 16)
    p = predict(hand_profile(cpu_mem_GB=1000.0), 1024, S, PROMPT, rworkers=8, shared_prefix=SHARED, prefix_group=64)
    assert p.kv_tokens_needed == pytest.approx(1024 * 1168)


def test_members_prefill_only_their_suffix():
    # B/S = 1 sequence starts per step; with groups of 64 it prefills 128 + 1024/64 = 144 tokens
    # (the donor all 1152, 63 members 128 each). Stated prefill: 32 layers / best E (512,000/s).
    prof = hand_profile()
    p = predict(prof, 1024, S, PROMPT, rworkers=8, depth=1, shared_prefix=SHARED, prefix_group=64)
    assert p.prefill_s == pytest.approx(144 * 32 / 512_000)
    # and only those tokens' K, V cross the link: over 1 GB/s they take longer than the compute,
    # 10 us + 32 layers · 144·KVB / 1 GB/s against 10 us + 32 · 1152·KVB / 1 GB/s unshared
    prof.link = LinkProfile(10e-6, 1e9)
    p = predict(prof, 1024, S, PROMPT, rworkers=8, depth=1, shared_prefix=SHARED, prefix_group=64)
    plain = predict(prof, 1024, S, PROMPT, rworkers=8, depth=1)
    assert p.prefill_s == pytest.approx(10e-6 + 32 * 144 * KVB / 1e9)
    assert plain.prefill_s == pytest.approx(10e-6 + 32 * 1152 * KVB / 1e9)


def test_sharing_lowers_the_r_workers_needed():
    # depth 1, B = 1024, one group (the batch), ρ = 0.25: tokens = 1024·640 + 1024 + 1023·1024·0.25
    # = 918,272; P = tokens·KVB / (T(1024)·100 GB/s) = 75.2 -> 76, against 1024·1664 -> 139.6 -> 140
    prof = hand_profile(ratio=0.25)
    assert 1024 * 640 + 1024 + 1023 * 1024 * 0.25 == 918_272
    assert rworkers_needed(prof, 1024, S, PROMPT, depth=1, shared_prefix=SHARED) == \
        math.ceil(918_272 * KVB / (2e-3 * 100e9)) == 76
    assert rworkers_needed(prof, 1024, S, PROMPT, depth=1) == math.ceil(1024 * 1664 * KVB / 2e8) == 140


def test_a_group_of_one_is_no_sharing():
    # c = m: every sequence streams its own copy and no member-token is left to discount
    prof = hand_profile(ratio=0.25, cpu_mem_GB=10.0)
    for policy in ("full", "grow"):
        one = predict(prof, 1024, S, PROMPT, rworkers=8, depth=2, kv_reserve=policy, shared_prefix=SHARED,
                      prefix_group=1)
        plain = predict(prof, 1024, S, PROMPT, rworkers=8, depth=2, kv_reserve=policy)
        for key in ("r_layer_s", "layer_s", "prefill_s", "link_layer_s", "kv_tokens_needed", "step_latency_s"):
            assert getattr(one, key) == pytest.approx(getattr(plain, key)), key
        assert (one.batch_run, one.rworkers_needed) == (plain.batch_run, plain.rworkers_needed)


def test_an_unmeasured_ratio_prices_shared_tokens_as_streamed():
    # ρ = 1: c·shared + (m - c)·shared = m·shared, the unshared R-part; memory and prefill still shrink
    prof = hand_profile()
    p = predict(prof, 1024, S, PROMPT, rworkers=8, depth=2, shared_prefix=SHARED)
    plain = predict(prof, 1024, S, PROMPT, rworkers=8, depth=2)
    assert p.r_layer_s == pytest.approx(plain.r_layer_s)
    assert p.kv_tokens_needed < plain.kv_tokens_needed and p.prefill_s < plain.prefill_s


def test_predict_refuses_a_prefix_longer_than_the_prompt():
    with pytest.raises(ValueError, match="shared_prefix"):
        predict(hand_profile(), 64, S, 100, shared_prefix=128)
    with pytest.raises(ValueError, match="prefix_group"):
        predict(hand_profile(), 64, S, 200, shared_prefix=128, prefix_group=0)


# ---- the profile field

def test_a_profile_without_the_ratio_loads_as_unmeasured():
    d = json.loads(hand_profile(ratio=0.3).to_json())
    assert d["r_workers"][0]["shared_cost_ratio"] == 0.3
    del d["r_workers"][0]["shared_cost_ratio"]
    assert Profile.from_dict(d).r_workers[0].shared_cost_ratio == 1.0
    for bad in (0, 1.5):
        d["r_workers"][0]["shared_cost_ratio"] = bad
        with pytest.raises(ValueError, match="shared_cost_ratio"):
            Profile.from_dict(d)


def test_profile_takes_the_ratio_from_the_kernel_timing_where_there_is_one():
    raw = {"rank": 0, "host": "h", "threads": 1, "bandwidth_GBps": 10.0, "call_overhead_s": 1e-5,
           "seconds_per_kv_byte": 1e-10, "capacity_bytes": 1e9, "samples": [(1, 1.0)]}
    for extra, ratio in (({"shared_cost_ratio": 0.3}, 0.3), ({}, 1.0)):   # an old store answers without it
        backend = SimpleNamespace(workers=[SimpleNamespace(rank=0, page_tokens=32, tier="")],
                                  profile_workers=lambda seqs, target, extra=extra: [{**raw, **extra}])
        engine = SimpleNamespace(backend=backend, config=SimpleNamespace(num_layers=2))
        r_workers, tier = profile_workers(engine, 8, 1 << 20, log=lambda *_: None)
        assert r_workers[0].shared_cost_ratio == ratio and tier is None


# ---- the kernel timing

def test_measure_attention_prices_a_shared_prefix_on_a_tiny_store():
    r = measure_attention(9, 3, 64, "bf16", 1, seqs=4, target_bytes=1 << 20, repeats=1)
    assert {"seconds_per_kv_byte", "call_overhead_s", "bandwidth_GBps", "threads", "samples"} <= set(r)
    assert 0 < r["shared_cost_ratio"] <= 1
    assert r["shared_prefix_tokens"] % 32 == 0 and r["shared_members"] == 4 and r["shared_call_s"] > 0
    json.dumps(r)                                   # the worker sends it as JSON


def test_measure_attention_times_the_kernel_the_store_runs(monkeypatch):
    """The profile prices the path the R-worker's tune chose: its V layout, prefetch and AMX tiles
    reach every timing store (the streamed and the shared-prefix ones)."""
    import rworker.bench as bench
    seen = []

    def spy(*a, **kw):
        seen.append({k: kw.get(k) for k in ("v_tile", "prefetch", "amx")})
        return KVStore(*a, **{**kw, "amx": None})       # the tiles themselves need an AMX CPU
    monkeypatch.setattr(bench, "KVStore", spy)
    monkeypatch.setattr(bench.KVStore, "fork", KVStore.fork, raising=False)
    measure_attention(9, 3, 64, "bf16", 1, seqs=4, target_bytes=1 << 20, repeats=1, v_tile=0, prefetch="scattered",
                      amx="on")
    assert len(seen) == 4 and all(s == {"v_tile": 0, "prefetch": "scattered", "amx": "on"} for s in seen), seen


def test_measure_attention_without_fork_keeps_its_old_keys(monkeypatch):
    monkeypatch.delattr(KVStore, "fork")
    r = measure_attention(9, 3, 64, "bf16", 1, seqs=4, target_bytes=1 << 20, repeats=1)
    assert "shared_cost_ratio" not in r and r["seconds_per_kv_byte"] > 0


# ---- the command

STATED = ["--gpu-profile", "a10", "--model", "llama-7b", "--cpu-bw", "150", "--batch", "1024", "--context", "1024"]


def run_plan(capsys, *argv):
    code = plan.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_takes_a_shared_prefix(capsys):
    code, out, _ = run_plan(capsys, *STATED, "--prompt-len", "1152", "--shared-prefix", "1024",
                            "--prefix-group", "64", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["shared_prefix"], d["prefix_group"], d["shared_cost_ratio"]) == (1024, 64, 1.0)   # stated: unmeasured
    code, out, _ = run_plan(capsys, *STATED, "--prompt-len", "1152", "--json")
    assert json.loads(out)["kv_tokens_needed"] > d["kv_tokens_needed"]
    code, out, _ = run_plan(capsys, *STATED, "--prompt-len", "1152", "--shared-prefix", "1024",
                            "--shared-cost-ratio", "0.3", "--json")
    d = json.loads(out)
    assert d["shared_cost_ratio"] == 0.3 and d["prefix_group"] == 1024                     # default: the batch
    code, text, _ = run_plan(capsys, *STATED, "--prompt-len", "1152", "--shared-prefix", "1024")
    assert code == 0 and "shared prefix: 1024 tokens" in text and "not measured" in text


def test_plan_uses_the_profiled_ratio_unless_one_is_stated(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(hand_profile(ratio=0.25).to_json())
    args = ["--profile", str(path), "--batch", "1024", "--prompt-len", "1152", "--shared-prefix", "1024",
            "--rworkers", "8", "--json"]
    d = json.loads(run_plan(capsys, *args)[1])
    assert d["shared_cost_ratio"] == 0.25
    assert d["r_layer_s"] == pytest.approx(predict(hand_profile(ratio=0.25), 1024, 1024, 1152, rworkers=8,
                                                   shared_prefix=1024).r_layer_s)
    assert json.loads(run_plan(capsys, *args, "--shared-cost-ratio", "0.5")[1])["shared_cost_ratio"] == 0.5


@pytest.mark.parametrize("argv, flag", [
    (["--prompt-len", "100", "--shared-prefix", "128"], "--shared-prefix"),
    (["--prompt-len", "100", "--shared-prefix", "-1"], "--shared-prefix"),
    (["--prompt-len", "200", "--shared-prefix", "128", "--prefix-group", "0"], "--prefix-group"),
    (["--shared-cost-ratio", "0"], "--shared-cost-ratio"),
    (["--shared-cost-ratio", "1.2"], "--shared-cost-ratio"),
])
def test_plan_names_the_bad_sharing_flag(capsys, argv, flag):
    code, out, err = run_plan(capsys, *STATED, *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and flag in err
