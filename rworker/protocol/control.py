"""Control messages between the S-worker (rank 0) and the R-workers: fixed-layout int64 arrays,
built and parsed here and nowhere else. numpy only; no pickle.

Per engine step the S-worker sends each R-worker, in this order:
  1. one control message (TAG_CTRL): a header, then the id arrays it announces;
  2. the data messages the header implies, with sizes known from it (so the receiver pre-posts
     them; their layout is rworker.protocol.wire):
       PREFILL: per layer one message [k rows | v rows]                (TAG_KV)
       DECODE:  per layer, per mini-batch m one message [q | k | v]    (tag_qkv(m))
     and gets back per (layer, mini-batch m) the attention output [n, Hq, D]   (tag_out(m)).
Between steps a KV_EXPORT / KV_IMPORT moves sequences' KV-caches as their store's blobs, uint8
messages on TAG_KVBLOB (see KV_EXPORT below).
Replies that are not activations (HELLO's roster entry, a PROFILE result) are JSON on TAG_INFO;
a decode step ends with the worker's float64 stats (STEP_STATS) on TAG_INFO.

Header: [MAGIC, VERSION, kind, step, a, b, c, d, e]; a..e mean what each builder below says.
Every message carries the version, so ranks running different fastdecode versions stop at the
first message, each naming both versions, instead of misreading each other.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from rworker.protocol.kvformat import ACT_DTYPES, KV_CODES, KV_DTYPES

MAGIC = 0x46444543          # "FDEC"
VERSION = 8                 # bump on any change to a message's layout or meaning
MAX_SEQ_ID = (1 << 53) - 1  # sequence ids are 0..MAX_SEQ_ID (the engine's stay far below)

# What an R-worker reports after each DECODE step, float64 each: kernel seconds, seconds not
# waiting for the S-worker, KV bytes held, the step number, prefill append seconds since the last
# report, KV bytes its shared prefix pages save (pages held once that several sequences read)
STEP_STATS = ("attend_s", "busy_s", "kv_bytes", "step", "append_s", "kv_saved_bytes")

# ---------------------------------------------------------------- tags

TAG_CTRL, TAG_KV, TAG_INFO, TAG_PING, TAG_KVBLOB = 1, 2, 3, 4, 5
MAX_BLOB_CHUNK = (1 << 31) - 1     # bytes of one blob message at most (MPI counts are C ints)
MAX_MINIBATCHES = 64        # pipeline depth limit: per-mini-batch tags come from disjoint ranges
TAG_QKV_BASE = 100
TAG_OUT_BASE = TAG_QKV_BASE + MAX_MINIBATCHES


def tag_qkv(mb: int) -> int:
    """Tag of mini-batch mb's [q | k | v] rows, S -> R."""
    return TAG_QKV_BASE + _minibatch(mb)


def tag_out(mb: int) -> int:
    """Tag of mini-batch mb's attention output, R -> S."""
    return TAG_OUT_BASE + _minibatch(mb)


def _minibatch(mb: int) -> int:
    if not 0 <= mb < MAX_MINIBATCHES:
        raise ProtocolError(f"mini-batch {mb} is outside 0..{MAX_MINIBATCHES - 1} (pipeline depth is at most "
                            f"{MAX_MINIBATCHES})")
    return mb

# ---------------------------------------------------------------- header

HELLO, PREFILL, DECODE, FREE, SHUTDOWN, ABORT, PROFILE, PING, KV_EXPORT, KV_IMPORT, LINK = range(1, 12)
KIND_NAMES = {HELLO: "HELLO", PREFILL: "PREFILL", DECODE: "DECODE", FREE: "FREE",
              SHUTDOWN: "SHUTDOWN", ABORT: "ABORT", PROFILE: "PROFILE", PING: "PING",
              KV_EXPORT: "KV_EXPORT", KV_IMPORT: "KV_IMPORT", LINK: "LINK"}
HEADER_WORDS = 9


class ProtocolError(ValueError):
    """A message this rank cannot read: another version, or a malformed header or body."""


def check_ids(ids: np.ndarray, what: str) -> np.ndarray:
    """Sequence ids of a message, each in 0..MAX_SEQ_ID."""
    if ids.size and (ids.min() < 0 or ids.max() > MAX_SEQ_ID):
        bad = ids[(ids < 0) | (ids > MAX_SEQ_ID)][0]
        raise ProtocolError(f"protocol error: {what} names sequence id {int(bad)}, outside 0..{MAX_SEQ_ID}")
    return ids


