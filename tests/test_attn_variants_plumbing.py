"""The attention variants travel from the model to every store: AttentionVariants from a family's
config (windows, soft-cap, Gemma's scale) and from an S-part's sink weights, through HELLO's
encoding into the store an R-worker opens (rworker.tune.open_tuned_store), and into the local
backend's store."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdecode.model.config import config_from_hf_dict
from fastdecode.rpart.variants import AttentionVariants
from rworker.protocol import control as P
from rworker.tune import open_tuned_store

GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256, "vocab_size": 512,
          "sliding_window": 48, "query_pre_attn_scalar": 96, "attn_logit_softcapping": 30.0}


class WithSinks:
    def __init__(self, rows):
        self.rows = rows

    def sinks(self, layer):
        return self.rows[layer]


def test_a_gemma2_config_asks_for_windows_softcap_and_its_scale():
    c = config_from_hf_dict(GEMMA2, "gemma2-tiny")
    v = AttentionVariants.of(c)
    assert v.windows == tuple(c.layer_windows) and v.windowed
    assert sorted(set(v.windows)) == [0, 48]                  # sliding and global layers alternate
    assert v.softcap == 30.0 and v.scale == pytest.approx(96 ** -0.5)
    plain = AttentionVariants.of(config_from_hf_dict({**GEMMA2, "model_type": "llama", "sliding_window": None}, "l"))
    assert (plain.windows, plain.softcap, plain.sinks, plain.scale) == ((), 0.0, (), 64 ** -0.5)


def test_sinks_come_from_the_s_part_and_all_layers_or_none():
    c = config_from_hf_dict(GEMMA2, "gemma2-tiny")
    c.attn_sinks = True
    rows = [torch.arange(4, dtype=torch.float32) + 10 * layer for layer in range(4)]
    v = AttentionVariants.of(c, WithSinks(rows))
    assert np.array_equal(v.sink_rows(4, 4), torch.stack(rows).numpy())
    with pytest.raises(ValueError, match="none on layer 2"):
        AttentionVariants.of(c, WithSinks(rows[:2] + [None] + rows[3:]))


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_hello_to_store(kv_dtype):
    """What an R-worker builds from HELLO carries every variant the S-worker sent."""
    c = config_from_hf_dict(GEMMA2, "gemma2-tiny")
    sinks = np.random.default_rng(1).normal(size=(4, 4)).astype(np.float32)
    v = AttentionVariants(AttentionVariants.of(c).scale, AttentionVariants.of(c).windows, 30.0,
                          tuple(float(x) for x in sinks.ravel()))
    hello = P.Hello(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, kv_dtype, v.scale,
                    windows=v.windows, softcap=v.softcap, sinks=v.sinks)
    h = P.parse_hello(*P.parse(P.hello_message(hello))[2:])
    store, _ = open_tuned_store(h.num_layers, h.num_heads, h.num_kv_heads, h.head_dim, h.kv_dtype, 1, 1 << 24,
                                scale=h.scale, windows=h.windows or None, softcap=h.softcap or None,
                                sinks=h.sinks or None)
    assert store.windows == v.windows and store.softcap == 30.0 and store.scale == v.scale
    for layer in range(4):
        assert np.array_equal(store.sinks(layer), sinks[layer])
    with pytest.raises(ValueError, match="sliding windows"):
        store.fork(1, 2, 32)


def test_the_local_backend_builds_its_store_with_the_variants():
    from fastdecode.rpart.local import LocalBackend
    c = config_from_hf_dict(GEMMA2, "gemma2-tiny")
    b = LocalBackend(c, "fp32", threads=1, capacity_bytes=1 << 24)
    assert b.store.windows == tuple(c.layer_windows) and b.store.softcap == 30.0
    assert b.store.scale == pytest.approx(96 ** -0.5)
    assert b.workers[0].forks is False                # prefix sharing is off with sliding windows
