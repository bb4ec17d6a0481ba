"""The S-worker <-> R-worker protocol (rworker/protocol): messages round-trip, tags never collide,
the mini-batch limit holds on both sides, and ranks of different versions stop at once, naming
both versions."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import MPIEXEC, REPO

from rworker.protocol import control as P
from rworker.protocol.kvformat import ACT_CODES, KV_DTYPES
from rworker.protocol.wire import WireLayout, split_kv, split_qkv


def test_tags_are_distinct_for_every_minibatch():
    tags = [P.TAG_CTRL, P.TAG_KV, P.TAG_INFO, P.TAG_PING, P.TAG_KVBLOB]
    tags += [P.tag_qkv(m) for m in range(P.MAX_MINIBATCHES)] + [P.tag_out(m) for m in range(P.MAX_MINIBATCHES)]
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("mb", [-1, P.MAX_MINIBATCHES, 100])
def test_a_minibatch_past_the_limit_has_no_tag(mb):
    with pytest.raises(P.ProtocolError, match="mini-batch"):
        P.tag_qkv(mb)
    with pytest.raises(P.ProtocolError, match="mini-batch"):
        P.tag_out(mb)


def test_hello_round_trips():
    hello = P.Hello(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, kv_dtype="bf16", scale=64 ** -0.5,
                    threads=3, capacity_bytes=5 << 30, s_cores=1, bf16_probs=True)
    kind, step, hdr, body = P.parse(P.hello_message(hello))
    assert kind == P.HELLO and body.size == P.HELLO_BODY_WORDS
    assert P.parse_hello(hdr, body) == hello            # the scale's float64 bits too


def test_hello_carries_the_attention_variants():
    sinks = tuple(float(x) for x in np.random.default_rng(0).normal(size=3 * 4))
    hello = P.Hello(3, 4, 2, 256, "bf16", 224 ** -0.5, windows=(512, 0, 512), softcap=50.0, sinks=sinks)
    kind, step, hdr, body = P.parse(P.hello_message(hello))
    assert body.size == P.HELLO_BODY_WORDS + 3 + 12
    back = P.parse_hello(hdr, body)
    assert back == hello and back.sinks == sinks          # float64 bits, exactly
    with pytest.raises(ValueError, match="2 windows for 3 layers"):
        P.hello_message(P.Hello(3, 4, 2, 8, "bf16", 0.5, windows=(4, 0)))
    with pytest.raises(ValueError, match="5 sink logits"):
        P.hello_message(P.Hello(3, 4, 2, 8, "bf16", 0.5, sinks=(0.0,) * 5))
    with pytest.raises(P.ProtocolError, match="body words"):
        P.parse_hello(hdr, body[:-1])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_hello_carries_every_kv_dtype(kv_dtype):
    hello = P.Hello(2, 4, 2, 8, kv_dtype, 0.5)
    assert P.parse_hello(*P.parse(P.hello_message(hello))[2:]).kv_dtype == kv_dtype


def test_prefill_round_trips():
    ids = np.repeat(np.array([7, 9], np.int64), [3, 2])
    msg = P.prefill_message(4, ids, ACT_CODES[np.dtype(np.uint16)], 2, np.array([7, 9]), np.array([64, 96]))
    kind, step, hdr, body = P.parse(msg)
    got = P.parse_prefill(hdr, body)
    assert (kind, step, got.layers, got.act_dtype) == (P.PREFILL, 4, 2, np.uint16)
    assert got.row_ids.tolist() == ids.tolist()
    assert got.reserve_ids.tolist() == [7, 9] and got.reserve_tokens.tolist() == [64, 96]


def test_prefill_whose_body_disagrees_with_its_header_is_refused():
    msg = P.prefill_message(1, np.arange(4), 0, 0, np.array([1]), np.array([32]))
    _, _, hdr, body = P.parse(msg)
    with pytest.raises(P.ProtocolError, match="PREFILL announces 4 rows, 1 reservations, 0 continued sequences and 0 forks"):
        P.parse_prefill(hdr, body[:-1])


def test_a_prefill_chunk_names_the_sequences_it_continues():
    ids = np.repeat(np.array([7, 9], np.int64), [3, 2])
    msg = P.prefill_message(5, ids, 0, 0, np.array([9]), np.array([64]), np.array([7]))
    got = P.parse_prefill(*P.parse(msg)[2:])
    assert got.continued.tolist() == [7] and got.reserve_ids.tolist() == [9]
    for reserve, continued in (([], [8]), ([7], [7])):     # not in the chunk; reserved and continued
        msg = P.prefill_message(5, ids, 0, 0, np.array(reserve, np.int64), np.array([64] * len(reserve)),
                                np.array(continued, np.int64))
        with pytest.raises(P.ProtocolError, match="continues a sequence it does not prefill, or reserves"):
            P.parse_prefill(*P.parse(msg)[2:])


def forks(*triples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.array(col, np.int64).reshape(-1) for col in zip(*triples)) if triples else None


def test_a_prefill_carries_forks_in_order_and_a_fork_may_start_from_an_earlier_one():
    ids = np.repeat(np.array([7, 9, 11], np.int64), [3, 2, 1])
    msg = P.prefill_message(6, ids, 0, 0, np.array([9, 11]), np.array([96, 64]), np.array([7]),
                            forks((9, 3, 64), (11, 9, 32)))          # 11 from 9, forked just before it
    got = P.parse_prefill(*P.parse(msg)[2:])
    assert got.fork_dst.tolist() == [9, 11] and got.fork_src.tolist() == [3, 9]
    assert got.fork_tokens.tolist() == [64, 32] and got.continued.tolist() == [7]
    assert got.reserve_ids.tolist() == [9, 11]                     # a forked sequence reserves too
    plain = P.parse_prefill(*P.parse(P.prefill_message(6, ids, 0, 0, np.zeros(0, np.int64),
                                                       np.zeros(0, np.int64)))[2:])
    assert plain.fork_dst.size == plain.fork_src.size == plain.fork_tokens.size == 0


@pytest.mark.parametrize("triples,needle", [
    (((9, 3, 0),), "forks sequence 9 with 0 tokens of sequence 3"),
    (((8, 3, 32),), "forks sequence 8, which it does not start"),             # not among the rows
    (((7, 3, 32),), "forks sequence 7, which it does not start"),             # continued, not new
    (((9, 3, 32), (9, 4, 32)), "forks sequence 9 twice"),
    (((9, 11, 32),), "forks sequence 9 from sequence 11, which it starts itself"),
    (((9, 11, 32), (11, 3, 32)), "forks sequence 9 from sequence 11, which it starts itself"),   # 11 later
])
def test_a_prefill_with_a_bad_fork_is_refused_naming_it(triples, needle):
    ids = np.repeat(np.array([7, 9, 11], np.int64), [3, 2, 1])
    msg = P.prefill_message(6, ids, 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), np.array([7]),
                            forks(*triples))
    with pytest.raises(P.ProtocolError, match=needle):
        P.parse_prefill(*P.parse(msg)[2:])


def test_a_prefill_whose_fork_count_disagrees_with_its_body_is_refused():
    msg = P.prefill_message(6, np.array([9], np.int64), 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64),
                            None, forks((9, 3, 32)))
    _, _, hdr, body = P.parse(msg)
    with pytest.raises(P.ProtocolError, match="1 forks"):
        P.parse_prefill(hdr, body[:-1])


def test_decode_round_trips_with_empty_minibatches():
    ids = [np.array([3, 1], np.int64), np.array([], np.int64), np.array([8], np.int64)]
    kind, step, hdr, body = P.parse(P.decode_message(9, ids, 0, 0))
    got = P.parse_decode(hdr, body)
    assert (kind, step, got.layers, got.act_dtype) == (P.DECODE, 9, 0, np.float32)
    assert [x.tolist() for x in got.ids] == [[3, 1], [], [8]]


def test_more_minibatches_than_the_limit_are_refused_on_both_sides():
    too_many = [np.array([i], np.int64) for i in range(P.MAX_MINIBATCHES + 1)]
    with pytest.raises(P.ProtocolError, match="mini-batch"):
        P.decode_message(1, too_many, 0, 0)
    # a peer that sent one anyway (built by hand) is refused by the parser
    msg = P.control(P.DECODE, 1, len(too_many), 0, 0, body=[[1] * len(too_many)] + too_many)
    _, _, hdr, body = P.parse(msg)
    with pytest.raises(P.ProtocolError, match=f"at most {P.MAX_MINIBATCHES}"):
        P.parse_decode(hdr, body)


def test_decode_counts_that_disagree_with_the_body_are_refused():
    msg = P.decode_message(1, [np.array([1, 2, 3], np.int64)], 0, 0)
    _, _, hdr, body = P.parse(msg)
    with pytest.raises(P.ProtocolError, match="counts"):
        P.parse_decode(hdr, body[:-1])


def test_a_message_of_another_version_names_both_versions(monkeypatch):
    msg = P.control(P.FREE, 1, 1, body=[[5]])
    monkeypatch.setattr(P, "VERSION", P.VERSION + 1)
    with pytest.raises(P.ProtocolError, match=rf"version {P.VERSION - 1}, this rank version {P.VERSION}"):
        P.parse(msg)


def test_a_message_without_the_magic_word_is_refused():
    msg = P.control(P.SHUTDOWN)
    msg[0] = 12345
    with pytest.raises(P.ProtocolError, match="magic"):
        P.parse(msg)


def test_wire_layout_splits_numpy_blocks_as_its_offsets_say():
    hq, hkv, d = 4, 2, 8
    layout = WireLayout([2, 0, 3], hq, hkv, d)
    buf = np.arange(layout.numel(), dtype=np.float32)
    off = layout.offsets()
    for (s, e), (q, k, v) in zip(layout.bounds(), layout.views(buf)):
        for r in range(e - s):
            assert q[r, 0, 0] == off[s + r, 0] and k[r, 0, 0] == off[s + r, 1] and v[r, 0, 0] == off[s + r, 2]
    q, k, v = split_qkv(buf[slice(*layout.block(2))], 3, hq, hkv, d)
    assert np.shares_memory(q, buf) and q.shape == (3, hq, d) and v.shape == (3, hkv, d)
    k2, v2 = split_kv(np.arange(2 * 3 * hkv * d), 3, hkv, d)
    assert k2[0, 0, 0] == 0 and v2[0, 0, 0] == 3 * hkv * d


SCRIPT = """
import sys
from mpi4py import MPI
from rworker.protocol import control
if MPI.COMM_WORLD.Get_rank() == int(sys.argv[1]):
    control.VERSION += 1          # this rank runs another fastdecode
