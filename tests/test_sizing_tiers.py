"""The S-worker's own KV tier in the sizing model: plan's split between the tier and the R-workers
against hand-computed cases, a profile without a tier planning as before, stated tiers, the plan
flags, and `profile` keeping the tier apart from the R-workers and from local mode."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from fastdecode.sizing import plan
from fastdecode.sizing.hardware import GPU_PRESETS, activation_reserve_bytes, stated_tier_bytes
from fastdecode.sizing.measure import local_mode
from fastdecode.sizing.model import predict
from fastdecode.sizing.profile import profile_link, profile_workers
from fastdecode.sizing.schema import MODEL_PRESETS, LinkProfile, Profile, RWorkerProfile, SWorkerProfile, TierProfile

LLAMA7B = MODEL_PRESETS["llama-7b"]
KVB = 2 * 32 * 128 * 2                     # KV bytes per token and layer, bf16: 16,384
SEQ_BYTES = 512 * KVB                      # what one sequence's attention reads per layer at S = 1024, no prompt
SEQ_HELD = 1024 * 32 * KVB                 # what it reserves (prompt + S = 1024 tokens, whole pages), all layers
S_LAYER, HEAD = 2e-3, 1e-3
S_STEP = 32 * 2 * S_LAYER + HEAD           # the S-part of a step at depth 2: what placement's tier base learns
TIER_SPB = 1e-12                           # the tier reads 1,000 GB/s


def flat_profile(r_GBps=100.0, workers=1, tier_seqs: int | None = 10_000) -> Profile:
    """Llama-7B, an S-part of 2 ms per layer at any batch and a 1 ms head, R-workers at r_GBps each
    with room to spare, a free link, and a tier at 1,000 GB/s holding tier_seqs sequences of
    S = 1024 (None: no tier)."""
    tier = None if tier_seqs is None else TierProfile("device (hand)", TIER_SPB, 0.0, tier_seqs * SEQ_HELD)
    return Profile(model=LLAMA7B, s_worker=SWorkerProfile("hand", [1, 1 << 16], [S_LAYER] * 2, [HEAD] * 2),
                   r_workers=[RWorkerProfile(f"cpu{i}", 1 / (r_GBps * 1e9), 0.0, 1e15) for i in range(workers)],
                   link=LinkProfile(0.0, 1e18), device_tier=tier)


def sides(tier: int, batch: int, r_Bps: float) -> tuple[float, float]:
    """Per layer, placement's view: (S-part with its head share + the tier's reads, the R-workers' reads)."""
    return S_STEP / 32 + tier * SEQ_BYTES * TIER_SPB, (batch - tier) * SEQ_BYTES / r_Bps


def greedy(batch: int, r_Bps: float) -> int:
    """Where the two sides meet, in whole sequences: the continuous balance, then of the counts
    around it the one whose step ends first."""
    balance = (batch * SEQ_BYTES / r_Bps - S_STEP / 32) / (SEQ_BYTES * TIER_SPB + SEQ_BYTES / r_Bps)
    return min((int(np.floor(balance)), int(np.ceil(balance))), key=lambda t: max(sides(t, batch, r_Bps)))


# ---- the split (sizing/split.py), hand-computed

def test_the_tier_takes_sequences_until_the_two_sides_end_together():
    # balance (1024 x 83.9 us - 4.03 ms) / (8.39 us + 83.9 us) = 887.2 sequences: 888 ends first
    p = predict(flat_profile(), 1024, 1024, rworkers=1, depth=2)
    assert greedy(1024, 100e9) == 888
    assert (p.tier_sequences, p.rworker_sequences, p.tier_split) == (888, 136, "balanced")
    s_side, r_side = 2 * S_LAYER + 888 * SEQ_BYTES * TIER_SPB, 136 * SEQ_BYTES / 100e9     # 11.45, 11.41 ms
    assert p.tier_layer_s == pytest.approx(888 * SEQ_BYTES * TIER_SPB)
    assert p.r_layer_s == pytest.approx(r_side)
    assert p.layer_s == pytest.approx(max(s_side, r_side)) and p.bound == "S"
    assert abs(s_side - r_side) < SEQ_BYTES / 100e9                       # within one sequence's R time
    assert (p.tier_kv_bytes, p.rworker_kv_bytes) == (888 * SEQ_HELD, 136 * SEQ_HELD)
    assert p.step_latency_s == pytest.approx(32 * max(s_side, r_side) + HEAD)


