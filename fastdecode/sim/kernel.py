"""One decode step as events: the hot loop of `fastdecode simulate`, compiled by numba where it is
installed and run as plain Python where not (the same code, so the same results: tests hold it).

The engine's decode step (fastdecode/engine/runner.py, ModelRunner.decode) with `depth`
mini-batches cut by R-load: per layer and mini-batch, in the S-worker's order (layer by layer,
mini-batch by mini-batch), one S-part task (post-attention of the layer before and this layer's
Q, K, V), the Q, K, V out over the link, every R-worker holding rows of the mini-batch attends
them (its own queue, first come first served), the outputs back over the link, then the hand-off
`hop` before the S-worker can use them. After the last layer each mini-batch's LM head and
sampling. Resources: the S-worker, the link out, the link back (full duplex: a message each way
can be in flight at once) and each R-worker, each serving one task at a time. Tasks reach every
resource in the order the loops below visit them, so the loops are the event order.

The S-worker's own KV tier (rpart/tiered.py) is one more worker, `tier`, whose rows never cross
the link: once a mini-batch's S-part is done its R-workers' rows leave, then the S-worker attends
the tier's rows itself (its call overhead plus its seconds per token read) while they are away,
and the mini-batch goes on when both are back.
"""
from __future__ import annotations

import numpy as np

RESULT_FIELDS = ("decode_s", "s_busy_s", "link_out_busy_s", "link_back_busy_s")   # then r_busy_s per worker


def snake_split(kv_len: np.ndarray, seq_id: np.ndarray, depth: int) -> np.ndarray:
    """[n] mini-batch of each row, as the engine's split_by_r_load cuts them: rows sorted longest
    first (ties by sequence id) dealt out 0, 1, .., d-1, d-1, .., 0, 0, 1, .."""
    n = kv_len.size
    d = max(1, min(depth, n))
    by_id = np.argsort(seq_id, kind="mergesort")
    order = by_id[np.argsort(-kv_len[by_id], kind="mergesort")]
    mb = np.zeros(n, np.int64)
    for i in range(n):
        pos = i % (2 * d)
        mb[order[i]] = pos if pos < d else 2 * d - 1 - pos
    return mb


def link_time(nbytes: float, latency: float, bandwidth: float, msg_bytes: np.ndarray, msg_time: np.ndarray) -> float:
    """LinkProfile.time: the measured table where it covers the size, latency + size/bandwidth elsewhere."""
    if nbytes <= 0:
        return 0.0
    if msg_bytes.size > 0 and msg_bytes[0] <= nbytes <= msg_bytes[-1]:
        return np.interp(nbytes, msg_bytes, msg_time)
    return latency + nbytes / bandwidth


def decode_step(kv_len: np.ndarray, read_tokens: np.ndarray, seq_id: np.ndarray, worker: np.ndarray,
                depth: int, num_workers: int, layers: int, s_table: np.ndarray, head_s: float,
                r_token_s: np.ndarray, r_call_s: np.ndarray, out_bytes_row: float, back_bytes_row: float,
                link: np.ndarray, msg_bytes: np.ndarray, msg_time: np.ndarray, tier: int = -1) -> np.ndarray:
    """Times of one decode step over n running rows. kv_len [n] tokens attended (ordering of the
    split), read_tokens [n] of them read per layer (windows), seq_id [n], worker [n] in 0..W-1;
    s_table [B+1] S-part seconds of one layer at each mini-batch size; head_s LM head and sampling
    of the whole batch (shared by the mini-batches by rows); r_token_s [W] seconds per read token
    per layer, r_call_s [W] per call; link [6] = latency, bandwidth, device d2h and h2d bytes/s
    (0: none), hop, unused; tier the worker that is the S-worker's own tier (-1: none).
    -> [4 + W]: RESULT_FIELDS (s_busy_s: the S-part, the head and the tier's attention), then each
    worker's busy seconds (the tier's its attention)."""
    n = kv_len.size
    out = np.zeros(4 + num_workers)
    if n == 0:
        return out
    mb = snake_split(kv_len, seq_id, depth)
    d = int(mb.max()) + 1
    rows = np.zeros(d, np.int64)
    link_rows = np.zeros(d, np.int64)          # rows that cross the link (not the tier's)
    r_cost = np.zeros((d, num_workers))        # [d, W] seconds of one layer's attention
    r_rows = np.zeros((d, num_workers), np.int64)
    for i in range(n):
        rows[mb[i]] += 1
        if worker[i] != tier:
            link_rows[mb[i]] += 1
        r_cost[mb[i], worker[i]] += read_tokens[i] * r_token_s[worker[i]]
        r_rows[mb[i], worker[i]] += 1
    s_cost, head, t_out, t_back = np.zeros(d), np.zeros(d), np.zeros(d), np.zeros(d)
    tier_cost = np.zeros(d)
    for m in range(d):
        s_cost[m] = s_table[rows[m]]
        head[m] = head_s * rows[m] / n
        b_out, b_back = link_rows[m] * out_bytes_row, link_rows[m] * back_bytes_row
        t_out[m] = link_time(b_out, link[0], link[1], msg_bytes, msg_time) + (b_out / link[2] if link[2] > 0 else 0.0)
        t_back[m] = link_time(b_back, link[0], link[1], msg_bytes, msg_time) + \
            (b_back / link[3] if link[3] > 0 else 0.0)
        for w in range(num_workers):
            if r_rows[m, w] > 0:
                r_cost[m, w] += r_call_s[w]
        if tier >= 0:
            tier_cost[m] = r_cost[m, tier]
    s_free, out_free, back_free = 0.0, 0.0, 0.0
    r_free = np.zeros(num_workers)
    ready = np.zeros(d)                 # when each mini-batch's attention output is back at the S-worker
    for _layer in range(layers):
        for m in range(d):
            s_free = max(s_free, ready[m]) + s_cost[m]
            back = s_free
            if link_rows[m] > 0:        # the R-workers' rows leave first
                out_free = max(out_free, s_free) + t_out[m]
                done = out_free
                for w in range(num_workers):
                    if r_rows[m, w] > 0 and w != tier:
                        r_free[w] = max(r_free[w], out_free) + r_cost[m, w]
                        done = max(done, r_free[w])
                back_free = max(back_free, done) + t_back[m]
                back = back_free + link[4]
            s_free += tier_cost[m]      # then the S-worker attends the tier's rows while they are away
            ready[m] = max(back, s_free)
    for m in range(d):
        s_free = max(s_free, ready[m]) + head[m]
    out[0] = s_free
    out[1] = layers * (s_cost.sum() + tier_cost.sum()) + head.sum()
    out[2] = layers * t_out.sum()
    out[3] = layers * t_back.sum()
    for w in range(num_workers):
        out[4 + w] = layers * r_cost[:, w].sum()
    return out


def compiled():
    """decode_step compiled by numba, or None where numba is not installed."""
    try:
        import numba
    except ImportError:
        return None
    jit = numba.njit(cache=True)
    split, ltime = jit(snake_split), jit(link_time)
    env = dict(decode_step.__globals__, snake_split=split, link_time=ltime)
    fn = type(decode_step)(decode_step.__code__, env, "decode_step", decode_step.__defaults__)
    return jit(fn)


_COMPILED: list = []


def step_function(use_numba: bool = True):
    """The decode step to run: compiled (compiled once per process) unless use_numba is False or
    numba is missing."""
    if not use_numba:
        return decode_step
    if not _COMPILED:
        _COMPILED.append(compiled())
    return _COMPILED[0] or decode_step
