"""The sizing model for sliding-window and mixture-of-experts shapes, against hand-computed
figures: a windowed layer is read over its window only and holds its window's pages and one
more; an MoE layer computes its active experts and holds all of them."""
from __future__ import annotations

import math

import pytest

from fastdecode.sizing.hardware import GPU_PRESETS, stated_profile
from fastdecode.sizing.model import predict, sequences_fitting
from fastdecode.sizing.schema import ModelDims

GEMMA_LIKE = (512, 512, 512, 512, 512, 0) * 2          # 12 layers, 5 of every 6 sliding


def dims(windows=(), **kw):
    base = dict(name="t", num_layers=12, hidden=1024, heads=8, kv_heads=4, head_dim=128, intermediate=4096,
                vocab=32000, windows=windows)
    base.update(kw)
    return ModelDims(**base)


@pytest.mark.parametrize("tokens", [100, 512, 4000, 8192])
def test_read_and_held_fractions_by_hand(tokens):
    d = dims(GEMMA_LIKE)
    assert d.read_fraction(tokens) == pytest.approx((10 * min(tokens, 512) + 2 * tokens) / (12 * tokens))
    pages = math.ceil(tokens / 32)
    assert d.held_fraction(tokens) == pytest.approx((10 * min(pages, 17) + 2 * pages) / (12 * pages))
    assert dims().read_fraction(tokens) == dims().held_fraction(tokens) == 1.0


def test_windows_round_trip_through_json():
    d = dims(GEMMA_LIKE)
    assert d.windows == GEMMA_LIKE and dims((0,) * 12).windows == ()


def test_windows_cut_r_time_and_raise_what_fits():
    full, win = dims(), dims(GEMMA_LIKE)
    pf, pw = _profile(full), _profile(win)
    a = predict(pf, batch=256, gen_len=256, prompt_len=8000, rworkers=2)
    b = predict(pw, batch=256, gen_len=256, prompt_len=8000, rworkers=2)
    share = win.read_fraction(8000 + 128)
    overhead = max(w.call_overhead_s for w in pf.workers(2))
    assert (b.r_layer_s / 2 - overhead) == pytest.approx((a.r_layer_s / 2 - overhead) * share, rel=1e-6)
    fit_full = sequences_fitting(pf, pf.workers(2), 256, 8000, "full")
    fit_win = sequences_fitting(pw, pw.workers(2), 256, 8000, "full")
    assert fit_win >= 3 * fit_full
    assert b.kv_tokens_needed == pytest.approx(a.kv_tokens_needed * win.held_fraction(8256))


def _profile(d):
    return stated_profile(GPU_PRESETS["h100"], d, cpu_bw_GBps=100.0, cpu_mem_GB=64.0)


def test_moe_dims_count_active_experts_for_compute_and_all_for_weights():
    cfg = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 2048, "num_attention_heads": 16,
           "num_key_value_heads": 16, "intermediate_size": 5632, "moe_intermediate_size": 1408,
           "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
           "vocab_size": 151936}
    d = ModelDims.from_hf_config(cfg, "moe")
    assert d.intermediate == 4 * 1408 + 5632
    attn = 2048 * (16 + 2 * 16) * 128 + 16 * 128 * 2048
    assert d.layer_flops_per_token() == 2.0 * (attn + 3 * 2048 * (4 * 1408 + 5632))
    assert d.layer_weight_bytes() == pytest.approx((attn + 3 * 2048 * (60 * 1408 + 5632)) * 2)
    dense = ModelDims.from_hf_config({**cfg, "num_experts": 0}, "dense")
    assert dense.experts_stored == 0 and dense.intermediate == 5632