def control(kind: int, step: int = 0, a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0,
            body: list | None = None) -> np.ndarray:
    """A control message: int64[HEADER_WORDS + body words]."""
    head = np.array([MAGIC, VERSION, kind, step, a, b, c, d, e], dtype=np.int64)
    parts = [head] + [np.asarray(p, dtype=np.int64).ravel() for p in (body or [])]
    return np.concatenate(parts)


def parse(msg: np.ndarray, sender: str = "rank 0 (S-worker)") -> tuple[int, int, np.ndarray, np.ndarray]:
    """-> (kind, step, header words a..e, body). ProtocolError on a foreign or other-version message."""
    if msg.shape[0] < 2 or msg[0] != MAGIC:
        raise ProtocolError(f"protocol error: a control message from {sender} without the magic word "
                            f"({msg[:HEADER_WORDS].tolist()})")
    if msg[1] != VERSION:
        raise ProtocolError(f"{sender} speaks fastdecode protocol version {int(msg[1])}, this rank version "
                            f"{VERSION}: run the same fastdecode installation on every rank")
    if msg.shape[0] < HEADER_WORDS:
        raise ProtocolError(f"protocol error: a control message of {msg.shape[0]} words from {sender}")
    return int(msg[2]), int(msg[3]), msg[4:HEADER_WORDS], msg[HEADER_WORDS:]

# ---------------------------------------------------------------- HELLO


