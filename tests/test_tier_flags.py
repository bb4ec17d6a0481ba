"""The S-worker's own KV tier's flags are checked as usage: a --device-kv-memory of a few bytes (a
size without its unit) is less than one KV page, one past the machine's memory is refused in local
mode too (where no tier is sized), and a CPU tier that leaves the R-workers on its node no memory
is named on rank 0 with exit 2, not found as an R-worker's failure at start-up."""
from __future__ import annotations

import psutil
import pytest
import torch
from conftest import batch_line, run_fastdecode

from fastdecode.engine.kv_tiers import choose_tier
from fastdecode.model.config import ConfigError
from rworker.host.capacity import default_capacity_bytes

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_torch_tier(monkeypatch):
    monkeypatch.delenv("FASTDECODE_DEVICE_TIER", raising=False)


def more_than_is_available() -> int:
    """A size past what the node has available after the reserve, within its memory."""
    room, total = default_capacity_bytes(), psutil.virtual_memory().total
    return room + (total - room) // 2


def test_a_tier_smaller_than_a_page_names_the_unit():
    token = 30 * 2 * 3 * 64 * 4                       # smollm2-135m, fp32 KV: 30 layers, 3 KV heads of 64
    with pytest.raises(ConfigError, match=r"--device-kv-memory 1 bytes is less than one KV page of this model "
                                          r"\(1 MiB\): a size is in bytes unless it has a unit \(K, M, G, T: 40G\)"):
        choose_tier(True, 1, CPU, "fp32", 3, 3, kv_token_bytes=token)
    assert choose_tier(True, 32 * token, CPU, "fp32", 3, 1, kv_token_bytes=token).capacity_bytes == 32 * token


def test_local_mode_refuses_a_size_past_the_machine_and_says_a_size_is_unused():
    with pytest.raises(ConfigError, match="more than this machine's memory"):
        choose_tier(None, 10**30, CPU, "fp32", 1, 1)
    unused = choose_tier(None, 1 << 30, CPU, "fp32", 1, 1)
    assert unused.kind == "" and "--device-kv-memory sizes nothing here" in unused.why_off


def test_a_cpu_tier_must_leave_the_rworkers_beside_it_some_memory():
    with pytest.raises(ConfigError, match=r"leaves nothing for the 1 R-worker\(s\) on this node"):
        choose_tier(True, more_than_is_available(), CPU, "fp32", 2, 2)
    # on its own node (the R-workers elsewhere) the same tier is the node's to fill
    assert choose_tier(True, more_than_is_available(), CPU, "fp32", 2, 1).kind == "local"


def test_generate_with_a_tier_that_starves_the_rworker_exits_2_naming_the_flag(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(batch_line("a", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    size = str(more_than_is_available())
    proc = run_fastdecode(["generate", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--quiet", "--device-kv",
                           "--device-kv-memory", size], ranks=2, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--device-kv-memory" in proc.stderr and "leaves nothing for the 1 R-worker(s)" in proc.stderr
    assert "capacity_bytes must be positive" not in proc.stderr
