"""A half-precision LM head's top logits recomputed in float32 (model/logit_top.py: near_top,
top_in_float32): the search finds exactly the logits near each row's top, and greedy then picks
what a float64 product of the same bf16 operands picks, where the bf16 GEMM's rounding tied or
swapped them."""
from __future__ import annotations

import pytest
import torch

from fastdecode.model.logit_top import near_top, top_in_float32


def bf16_head(vocab: int, hidden: int = 64, rows: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).bfloat16()        # [V, h]
    h = (torch.randn(rows, hidden, generator=g) * 2).bfloat16()           # [n, h]
    exact = h.double() @ w.double().T                                     # [n, V] the float64 reference
    return w, h, exact


@pytest.mark.parametrize("vocab", [49152, 1000, 130, 7])
def test_the_search_finds_exactly_the_logits_near_each_rows_top(vocab):
    w, h, _ = bf16_head(vocab)
    logits = torch.nn.functional.linear(h, w).float()
    rel = 2 * torch.finfo(torch.bfloat16).eps
    rows, tokens = near_top(logits, rel)
    top = logits.amax(-1, keepdim=True)
    want_rows, want_tokens = (logits >= top - rel * top.abs()).nonzero(as_tuple=True)
    assert sorted(zip(rows.tolist(), tokens.tolist())) == sorted(zip(want_rows.tolist(), want_tokens.tolist()))
    assert len(rows) >= len(h)                     # every row's top itself


def test_greedy_over_the_refined_logits_is_float64s_pick_where_bf16_rounding_was_not():
    w, h, exact = bf16_head(4096, hidden=256, rows=1024)
    rounded = torch.nn.functional.linear(h, w).float()
    refined = top_in_float32(rounded.clone(), h, w, None)
    want = exact.argmax(-1)
    assert (rounded.argmax(-1) != want).sum() > 0          # the bf16 output's rounding does flip picks here
    assert torch.equal(refined.argmax(-1), want)
    changed = refined != rounded
    assert changed.sum(-1).max() <= 8 and changed.any(-1).float().mean() > 0.5   # only the top few moved
    top = refined.gather(1, want[:, None]).squeeze(1).double()
    assert torch.allclose(top, exact.max(-1).values, rtol=1e-5, atol=1e-4)


def test_a_soft_capped_head_caps_the_recomputed_logits_too():
    w, h, exact = bf16_head(512, rows=64)
    cap = 5.0
    rounded = torch.tanh(torch.nn.functional.linear(h, w) / cap).float() * cap
    refined = top_in_float32(rounded.clone(), h, w, cap)
    assert torch.equal(refined.argmax(-1), exact.argmax(-1))
    assert refined.max() <= cap
    top = refined.amax(-1).double()
    assert torch.allclose(top, torch.tanh(exact.max(-1).values / cap) * cap, atol=1e-5)