def test_a_tier_that_fills_up_leaves_the_rest_to_the_r_workers():
    p = predict(flat_profile(tier_seqs=100), 1024, 1024, rworkers=1, depth=2)
    assert (p.tier_sequences, p.rworker_sequences, p.tier_split, p.tier_capacity_sequences) == (100, 924, "tier full", 100)
    assert p.layer_s == pytest.approx(924 * SEQ_BYTES / 100e9) and p.bound == "R"       # 77.5 ms: R-bound
    assert p.kv_tokens_capacity == pytest.approx(1e15 / (32 * KVB) + 100 * 1024)


def test_the_tier_takes_all_where_one_r_worker_sequence_would_end_later():
    # R at 0.5 GB/s: one sequence there (16.8 ms a layer) outlasts the S side with all 1,024 on the
    # tier (4.03 + 8.59 = 12.6 ms): balance 1023.25, and 1024 ends first
    p = predict(flat_profile(r_GBps=0.5), 1024, 1024, rworkers=1, depth=2)
    assert greedy(1024, 0.5e9) == 1024
    assert (p.tier_sequences, p.rworker_sequences, p.tier_split) == (1024, 0, "all on the tier")
    assert p.layer_s == pytest.approx(2 * S_LAYER + 1024 * SEQ_BYTES * TIER_SPB) and p.bound == "S"
    assert p.r_layer_s == 0 and p.link_layer_s == 0


def test_fast_r_workers_take_most_and_none_leave_the_tier_empty():
    # 16 sockets of 100 GB/s: balance (5.37 - 4.03) / (8.39e-3 + 5.24e-3) = 98.1 sequences
    p = predict(flat_profile(workers=16), 1024, 1024, rworkers=16, depth=2)
    assert greedy(1024, 1.6e12) == 98
    assert (p.tier_sequences, p.rworker_sequences, p.tier_split) == (98, 926, "balanced")
    # 32 sockets: the S-part alone outlasts their attention (2.68 < 4.03 ms): the tier stays empty
    p = predict(flat_profile(workers=32), 1024, 1024, rworkers=32, depth=2)
    assert (p.tier_sequences, p.tier_split, p.bound) == (0, "none on the tier", "S")
    assert p.layer_s == pytest.approx(2 * S_LAYER)


def test_with_no_r_workers_plan_is_a_gpu_only_engine_capped_by_the_tier():
    p = predict(flat_profile(tier_seqs=100), 1024, 1024, rworkers=0, depth=2)
    assert (p.batch_run, p.tier_sequences, p.rworker_sequences, p.bound) == (100, 100, 0, "capacity")
    layer = 2 * S_LAYER + 100 * SEQ_BYTES * TIER_SPB                       # 4.84 ms
    assert p.layer_s == pytest.approx(layer) and p.link_layer_s == 0 and p.prefill_s == 0
    assert p.tokens_per_s == pytest.approx(100 / (32 * layer + HEAD))
    assert predict(flat_profile(tier_seqs=2000), 1024, 1024, rworkers=0).bound == "S"
    with pytest.raises(ValueError, match="at least one R-worker"):
        predict(flat_profile(tier_seqs=None), 1024, 1024, rworkers=0)


def test_only_the_r_workers_prompts_cross_the_link():
    """Prompts of sequences on the tier are written in place: the prompt K, V the link carries per
    step is the R-workers' share (B_R / S prompts of 512 tokens)."""
    prof = flat_profile(tier_seqs=100)
    prof.link = LinkProfile(0.0, 1e9)                              # 1 GB/s: the K, V transfer bounds prefill
    p = predict(prof, 1024, 1024, prompt_len=512, rworkers=1, depth=2)
    kv = p.rworker_sequences * 512 / 1024 * KVB                     # bytes per layer and step
    assert p.tier_sequences == 100 * 1024 // 1536 == 66                 # each holds prompt + S = 1,536 tokens
    assert p.prefill_s == pytest.approx(32 * kv / 1e9)


# ---- a profile without a tier plans as before

def test_a_profile_without_a_device_tier_plans_all_kv_on_the_r_workers(tmp_path):
    d = flat_profile(tier_seqs=None).to_dict()
    del d["device_tier"]                                           # as profiles before the tier were written
    old = Profile.from_dict(d)
    assert old.device_tier is None
    p = predict(old, 1024, 1024, rworkers=1, depth=2)
    assert (p.tier_sequences, p.rworker_sequences, p.tier_split) == (0, 1024, "no tier")
    assert p.layer_s == pytest.approx(1024 * SEQ_BYTES / 100e9)     # R: 85.9 ms, as without a tier
    assert p.kv_tokens_capacity == pytest.approx(1e15 / (32 * KVB))
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    code, out, _ = run_plan("--profile", str(path), "--batch", "1024", "--rworkers", "1", "--json")
    assert code == 0 and json.loads(out)["device_tier"] is None
    assert json.loads(out)["step_latency_s"] == pytest.approx(p.step_latency_s)


