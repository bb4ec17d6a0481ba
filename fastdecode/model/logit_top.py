"""The logits at the top of each row, recomputed in float32 where a half-precision LM head
rounded them.

The search goes through the maxima of NEAR_BLOCK-token blocks: amax over a row is one vectorized
pass, where a compare-then-nonzero over a 49,152-token row is not (on the 2-core dev box about a
tenth of the time for 64 rows)."""
from __future__ import annotations

import torch

NEAR_BLOCK = 128         # tokens per block when searching a row for logits near its top


def block_maxima(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, V] -> the maximum of each NEAR_BLOCK-token block [n, ceil(V / B)] (the last
    block may be short)."""
    n, vocab = logits.shape
    whole = vocab // NEAR_BLOCK * NEAR_BLOCK
    maxima = logits[:, :whole].reshape(n, -1, NEAR_BLOCK).amax(-1)       # [n, V // B]
    if whole < vocab:
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], 1)
    return maxima


def block_tokens(blocks: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [b] -> (their token ids [b, B], clamped into the vocabulary; which are inside it [b, B])."""
    tokens = blocks[:, None] * NEAR_BLOCK + torch.arange(NEAR_BLOCK, device=blocks.device)
    inside = tokens < vocab
    return tokens.clamp_(max=vocab - 1), inside


def near_top(logits: torch.Tensor, rel: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [k], tokens [k]) of the logits [n, V] within rel * |top| of their row's top: only the
    blocks whose maximum reaches that are searched."""
    top = logits.amax(-1, keepdim=True)                                   # [n, 1]
    floor = top - rel * top.abs()                                         # [n, 1]
    rows, blocks = (block_maxima(logits) >= floor).nonzero(as_tuple=True)    # [b], [b]
    tokens, inside = block_tokens(blocks, logits.shape[1])                # [b, B]
    hit = (logits[rows[:, None], tokens] >= floor[rows]) & inside         # [b, B]
    which, col = hit.nonzero(as_tuple=True)
    return rows[which], tokens[which, col]


REFINE_PAIRS = 1 << 16   # (row, token) pairs per pass: their weight rows, [pairs, h] float32


def top_in_float32(logits: torch.Tensor, h: torch.Tensor, lm_head: torch.Tensor, cap: float | None) -> torch.Tensor:
    """logits [n, V] float32 from a bf16/fp16 GEMM, h [n, h] its input, lm_head [V, h]: the logits
    within rounding of each row's top recomputed as float32 dot products (soft-capped in float32).

    The GEMM rounds its output to the activation dtype: a bf16 logit near 20 is a multiple of
    0.125, so 2.4% of the embedded model's positions had two tokens tied for the top and greedy
    took the lower id. Every logit within two roundings of the row's largest (2 eps |max|; one or
    a few per row) is recomputed, so the top is decided by float32 sums as a float32 model decides
    it; the rest of the row keeps its rounding (it moves a probability, never a pick).
    """
    rows, tokens = near_top(logits, 2 * torch.finfo(lm_head.dtype).eps)  # [k], [k]
    for start in range(0, rows.numel(), REFINE_PAIRS):
        r, t = rows[start:start + REFINE_PAIRS], tokens[start:start + REFINE_PAIRS]
        exact = (lm_head[t].float() * h[r].float()).sum(-1)               # [k']
        logits[r, t] = torch.tanh(exact / cap) * cap if cap else exact
    return logits
