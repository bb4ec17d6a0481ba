"""A float64 numpy reference of the R-part: a KV store with the KVStore API, plain and slow.

The engine-level tests use it to check attention independently of the C++ kernel.
"""
from __future__ import annotations

import numpy as np

from rworker.protocol.kvformat import kv_itemsize


def bf16_bits_to_f32(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def to_f64(x: np.ndarray) -> np.ndarray:
    return bf16_bits_to_f32(x).astype(np.float64) if x.dtype == np.uint16 else x.astype(np.float64)


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q: [Hq, D]; k, v: [L, Hkv, D] -> [Hq, D], all float64, softmax stabilized by the max."""
    hq, hkv = q.shape[0], k.shape[1]
    group = hq // hkv
    out = np.empty_like(q)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        s = kh @ q[h] * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vh
    return out


class RefKVStore:
    def __init__(self, num_layers, num_kv_heads, head_dim, kv_dtype="fp32", threads=None, scale=None,
                 capacity_bytes=None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.kv_dtype = kv_dtype
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.capacity_bytes = capacity_bytes
        self.threads, self.isa = 1, "reference"
        self.kv = {}   # (seq, layer) -> (list of k rows, list of v rows)

    def _round(self, x):
        x = to_f64(x)
        if self.kv_dtype == "fp16":
            return x.astype(np.float16).astype(np.float64)
        if self.kv_dtype == "bf16":   # round to nearest even on the upper 16 bits
            f = x.astype(np.float32).view(np.uint32)
            f = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16 << 16).astype(np.uint32)
            return f.view(np.float32).astype(np.float64)
        return x.astype(np.float32).astype(np.float64)

    def append(self, layer, seq_ids, k, v):
        k, v = self._round(k), self._round(v)
        for i, sid in enumerate(np.asarray(seq_ids).tolist()):
            ks, vs = self.kv.setdefault((sid, layer), ([], []))
            ks.append(k[i])
            vs.append(v[i])

    def attend(self, layer, seq_ids, q, out=None):
        q = to_f64(q)
        o = np.empty(q.shape, dtype=np.float64)
        for i, sid in enumerate(np.asarray(seq_ids).tolist()):
            ks, vs = self.kv[(sid, layer)]
            o[i] = attention_f64(q[i], np.stack(ks), np.stack(vs), self.scale)
        if out is not None:
            out[...] = o.astype(np.float32) if out.dtype != np.uint16 else \
                (o.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            return out
        return o.astype(np.float32)

    def append_attend(self, layer, seq_ids, q, k, v, out=None):
        self.append(layer, seq_ids, k, v)
        return self.attend(layer, seq_ids, q, out)

    def free(self, seq_id):
        keys = [key for key in self.kv if key[0] == seq_id]
        for key in keys:
            del self.kv[key]
        return bool(keys)

    def num_tokens(self, seq_id, layer=0):
        return len(self.kv.get((seq_id, layer), ([], []))[0])

    def bytes_used(self):
        item = kv_itemsize(self.kv_dtype)
        return sum(len(ks) for ks, _ in self.kv.values()) * 2 * self.num_kv_heads * self.head_dim * item