def test_profile_json_keeps_the_tier_and_rejects_a_bad_one():
    prof = flat_profile()
    back = Profile.from_json(prof.to_json())
    assert back.device_tier == prof.device_tier
    d = prof.to_dict()
    d["r_workers"] = []                                            # a GPU-only profile: the tier alone
    assert Profile.from_dict(d).r_workers == []
    for key, bad in (("seconds_per_kv_byte", 0), ("capacity_bytes", -1), ("kind", "disk")):
        d = prof.to_dict()
        d["device_tier"][key] = bad
        with pytest.raises(ValueError, match="device_tier"):
            Profile.from_dict(d)


# ---- stated tiers and the plan flags

def run_plan(*argv):
    import contextlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = plan.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_stated_gpu_holds_what_generate_would_leave_for_the_tier():
    """H100, Llama-3-8B: 0.9 x 80 GB, less 16.06 GB of weights, less the activations: a 32,768-token
    prefill chunk at (6 x 4096 + 3 x 14336) x 2 B a token and 4,096 decode rows with their fp32
    logits twice (8 x 128,256 B)."""
    m, gpu = MODEL_PRESETS["llama-3-8b"], GPU_PRESETS["h100"]
    per_token = (6 * 4096 + 3 * 14336) * 2
    want = 0.9 * 80e9 - m.weight_bytes() - 32768 * per_token - 4096 * (per_token + 8 * 128256)
    assert stated_tier_bytes(gpu, m) == pytest.approx(want)                       # 46.75 GB
    code, out, _ = run_plan("--gpu-profile", "h100", "--model", "llama-3-8b", "--rworkers", "0", "--batch", "64",
                            "--context", "1024", "--json")
    d = json.loads(out)
    assert code == 0 and d["device_tier"]["capacity_bytes"] == pytest.approx(want)
    assert d["device_tier"]["seconds_per_kv_byte"] == pytest.approx(1 / (0.7 * 3350e9))
    assert (d["tier_sequences"], d["rworkers"], d["bound"]) == (64, 0, "S")
    # a 70B in bf16 leaves nothing beside its weights: no tier, so R-workers must be stated
    code, _, err = run_plan("--gpu-profile", "h100", "--model", "llama-3-70b", "--rworkers", "0", "--batch", "64")
    assert code == 2 and "no room for a KV tier" in err and "--cpu-bw" in err


def test_the_stated_activation_reserve_is_the_engines():
    torch = pytest.importorskip("torch")
    from fastdecode.engine.kv_tiers import activation_reserve_bytes as engine_reserve
    from fastdecode.model.config import config_from_hf_dict
    from fastdecode.model.presets import PRESETS
    config = config_from_hf_dict(PRESETS["llama-3-8b"], "llama-3-8b")
    assert activation_reserve_bytes(MODEL_PRESETS["llama-3-8b"], 0, 4096, 16384) == \
        engine_reserve(config, torch.bfloat16, 16384, 4096)


