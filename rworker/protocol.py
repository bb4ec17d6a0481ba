"""The S-worker <-> R-worker wire protocol: fixed-layout int64 control messages + raw buffers.

Shared by both sides (numpy only; the R-worker never imports torch). No pickle anywhere.

Per engine step the S-worker sends each R-worker, in this order:
  1. one control message (TAG_CTRL, int64 array): a Header, then the id arrays it announces;
  2. the data messages the header implies, with known sizes (so the receiver pre-posts them):
       PREFILL: per layer one message [k rows | v rows]            (TAG_KV)
       DECODE:  per layer, per mini-batch one message [q | k | v]  (TAG_QKV + mb)
     and receives per (layer, mini-batch) the attention output [n, Hq, D]  (TAG_OUT + mb).
Activations travel as float32 or as bf16 bits in uint16 (ACT_DTYPES).
"""
from __future__ import annotations

import numpy as np

MAGIC = 0x46444543          # "FDEC"
VERSION = 1

TAG_CTRL = 1
TAG_KV = 2
TAG_INFO = 3
TAG_PING = 4
TAG_QKV = 100               # + mini-batch index
TAG_OUT = 200               # + mini-batch index
MAX_MINIBATCHES = 64

# control kinds
HELLO, PREFILL, DECODE, FREE, SHUTDOWN, ABORT, PROFILE, PING = 1, 2, 3, 4, 5, 6, 7, 8
KIND_NAMES = {HELLO: "HELLO", PREFILL: "PREFILL", DECODE: "DECODE", FREE: "FREE",
              SHUTDOWN: "SHUTDOWN", ABORT: "ABORT", PROFILE: "PROFILE", PING: "PING"}

ACT_DTYPES = {0: np.float32, 1: np.uint16}     # code -> numpy dtype (uint16 = bf16 bits)
ACT_CODES = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1}
KV_DTYPES = {0: "fp32", 1: "bf16", 2: "fp16"}
KV_CODES = {v: k for k, v in KV_DTYPES.items()}

HEADER_WORDS = 8
# header words: [magic, kind, step, a, b, c, d, e] with per-kind meaning:
#   HELLO:    a=num_layers b=num_kv_heads c=head_dim d=kv_dtype code e=num_heads; body: [scale_bits, threads, capacity_bytes, S-worker cores on its node]
#   PREFILL:  a=rows b=act dtype code c=layers in this step (0: all) d=reservations;
#             body: seq_ids[rows] (a prompt's rows consecutive), then d seq ids and d token counts to reserve
#   DECODE:   a=num_minibatches b=act dtype code c=layers in this step (0: all); body: counts[num_mb], seq_ids[sum counts]
#             (fewer layers than the model's: `fastdecode profile` times the R-part on the first few)
#   FREE:     a=n; body: seq_ids[n]
#   PROFILE:  a=seqs b=target_bytes; the worker times its kernel and sends JSON back (TAG_INFO)
#   PING:     a=repeats; body: message sizes in bytes; each size is echoed `repeats` times (TAG_PING)
#   SHUTDOWN / ABORT: no body


def control(kind: int, step: int = 0, a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0,
            body: list[np.ndarray] | None = None) -> np.ndarray:
    """A control message: int64[HEADER_WORDS + len(body)]."""
    head = np.array([MAGIC, kind, step, a, b, c, d, e], dtype=np.int64)
    parts = [head] + [np.asarray(p, dtype=np.int64).ravel() for p in (body or [])]
    return np.concatenate(parts)


def parse(msg: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
    """-> (kind, step, header words a..e, body). Raises ValueError on a foreign message."""
    if msg.shape[0] < HEADER_WORDS or msg[0] != MAGIC:
        raise ValueError(f"protocol error: control message without magic ({msg[:HEADER_WORDS]})")
    return int(msg[1]), int(msg[2]), msg[3:HEADER_WORDS], msg[HEADER_WORDS:]


def decode_bytes_per_row(num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int) -> tuple[int, int]:
    """Bytes on the wire per sequence per layer: (S->R: q,k,v, R->S: o)."""
    return (num_heads + 2 * num_kv_heads) * head_dim * itemsize, num_heads * head_dim * itemsize
