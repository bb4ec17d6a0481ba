"""How int8 KV should be quantized, measured on the embedded model's own keys, values and queries.

Runs smollm2-135m (fp32, fp32 KV, local mode) on 16 prompts for 40 greedy tokens and keeps, per
(layer, sequence), the last decode step's query and every K/V row the store received. Then, in
float64 numpy, the attention output of each quantization variant against the exact one (relative
L2 error, mean and p99 over the 30 x 16 (layer, sequence) pairs):

  K per token (one scale per token and head, what an append can do alone), K per page and channel
  (one scale per 32 tokens and dim), K per token after a Hadamard rotation
  (csrc/avx512/quant.h), V per token; the query in one int8 part or two; the page weights p * vsc
  in one 7-bit part or two; and the combinations the kernel could run.

Writes bench/kernel/results/int8_granularity_<label>.json.

    python3 bench/kernel/int8_granularity.py [--label smollm2-135m] [--prompts 16] [--tokens 40]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

TOPICS = ["the ocean", "a lighthouse", "mathematics", "a city at night", "coffee", "the moon", "trains",
          "a library", "mountains", "rain", "music", "a robot", "gardens", "winter", "friendship", "the desert"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}.",
         "Describe {} in detail."]
PAGE = 32


def capture(n_prompts: int, tokens: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(q [Hq, D], K [T, Hkv, D], V [T, Hkv, D]) of the last decode step, per (layer, sequence)."""
    from fastdecode import LLM, SamplingParams
    llm = LLM("smollm2-135m", dtype="float32", kv_dtype="fp32", device="cpu", max_batch=64)
    st = llm.engine.backend.store
    rows: dict = {}
    queries: dict = {}
    append, append_attend = st.append, st.append_attend

    def keep(layer, ids, k, v):
        for i, sid in enumerate(np.asarray(ids)):
            rows.setdefault((layer, int(sid)), []).append((k[i].copy(), v[i].copy()))

    def on_append(layer, ids, k, v):
        keep(layer, ids, k, v)
        return append(layer, ids, k, v)

    def on_append_attend(layer, ids, q, k, v, out=None):
        keep(layer, ids, k, v)
        for i, sid in enumerate(np.asarray(ids)):
            queries[(layer, int(sid))] = q[i].copy()
        return append_attend(layer, ids, q, k, v, out=out)

    st.append, st.append_attend = on_append, on_append_attend
    texts = [FORMS[i % 4].format(TOPICS[i % 16]) + f" (#{i})" for i in range(n_prompts)]
    llm.generate(texts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    llm.close()
    return [(queries[key], np.stack([k for k, _ in rows[key]]), np.stack([v for _, v in rows[key]]))
            for key in sorted(queries)]


# ---- the quantizers (float32 arithmetic, as the store's) --------------------------------------

def per_row(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Symmetric int8 with one scale per slice along `axis`, dequantized."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=axis, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return np.clip(np.rint(x * inv), -127, 127) * (amax / np.float32(127))


def per_page_channel(k: np.ndarray) -> np.ndarray:
    """One scale per 32 tokens and (head, dim)."""
    return np.concatenate([per_row(k[t:t + PAGE], axis=0) for t in range(0, len(k), PAGE)])


def two_parts(x: np.ndarray) -> np.ndarray:
    """q = s * (hi + lo / 254), the kernel's query."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    inv = np.float32(127) / amax
    hi = np.clip(np.rint(x * inv), -127, 127)
    lo = np.clip(np.rint((x * inv - hi) * 254), -127, 127)
    return (hi + lo / 254) * (amax / 127)


def hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while len(h) < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def rotated(quantize):
    """quantize applied in the Hadamard-rotated basis, the result turned back (the kernel turns
    keys and queries alike, and scores are rotation-invariant)."""
    def fn(x: np.ndarray) -> np.ndarray:
        h = hadamard(x.shape[-1])
        return quantize(x @ h.T) @ h
    return fn


turned = rotated(per_row)


# ---- attention with the page weights quantized ----------------------------------------------

def weights(w: np.ndarray, parts: int | None) -> np.ndarray:
    """Per 32-token page: w in one 7-bit part (rint) or two (floor + residual), or exact."""
    if parts is None:
        return w
    out = w.copy()
    for t in range(0, len(w), PAGE):
        page = w[t:t + PAGE]
        s = page.max() / 127
        y = page / s
        out[t:t + PAGE] = (np.rint(y) if parts == 1 else np.floor(y) + np.rint((y - np.floor(y)) * 127) / 127) * s
    return out


def attention(q, k, v, p_parts=None, v_scales=None) -> np.ndarray:
    hq, d = q.shape
    g = hq // k.shape[1]
    out = np.empty((hq, d))
    for h in range(hq):
        s = k[:, h // g].astype(np.float64) @ q[h] / np.sqrt(d)
        p = np.exp(s - s.max())
        vh = v[:, h // g].astype(np.float64)
        if p_parts is not None:        # the kernel's w = p * vsc per token, V as its int8 values
            sv = v_scales[:, h // g]
            w = weights(p * sv, p_parts)
            out[h] = w @ (vh / np.where(sv[:, None] > 0, sv[:, None], 1)) / p.sum()
        else:
            out[h] = p @ vh / p.sum()
    return out


VARIANTS = {
    "K per token": dict(k=per_row),
    "K per page and channel": dict(k=per_page_channel),
    "K per token, rotated": dict(k=turned),
    "V per token": dict(v=per_row),
    "q one part": dict(q=per_row),
    "q two parts": dict(q=two_parts),
    "p one 7-bit part": dict(p=1),
    "p two 7-bit parts": dict(p=2),
    "all one part, K unrotated": dict(k=per_row, v=per_row, q=per_row, p=1),
    "all one part, K and q rotated": dict(k=turned, v=per_row, q=turned, p=1),
    "K and q rotated, q two parts, p two parts (the kernel)": dict(k=turned, v=per_row, q=rotated(two_parts), p=2),
    "K and q rotated, q one part, p two parts": dict(k=turned, v=per_row, q=turned, p=2),
    "K and q rotated, q two parts, p one part": dict(k=turned, v=per_row, q=rotated(two_parts), p=1),
}


def error(case, spec: dict) -> float:
    q, k, v = case
    ref = attention(q, k, v)
    qq = spec.get("q", lambda x: x)(q)
    kk = spec.get("k", lambda x: x)(k)
    vv = spec.get("v", lambda x: x)(v)
    if "p" in spec:
        sv = (np.abs(v).max(axis=-1) / 127).astype(np.float64)
        o = attention(qq, kk, vv, spec["p"], sv)
    else:
        o = attention(qq, kk, vv)
    return float(np.linalg.norm(o - ref) / np.linalg.norm(ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()
    cases = capture(args.prompts, args.tokens)
    k_all = np.concatenate([k.reshape(-1, k.shape[-1]) for _, k, _ in cases])
    rms = np.sqrt((k_all ** 2).mean())
    result = {"label": args.label, "model": "smollm2-135m", "pairs": len(cases), "prompts": args.prompts,
              "tokens": args.tokens, "key_channel_max_over_rms": round(float(np.abs(k_all).max(0).max() / rms), 2),
              "relative_error": {}}
    for name, spec in VARIANTS.items():
        e = np.array([error(c, spec) for c in cases])
        result["relative_error"][name] = {"mean": round(float(e.mean()), 5), "p99": round(float(np.percentile(e, 99)), 5)}
        print(f"{name:50s} mean {e.mean():.5f}  p99 {np.percentile(e, 99):.5f}", flush=True)
    path = os.path.join(HERE, "results", f"int8_granularity_{args.label}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