def test_plan_flags_state_replace_or_drop_the_tier(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(flat_profile(tier_seqs=None).to_json())
    tiered = tmp_path / "tiered.json"
    tiered.write_text(flat_profile().to_json())
    common = ["--batch", "1024", "--context", "1024", "--rworkers", "1", "--json"]
    # a tier stated for an old profile: 100 sequences' worth at 1,000 GB/s
    code, out, _ = run_plan("--profile", str(old), "--device-kv-memory", f"{100 * SEQ_HELD}",
                            "--device-kv-gbps", "1000", *common)
    d = json.loads(out)
    assert code == 0 and (d["tier_sequences"], d["tier_split"]) == (100, "tier full")
    # the profile's tier, its rate replaced: 2,000 GB/s moves the balance up
    code, out, _ = run_plan("--profile", str(tiered), "--device-kv-gbps", "2000", *common)
    assert code == 0 and json.loads(out)["tier_sequences"] > 888
    code, out, _ = run_plan("--profile", str(tiered), "--no-device-kv", *common)
    assert code == 0 and json.loads(out)["tier_sequences"] == 0 and json.loads(out)["device_tier"] is None
    code, text, _ = run_plan("--profile", str(tiered), "--batch", "1024", "--context", "1024", "--rworkers", "1",
                             "--pipeline-depth", "2")
    assert code == 0 and "split: 888 sequences" in text and "the two sides of the step end together" in text


@pytest.mark.parametrize("argv, message", [
    (["--no-device-kv", "--device-kv-memory", "5G"], "--no-device-kv with"),
    (["--device-kv-gb", "5"], "--device-kv-gb is now --device-kv-memory SIZE (40G"),
    (["--cpu-mem", "256"], "--cpu-mem is now --rworker-mem SIZE (215G: the KV memory of one R-worker"),
    (["--device-kv-gbps", "0"], "--device-kv-gbps must be a finite number > 0"),
    (["--no-device-kv", "--rworkers", "0"], "at least one R-worker"),
    (["--rworkers", "-1"], "--rworkers must be >= 0"),
])
def test_plan_tier_flags_bad_input_is_one_line_and_exit_2(argv, message):
    code, out, err = run_plan("--gpu-profile", "a10", "--model", "llama-7b", "--cpu-bw", "150", "--batch", "64",
                              *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err


def test_rworker_mem_is_generates_flag_in_bytes(tmp_path):
    """plan's --rworker-mem is an R-worker's KV memory as generate's is (binary units, no reserve
    taken off); without it stated hardware has 256 GB less 10%."""
    common = ["--gpu-profile", "a10", "--model", "llama-7b", "--cpu-bw", "150", "--no-device-kv", "--batch", "64",
              "--context", "1024", "--rworkers", "1", "--json"]
    code, out, _ = run_plan(*common, "--rworker-mem", "100G")
    code_default, out_default, _ = run_plan(*common)
    assert code == code_default == 0
    token_bytes = 2 * 32 * 32 * 128 * 2                  # llama-7b's bf16 K and V over 32 layers
    assert json.loads(out)["kv_tokens_capacity"] == pytest.approx(100 * 2**30 / token_bytes, rel=0.02)
    assert json.loads(out_default)["kv_tokens_capacity"] == pytest.approx(256e9 * 0.9 / token_bytes, rel=0.02)


def test_an_old_profile_needs_both_figures_for_a_tier(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(flat_profile(tier_seqs=None).to_json())
    code, _, err = run_plan("--profile", str(old), "--device-kv-memory", "10G", "--batch", "64")
    assert code == 2 and "--device-kv-gbps" in err


# ---- profile: the tier apart from the R-workers, and not local mode

def fake_engine(ranks: list[int], tier_kind: str = "device"):
    """An engine whose backend has R-workers on `ranks` and the S-worker's own tier last (rank 0)."""
    workers = [SimpleNamespace(rank=r, host="h", page_tokens=32, tier="", frees_windows=True) for r in ranks]
    workers.append(SimpleNamespace(rank=0, host="h", page_tokens=32, tier="device (cuda:0)", frees_windows=False))
    raw = [{"rank": w.rank, "host": "h", "threads": 4, "bandwidth_GBps": 10.0 * (i + 1), "call_overhead_s": 1e-5,
            "seconds_per_kv_byte": 1e-10 / (i + 1), "capacity_bytes": 1e9 * (i + 1), "samples": [(1, 1.0)]}
           for i, w in enumerate(workers)]

    def ping(sizes, repeats):                  # the R-workers' links grow with the size; the tier's is nothing
        return [[(1e-5 + s / 1e9) if w.rank else 0.0 for s in sizes] for w in workers]

    backend = SimpleNamespace(workers=workers, profile_workers=lambda seqs, target: raw, ping=ping,
                              ping_all=lambda sizes, repeats: [1e-5 + s / 1e9 for s in sizes])
    return SimpleNamespace(backend=backend, config=SimpleNamespace(num_layers=1), tier=SimpleNamespace(kind=tier_kind),
                           device=SimpleNamespace(type="cpu"))


def test_profile_keeps_the_tier_apart_and_off_the_link():
    engine = fake_engine([1, 2])
    assert not local_mode(engine)
    r_workers, tier = profile_workers(engine, 8, 1 << 20, log=lambda *_: None)
    assert [w.name for w in r_workers] == ["rank1@h", "rank2@h"]
    assert tier.name == "device (cuda:0)" and tier.capacity_bytes == 3e9 and tier.kind == "device"
    assert tier.seconds_per_kv_byte == pytest.approx(1e-10 / 3) and not tier.frees_windows
    link = profile_link(engine, [64, 1 << 20, 4 << 20], 1, log=lambda *_: None)
    assert link.worker_names == ["rank1@h", "rank2@h"] and len(link.worker_message_time_s) == 2
    assert link.latency_s > 0 and link.concurrent_Bps > 0


def test_a_tier_beside_local_modes_store_is_still_local_mode():
    engine = fake_engine([0])                         # -n 1 on a GPU: the host's store, then the card's tier
    assert local_mode(engine)
    r_workers, tier = profile_workers(engine, 8, 1 << 20, log=lambda *_: None)
    assert [w.name for w in r_workers] == ["rank0@h"] and tier is not None
    link = profile_link(engine, [64, 1 << 20], 1, log=lambda *_: None)
    assert link.message_bytes == [] and link.worker_names == [] and link.bandwidth_Bps == 1e15
