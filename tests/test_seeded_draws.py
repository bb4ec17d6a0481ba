"""A sampled request's draws depend on its seed (its custom_id where it names none), sample index
and position only: never on what shares its batch or its prompt's pages, on the R-workers, or on a
stop and resume (docs/usage.md, "Reproducibility")."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import batch_line, read_output, run_fastdecode
from inprocess import generate

from fastdecode.engine.sampler import SamplingBatch, sample
from fastdecode.engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Tell me a short story about a fox who learns to swim in the river."}]
CHAT = "/v1/chat/completions"
# a neighbour that shares the prompt's pages, samples n = 2 and filters (top_p): its rows sort
NEIGHBOUR = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "n": 2}
SEEDED = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.7, "seed": 113}
UNSEEDED = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.7}      # seeded from its custom_id
WATCHED = ("seeded", "fixed")


def test_a_rows_draw_is_the_same_alone_and_beside_a_filtering_row():
    """A plain row's token from the same logits, seed and position, alone and in a batch whose other
    row filters with top-k/top-p (before: the whole batch then drew in sorted order)."""
    logits = torch.randn(2, 512, generator=torch.Generator().manual_seed(0)) * 3
    plain, filtered = SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9, top_k=40)
    moved = []
    for seed in range(32):
        alone = sample(logits[:1], SamplingBatch([(plain, seed, 0, 5, None)], "cpu"))[0]
        both = sample(logits, SamplingBatch([(plain, seed, 0, 5, None), (filtered, seed, 1, 5, None)], "cpu"))
        filtered_alone = sample(logits[1:], SamplingBatch([(filtered, seed, 1, 5, None)], "cpu"))[0]
        moved += [(seed, int(alone), int(both[0]))] if alone != both[0] else []
        assert both[1] == filtered_alone
    assert not moved, f"(seed, alone, in the batch): {moved}"


def test_a_filtering_rows_draw_keeps_its_distribution():
    """The sorted walk still draws from the filtered distribution: top_k=1 is greedy, and a plain
    row's frequencies follow its probabilities."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    greedy_k = SamplingParams(temperature=1.0, top_k=1)
    rows = [(greedy_k, s, 0, 0, None) for s in range(64)] + [(SamplingParams(temperature=1.0), s, 0, 0, None)
                                                             for s in range(4000)]
    tokens = sample(logits.expand(len(rows), 4).contiguous(), SamplingBatch(rows, "cpu"))
    assert (tokens[:64] == 3).all()
    freq = np.bincount(tokens[64:], minlength=4) / 4000
    assert np.allclose(freq, torch.softmax(logits[0], -1).numpy(), atol=0.03)


def job(path, lines) -> None:
    path.write_text("".join(batch_line(cid, body, CHAT) + "\n" for cid, body in lines))


def texts(out) -> dict[str, list[str]]:
    """custom_id -> the text of each choice, for the lines watched."""
    return {r["custom_id"]: [c["message"]["content"] for c in r["response"]["body"]["choices"]]
            for r in read_output(str(out)) if r["custom_id"] in WATCHED}


MIXED = [("neighbour", NEIGHBOUR), ("seeded", SEEDED), ("fixed", UNSEEDED)]


@pytest.fixture(scope="module")
def alone(llm, tmp_path_factory):
    """Each watched line run by itself: the texts every other run must give."""
    tmp, got = tmp_path_factory.mktemp("alone"), {}
    for cid, body in MIXED[1:]:
        job(tmp / f"{cid}.jsonl", [(cid, body)])
        _, _, code = generate(llm.engine, ["-i", str(tmp / f"{cid}.jsonl"), "-o", str(tmp / f"{cid}.out")])
        assert code == 0
        got.update(texts(tmp / f"{cid}.out"))
    assert set(got) == set(WATCHED)
    return got


def test_seeded_lines_beside_an_n2_neighbour_sharing_their_pages_draw_as_alone(llm, tmp_path, alone):
    job(tmp_path / "in.jsonl", MIXED)
    _, _, code = generate(llm.engine, ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert code == 0 and llm.engine.prefix is not None
    assert texts(tmp_path / "out.jsonl") == alone


def test_without_prefix_sharing_the_lines_draw_as_alone(tmp_path, alone):
    from fastdecode import LLM
    plain = LLM("smollm2-135m", kv_dtype="fp32", dtype="float32", device="cpu", prefix_sharing=False)
    try:
        job(tmp_path / "in.jsonl", MIXED)
        _, _, code = generate(plain.engine, ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    finally:
        plain.close()
    assert code == 0 and texts(tmp_path / "out.jsonl") == alone


def test_a_job_stopped_mid_decode_and_resumed_draws_as_alone(llm, tmp_path, alone):
    job(tmp_path / "in.jsonl", MIXED)
    args = ["-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    _, _, code = generate(llm.engine, args, stop_at=6)
    assert code == 75 and (tmp_path / "out.jsonl.inflight").exists()
    _, _, code = generate(llm.engine, args)
    assert code == 0 and texts(tmp_path / "out.jsonl") == alone


def test_llm_chat_beside_a_filtering_n2_neighbour_draws_as_alone(llm):
    from fastdecode import SamplingParams as Params
    neighbour = Params(max_tokens=16, temperature=0.7, top_p=0.9, n=2)
    seeded = Params(max_tokens=16, temperature=0.7, seed=113)
    alone_out = llm.chat([MESSAGES], [seeded], use_tqdm=False)[0].outputs[0].token_ids
    pair = llm.chat([MESSAGES, MESSAGES], [neighbour, seeded], use_tqdm=False)
    assert pair[1].outputs[0].token_ids == alone_out


@pytest.mark.parametrize("ranks", [2, 3])
def test_under_mpiexec_the_lines_draw_as_alone(tmp_path, alone, ranks):
    job(tmp_path / "in.jsonl", MIXED)
    proc = run_fastdecode(["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                           "--kv-dtype", "fp32", "--quiet"], ranks=ranks, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert texts(tmp_path / "out.jsonl") == alone