@dataclass(slots=True)
class Hello:
    """What an R-worker needs before it builds its store (the job's model shape and settings)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str               # one of KV_DTYPES
    scale: float                # softmax scale, usually head_dim ** -0.5
    threads: int = 0            # kernel threads (0: the R-worker picks)
    capacity_bytes: int = 0     # KV bytes it may hold (0: the R-worker picks)
    s_cores: int = 0            # cores the S-worker keeps on the R-worker's node, when it shares one
    bf16_probs: bool = False    # the job allows V in token pairs (--attn-probs bf16)
    windows: tuple[int, ...] = ()   # [num_layers] keys each layer's query attends (0: all); (): all full
    softcap: float = 0.0        # attention logit soft-cap (0: none)
    sinks: tuple[float, ...] = ()   # [num_layers * num_heads] learned sink logits; (): none
    s_kv_bytes: int = 0         # host memory the S-worker's own KV tier takes on its node (R-workers
                                # sharing that node split what is left)


# a=num_layers b=num_kv_heads c=head_dim d=kv dtype code e=num_heads;
# body: [scale as float64 bits, threads, capacity_bytes, s_cores, bf16_probs, softcap as float64 bits,
#        windows given (0/1), sinks given (0/1), s_kv_bytes], then num_layers windows if given, then
#        num_layers * num_heads sink logits as float64 bits if given
HELLO_BODY_WORDS = 9


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _float(bits) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def hello_message(h: Hello) -> np.ndarray:
    if h.windows and len(h.windows) != h.num_layers:
        raise ValueError(f"HELLO: {len(h.windows)} windows for {h.num_layers} layers")
    if h.sinks and len(h.sinks) != h.num_layers * h.num_heads:
        raise ValueError(f"HELLO: {len(h.sinks)} sink logits for {h.num_layers} layers x {h.num_heads} heads")
    body = [_bits(h.scale), h.threads, h.capacity_bytes, h.s_cores, int(h.bf16_probs), _bits(h.softcap),
            int(bool(h.windows)), int(bool(h.sinks)), h.s_kv_bytes]
    return control(HELLO, 0, h.num_layers, h.num_kv_heads, h.head_dim, KV_CODES[h.kv_dtype], h.num_heads,
                   body=[body, [int(w) for w in h.windows], [_bits(x) for x in h.sinks]])


def parse_hello(hdr: np.ndarray, body: np.ndarray) -> Hello:
    num_layers, num_kv_heads, head_dim, kv_code, num_heads = (int(x) for x in hdr)
    nwin = num_layers if body.size >= HELLO_BODY_WORDS and body[6] else 0
    nsink = num_layers * num_heads if body.size >= HELLO_BODY_WORDS and body[7] else 0
    if body.size != HELLO_BODY_WORDS + nwin + nsink or not 0 <= kv_code < len(KV_DTYPES):
        raise ProtocolError(f"protocol error: HELLO with {body.size} body words (expected "
                            f"{HELLO_BODY_WORDS + nwin + nsink}) or kv dtype code {kv_code}")
    rest = body[HELLO_BODY_WORDS:]
    return Hello(num_layers, num_heads, num_kv_heads, head_dim, KV_DTYPES[kv_code], _float(body[0]),
                 threads=int(body[1]), capacity_bytes=int(body[2]), s_cores=int(body[3]), bf16_probs=bool(body[4]),
                 softcap=_float(body[5]), windows=tuple(int(w) for w in rest[:nwin]),
                 sinks=tuple(_float(b) for b in rest[nwin:]), s_kv_bytes=int(body[8]))

# ---------------------------------------------------------------- PREFILL
# a=rows b=act dtype code c=layers in this step (0: all) d=reservations e=continued sequences;
# body: f (forks), seq_ids[rows] (a prompt's rows consecutive), then d seq ids and d token counts
# to reserve, then e seq ids whose earlier prompt chunks the worker holds (their rows append after
# them), then f fork destinations, f sources and f token counts. The worker runs the forks first,
# in order: destination i starts as a new sequence sharing the first tokens[i] tokens of source i
# (a sequence it held before, or an earlier destination; whole pages shared, refcounted by the
# store), and its rows append after them; then the reservations.


def prefill_message(step: int, row_ids: np.ndarray, act_code: int, layers: int,
                    reserve_ids: np.ndarray, reserve_tokens: np.ndarray,
                    continued: np.ndarray | None = None,
                    forks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    continued = np.zeros(0, np.int64) if continued is None else continued
    dst, src, tokens = forks if forks is not None else (np.zeros(0, np.int64),) * 3
    return control(PREFILL, step, len(row_ids), act_code, layers, len(reserve_ids), len(continued),
                   body=[[len(dst)], row_ids, reserve_ids, reserve_tokens, continued, dst, src, tokens])


@dataclass(slots=True)
class Prefill:
    row_ids: np.ndarray         # [rows] int64
    act_dtype: type             # numpy dtype of the K/V rows on the wire
    layers: int                 # 0: all of the model's
    reserve_ids: np.ndarray     # [d] sequences whose reservation the worker takes as pages now
    reserve_tokens: np.ndarray  # [d] KV tokens each reserves
    continued: np.ndarray       # [c] sequences whose earlier prompt chunks the worker holds (appended to)
    fork_dst: np.ndarray        # [f] new sequences that start sharing a prefix of ...
    fork_src: np.ndarray        # [f] ... these sequences the worker holds:
    fork_tokens: np.ndarray     # [f] their first this many tokens


def parse_prefill(hdr: np.ndarray, body: np.ndarray) -> Prefill:
    rows, act, layers, nres, ncont = int(hdr[0]), int(hdr[1]), int(hdr[2]), int(hdr[3]), int(hdr[4])
    nfork = int(body[0]) if body.size else -1
    if (rows < 0 or nres < 0 or ncont < 0 or nfork < 0 or act not in ACT_DTYPES
            or body.size != 1 + rows + 2 * nres + ncont + 3 * nfork):
        raise ProtocolError(f"protocol error: PREFILL announces {rows} rows, {nres} reservations, {ncont} "
                            f"continued sequences and {nfork} forks (activation code {act}), its body has "
                            f"{body.size} words")
    body = body[1:]
    row_ids = check_ids(body[:rows].copy(), "PREFILL")
    reserve_ids, tokens = check_ids(body[rows:rows + nres], "PREFILL's reservations"), body[rows + nres:rows + 2 * nres]
    if nres and ((tokens < 0).any() or not np.isin(reserve_ids, row_ids).all()):
        raise ProtocolError("protocol error: PREFILL reserves a negative token count or for a sequence it does not "
                            "prefill")
    at = rows + 2 * nres
    continued = check_ids(body[at:at + ncont], "PREFILL's continued sequences")
    if ncont and (not np.isin(continued, row_ids).all() or np.isin(reserve_ids, continued).any()):
        raise ProtocolError("protocol error: PREFILL continues a sequence it does not prefill, or reserves for one "
                            "it continues")
    at += ncont
    dst = check_ids(body[at:at + nfork], "PREFILL's fork destinations")
    src = check_ids(body[at + nfork:at + 2 * nfork], "PREFILL's fork sources")
    _check_forks(dst, src, body[at + 2 * nfork:], row_ids, continued)
    return Prefill(row_ids, ACT_DTYPES[act], layers, reserve_ids, tokens, continued, dst, src,
                   body[at + 2 * nfork:])


def _check_forks(dst: np.ndarray, src: np.ndarray, tokens: np.ndarray, row_ids: np.ndarray,
                 continued: np.ndarray) -> None:
    """A fork makes a new sequence of this prefill (a destination: among the rows, not continued,
    forked once) from one the worker already holds (a source: not a sequence this prefill starts,
    unless an earlier fork made it), with at least one token."""
    if not dst.size:
        return
    new = np.setdiff1d(row_ids, continued)
    short = np.flatnonzero(tokens < 1)
    if short.size:
        i = short[0]
        raise ProtocolError(f"protocol error: PREFILL forks sequence {int(dst[i])} with {int(tokens[i])} tokens of "
                            f"sequence {int(src[i])} (at least 1)")
    outside = dst[~np.isin(dst, new)]
    if outside.size:
        raise ProtocolError(f"protocol error: PREFILL forks sequence {int(outside[0])}, which it does not start (a "
                            f"fork destination must be a new sequence among its rows)")
    uniq, counts = np.unique(dst, return_counts=True)
    if (counts > 1).any():
        raise ProtocolError(f"protocol error: PREFILL forks sequence {int(uniq[counts > 1][0])} twice")
    earlier = {d: i for i, d in enumerate(dst.tolist())}
    started = [i for i in np.flatnonzero(np.isin(src, new)).tolist() if earlier.get(int(src[i]), i) >= i]
    if started:
        i = started[0]
        raise ProtocolError(f"protocol error: PREFILL forks sequence {int(dst[i])} from sequence {int(src[i])}, "
                            f"which it starts itself (a source must be held before the prefill, or forked before it)")

# ---------------------------------------------------------------- DECODE
# a=mini-batches b=act dtype code c=layers in this step (0: all; `fastdecode profile` times the
# R-part on the first few) d=mixed (1: a PREFILL control follows at once, and its K/V layers come
# interleaved with the decode rows: layer i's K/V before layer i's q/k/v);
# body: counts[mini-batches], then each mini-batch's seq ids


def decode_message(step: int, ids_per_minibatch: list[np.ndarray], act_code: int, layers: int,
                   mixed: bool = False) -> np.ndarray:
    n_mb = len(ids_per_minibatch)
    _minibatch(n_mb - 1)
    return control(DECODE, step, n_mb, act_code, layers, int(mixed), body=[[len(x) for x in ids_per_minibatch]]
                   + list(ids_per_minibatch))


@dataclass(slots=True)
class Decode:
    ids: list[np.ndarray]       # per mini-batch [n_m] int64 (empty: nothing is sent for it)
    act_dtype: type
    layers: int
    mixed: bool = False         # a PREFILL follows whose K/V layers interleave with this step's


def parse_decode(hdr: np.ndarray, body: np.ndarray) -> Decode:
    n_mb, act, layers, mixed = int(hdr[0]), int(hdr[1]), int(hdr[2]), int(hdr[3])
    if not 0 < n_mb <= MAX_MINIBATCHES or act not in ACT_DTYPES or body.size < n_mb or mixed not in (0, 1):
        raise ProtocolError(f"protocol error: DECODE with {n_mb} mini-batches (at most {MAX_MINIBATCHES}), "
                            f"activation code {act}, mixed flag {mixed}, {body.size} body words")
    counts = body[:n_mb]
    ends = np.cumsum(counts) + n_mb
    if (counts < 0).any() or body.size != ends[-1]:
        raise ProtocolError(f"protocol error: DECODE counts {counts.tolist()} do not match its {body.size} body words")
    ids = check_ids(body[n_mb:].copy(), "DECODE")
    if np.unique(ids).size != ids.size:
        raise ProtocolError("protocol error: DECODE names a sequence twice in one step")
    starts = ends - counts - n_mb
    return Decode([ids[s:e] for s, e in zip(starts, ends - n_mb)], ACT_DTYPES[act], layers, bool(mixed))

# ---------------------------------------------------------------- the rest
#   FREE:     a=n; body: seq_ids[n]
#   PROFILE:  a=seqs b=target_bytes; the worker times its kernel and sends JSON back (TAG_INFO)
#   PING:     a=repeats; body: message sizes in bytes; each size is echoed `repeats` times (TAG_PING)
#   LINK:     a=nonce b=path bytes; body: the path's UTF-8 bytes, 8 to a word. Sent after HELLO's
#             answer to an R-worker on the S-worker's node: attach the shared-memory link there
#             (rworker.host.shm_link) and answer JSON {"link": "ok" or why not} (TAG_INFO)
#   SHUTDOWN / ABORT: no body


def free_message(step: int, seq_ids: list[int]) -> np.ndarray:
    return control(FREE, step, len(seq_ids), body=[seq_ids])


def parse_free(hdr: np.ndarray, body: np.ndarray) -> np.ndarray:
    if int(hdr[0]) != body.size:
        raise ProtocolError(f"protocol error: FREE announces {int(hdr[0])} ids, its body has {body.size} words")
    return check_ids(body, "FREE")


def link_message(directory: str, nonce: int) -> np.ndarray:
    raw = directory.encode()
    words = np.frombuffer(raw + b"\0" * (-len(raw) % 8), dtype=np.int64)
    return control(LINK, 0, nonce, len(raw), body=[words])


def parse_link(hdr: np.ndarray, body: np.ndarray) -> tuple[str, int]:
    """-> (directory, nonce)."""
    nonce, size = int(hdr[0]), int(hdr[1])
    if not 0 < size <= body.size * 8 or body.size * 8 - size >= 8:
        raise ProtocolError(f"protocol error: LINK with a path of {size} bytes in {body.size} words")
    return body.astype(np.int64).tobytes()[:size].decode(), nonce


def decode_bytes_per_row(num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int) -> tuple[int, int]:
    """Bytes on the wire per sequence per layer: (S->R: q,k,v, R->S: o)."""
    return (num_heads + 2 * num_kv_heads) * head_dim * itemsize, num_heads * head_dim * itemsize

# ---------------------------------------------------------------- KV_EXPORT / KV_IMPORT
# A sequence's KV-cache moves as its store's blob (rworker.kvstore: export_seq / import_seq; opaque
# here), so that a stopped job's rerun reloads it instead of recomputing the prompt. Between steps only.
#   KV_EXPORT: a=n b=chunk; body: seq_ids[n]. The worker keeps the sequences and answers per sequence,
#              in order, on TAG_KVBLOB: int64[1] its blob's size in bytes (-1: it does not hold that
#              sequence), then the blob as uint8 messages of blob_chunks(size, chunk).
#   KV_IMPORT: a=n b=chunk; body: seq_ids[n], sizes[n] (bytes). The S-worker then sends each blob in
#              turn as uint8 messages of blob_chunks(size, chunk) on TAG_KVBLOB; the worker answers
#              with JSON on TAG_INFO: {"stored": [n] bool (false: past its capacity, nothing stored),
#              "refused": [[seq id, why], ...] (blobs its store would not take; stored false)}.
# chunk: bytes of one blob message at most (1..MAX_BLOB_CHUNK), the S-worker's choice.


@dataclass(slots=True)
class KVMove:
    seq_ids: np.ndarray         # [n] int64, distinct
    sizes: np.ndarray           # [n] int64 blob bytes (KV_IMPORT; empty for KV_EXPORT)
    chunk: int                  # bytes of one blob message at most


def kv_export_message(step: int, seq_ids, chunk: int = MAX_BLOB_CHUNK) -> np.ndarray:
    return control(KV_EXPORT, step, len(seq_ids), chunk, body=[seq_ids])


def kv_import_message(step: int, seq_ids, sizes, chunk: int = MAX_BLOB_CHUNK) -> np.ndarray:
    if len(sizes) != len(seq_ids):
        raise ValueError(f"KV_IMPORT: {len(sizes)} blob sizes for {len(seq_ids)} sequences")
    return control(KV_IMPORT, step, len(seq_ids), chunk, body=[seq_ids, sizes])


def parse_kv_move(kind: int, hdr: np.ndarray, body: np.ndarray) -> KVMove:
    """A KV_EXPORT's or KV_IMPORT's ids (and blob sizes), checked."""
    n, chunk, name = int(hdr[0]), int(hdr[1]), KIND_NAMES.get(kind, str(kind))
    want = 2 * n if kind == KV_IMPORT else n
    if n < 0 or body.size != want or not 0 < chunk <= MAX_BLOB_CHUNK:
        raise ProtocolError(f"protocol error: {name} announces {n} sequences in chunks of {chunk} bytes (1.."
                            f"{MAX_BLOB_CHUNK}), its body has {body.size} words")
    ids = check_ids(body[:n].copy(), name)
    if np.unique(ids).size != n:
        raise ProtocolError(f"protocol error: {name} names a sequence twice")
    sizes = body[n:].copy()
    if (sizes < 0).any():
        raise ProtocolError(f"protocol error: {name} announces a blob of {int(sizes.min())} bytes")
    return KVMove(ids, sizes, chunk)


def blob_chunks(size: int, chunk: int = MAX_BLOB_CHUNK) -> list[tuple[int, int]]:
    """[(start, end)] byte ranges of a blob's messages: each at most `chunk` bytes (none for 0 bytes)."""
    if size < 0 or not 0 < chunk <= MAX_BLOB_CHUNK:
        raise ValueError(f"a blob of {size} bytes in chunks of {chunk} bytes (1..{MAX_BLOB_CHUNK})")
    return [(s, min(s + chunk, size)) for s in range(0, size, chunk)]
