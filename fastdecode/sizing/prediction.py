"""What the sizing model predicts for one batch (fastdecode/sizing/model.py computes it; `plan`
prints it, `--json` gives it as a dict)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from fastdecode.sizing.split import NO_TIER


@dataclass(slots=True)
class Prediction:
    batch: int                      # asked for
    batch_run: int                  # what runs: what memory holds of the batch, less balance_waiting
    gen_len: int                    # S
    prompt_len: int
    shared_prefix: int              # tokens of the prompt shared by a group (0: none)
    prefix_group: int               # sequences per group sharing them (1: no sharing)
    shared_cost_ratio: float        # a member-token of shared prefix against a streamed token (R-workers' max)
    rworkers: int
    rworkers_needed: int | None     # None: no P balances (R-worker call overhead >= S-part time)
    pipeline_depth: int
    kv_reserve: str                 # "full" | "grow": how a sequence reserves KV (generate's --kv-reserve)
    kv_tokens_needed: float         # batch * what a sequence holds (held_tokens): full ~ prompt + S, grow ~ prompt + S/2
    kv_tokens_capacity: float       # of these rworkers
    s_layer_s: float                # per layer, summed over the mini-batches
    r_layer_s: float
    link_layer_s: float
    layer_s: float                  # per layer with the pipeline
    prefill_s: float                # S-worker prefill per step, amortized (s)
    step_latency_s: float           # one token for every running sequence
    tokens_per_s: float
    bound: str                      # "S" (the S-part and the tier's attention) | "R" | "link" | "capacity"
    efficiency: float               # E(batch_run / depth) / best E on the grid: S-part utilization
    # the S-worker's own KV tier (sizing/split.py): the split of batch_run and why it is there
    tier_sequences: int = 0         # sequences whose KV the tier holds
    rworker_sequences: int = 0      # on the R-workers
    tier_kv_bytes: float = 0.0      # KV bytes each side reserves for them (as kv_reserve reserves)
    rworker_kv_bytes: float = 0.0
    tier_capacity_sequences: int = 0    # the most the tier holds (0: no tier)
    tier_split: str = NO_TIER       # balanced | tier full | all on the tier | none on the tier | R-workers full
    tier_layer_s: float = 0.0       # the tier's attention per layer, summed over the mini-batches (on the S side)
    rworker_capacity_sequences: int = 0     # the most the R-workers hold
    balance_waiting: int = 0        # of the batch memory holds, sequences the balance rule leaves waiting
                                    # (sizing/balance.py: the R-workers take them only past their balance point)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["latency_per_token_s"] = self.step_latency_s
        return d
