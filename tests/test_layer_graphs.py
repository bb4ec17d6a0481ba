"""CUDA graphs of the per-layer dense work (model/layer_graphs.py) against the plain decode path.

The graph path keeps each mini-batch's residual stream in static, padded buffers and replays
post_attn + the next QKV projection; a stale input address, a missed copy or padding rows that
leak show as Q/K/V on the wire or final hidden states that differ from the plain path's. On a
CPU the same padded static-buffer path runs eagerly (capture=False); on a GPU the graphs are
captured and replayed.
The decode steps run through the loopback R-part (every S-worker transport step, fixed finite
attention outputs), so both paths see the same inputs.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fastdecode.model.layer_graphs import MIN_BUCKET, LayerGraphs, bucket_rows

SMALL = "random:llama-3-8b:layers=3:hidden=256:heads=8:kv_heads=2:head_dim=32:intermediate=512:vocab=1000"

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (device, --quantization): fp8 weights run their GEMMs inside the graphs too (fp8.linear)
DEVICES = [pytest.param("cpu", None, id="cpu-eager"), pytest.param("cpu", "fp8", id="cpu-eager-fp8"),
           pytest.param("cuda", None, id="cuda-captured", marks=NO_CUDA),
           pytest.param("cuda", "fp8", id="cuda-captured-fp8", marks=NO_CUDA)]


@given(st.integers(1, 100_000))
def test_bucket_rows_bounds_the_padding(n):
    b = bucket_rows(n)
    assert b >= n and b % 8 == 0
    assert b == MIN_BUCKET if n <= MIN_BUCKET else 2 * b < 3 * n         # padding < a third of the bucket
    assert bucket_rows(b) == b                                            # buckets are fixed points


def _final_states(runner, model, seqs):
    """Token ids, the hidden states the LM head saw (per mini-batch, in row order) and every
    Q|K|V wire buffer handed to the R-part (per layer and mini-batch)."""
    seen, wire = [], []
    logits, backend = model.logits, runner.backend
    submit = backend.decode_submit
    model.logits = lambda x: (seen.append(x.float().cpu().clone()), logits(x))[1]
    backend.decode_submit = lambda layer, mb, packed: (wire.append(packed.float().cpu().clone()),
                                                       submit(layer, mb, packed))[1]
    try:
        ordered, tokens, _ = runner.decode(seqs)
    finally:
        model.logits = logits
        del backend.decode_submit
    return [s.seq_id for s in ordered], tokens, torch.cat(seen), torch.cat(wire)


@pytest.mark.parametrize("device,quantization", DEVICES)
def test_graph_path_matches_the_plain_path(device, quantization):
    from fastdecode.engine.args import EngineArgs
    from fastdecode.engine.harness import fake_sequences
    from fastdecode.engine.llm_engine import LLMEngine
    from fastdecode.engine.runner import ModelRunner
    from fastdecode.rpart.loopback import LoopbackBackend

    dtype = "float32" if device == "cpu" else "bfloat16"
    engine = LLMEngine(EngineArgs(model=SMALL, device=device, dtype=dtype, max_batch=4096, quantization=quantization))
    m, c = engine.model, engine.config
    loop = LoopbackBackend(c.num_heads, c.head_dim, m.device, m.dtype)
    graphs = LayerGraphs(m, max_rows=256, capture=device == "cuda")
    tol = {"rtol": 1e-5, "atol": 1e-5} if device == "cpu" else {"rtol": 3e-2, "atol": 3e-2}
    # batches that change bucket, shrink within one (stale padded rows) and repeat one (replays)
    for step, batch in enumerate((37, 200, 30, 37, 512)):
        seqs = fake_sequences(batch, 9 + step, c.vocab_size, first_id=1 + 1000 * step)
        for s in seqs:                                    # different tokens at every step
            s.output_ids[-1] = (s.seq_id * 7 + step) % c.vocab_size
        for depth in (1, 2):
            plain = _final_states(ModelRunner(m, loop, engine.eos_ids, depth), m, seqs)
            graph = _final_states(ModelRunner(m, loop, engine.eos_ids, depth, graphs), m, seqs)
            assert graph[0] == plain[0]
            torch.testing.assert_close(graph[3], plain[3], **tol)      # what the R-workers would attend
            torch.testing.assert_close(graph[2], plain[2], **tol)
            if device == "cpu":
                assert (graph[1] == plain[1]).all(), f"batch {batch}, depth {depth}: tokens differ"
    if device == "cuda":        # 512 rows in one mini-batch is past max_rows: that step ran eagerly
        assert graphs.captures == len(graphs.graphs) > 0
        assert not any(key[2] > 256 for key in graphs.graphs)


def test_cuda_graphs_on_a_cpu_s_worker_run_eagerly(capsys):
    from fastdecode.engine.args import EngineArgs
    from fastdecode.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model=SMALL, device="cpu", cuda_graphs=True))
    assert engine.runner.graphs is None
    assert "--cuda-graphs needs a CUDA S-worker" in capsys.readouterr().err