from fastdecode.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("odd_rank", [0, 1], ids=["s-worker-newer", "r-worker-newer"])
def test_ranks_of_different_versions_stop_at_start_up_naming_both(tmp_path, odd_rank):
    if MPIEXEC is None:
        pytest.fail("mpiexec not found: install it with `pip install mpich`")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}\n')
    script = tmp_path / "odd_version.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FASTDECODE_NO_SUPERVISOR": "1"}
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), str(odd_rank), "generate", "-i",
                           str(inp), "-o", str(tmp_path / "out.jsonl"), "--quiet", "--timeout", "60"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode != 0
    newer, older = P.VERSION + 1, P.VERSION
    s_version, r_version = (newer, older) if odd_rank == 0 else (older, newer)
    assert "rank 1 (R-worker" in proc.stderr, proc.stderr[-2000:]
    assert f"speaks fastdecode protocol version {s_version}, this rank version {r_version}" in proc.stderr, \
        proc.stderr[-2000:]


def test_a_pipeline_deeper_than_the_protocol_allows_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fastdecode", "generate", "-i", str(tmp_path / "in.jsonl"),
                           "-o", str(tmp_path / "out.jsonl"), "--pipeline-depth", str(P.MAX_MINIBATCHES + 1)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2
    assert f"at most {P.MAX_MINIBATCHES} mini-batches in flight" in proc.stderr


def test_the_engine_refuses_a_pipeline_deeper_than_the_protocol_allows():
    import torch

    from fastdecode.engine.args import EngineArgs, resolve_batch_limits
    from fastdecode.model.config import config_from_hf_dict
    from fastdecode.model.source import random_config_dict
    config = config_from_hf_dict(random_config_dict("random:smollm2-135m:layers=1"), "random")
    with pytest.raises(ValueError, match=f"pipeline_depth must be in 1..{P.MAX_MINIBATCHES}"):
        resolve_batch_limits(EngineArgs(pipeline_depth=P.MAX_MINIBATCHES + 1), torch.device("cpu"), config,
                             torch.float32)
