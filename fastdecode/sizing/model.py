"""The sizing model (docs/design.md, "The sizing model").

Given a Profile (measured by `fastdecode profile`, or built from stated hardware), a batch B,
a generation length S, a prompt length and P R-workers, predict per-layer S/R/link times, the
step latency with or without the pipeline, tokens/s, which side bounds, and the R-workers needed.

Symbols (units): T(B) S-part time of one layer at batch B (s); N layers; R = seconds for one
R-worker to attend over one token of context in one layer (s/token) = KV bytes per token and
layer x seconds per KV byte; E(B) = B / T(B) (tokens/s per layer); C = KV tokens one R-worker
holds. Prompt length: with the stabilized schedule a running sequence's age is uniform over
[0, S), so its average KV length is prompt + S/2; every "½·S" of FastDecode's original formulas becomes prompt + S/2:
    balance   P = B·(prompt + S/2)·R / T(B)      (= ½·S·R·E(B) when prompt = 0)
    capacity  B·(prompt + S/2) <= C·P            (the admission controller's W_lim adds B·F/2)
Prompts also cost the S-worker a prefill: in steady state B/S sequences start per step, so
B·prompt/S prompt tokens per step run the dense layers (at the best E, chunks being large) and
their K, V cross the link as each layer of the prefill computes them: the step's prefill takes the
longer of its compute and that transfer (prompt_kv_link). A measured profile gives the prefill cost per
prompt token (prompt attention and staging included) by prompt length; from stated hardware the
attention over the prompt is left out (2·prompt·heads·head_dim FLOPs per token against
~12·hidden² for the dense part: 2% at Llama-7B, prompt 1024). The balance count above ignores prefill (it errs towards more R-workers).

Shared prefixes: the first `shared` tokens of the prompt (whole pages) are one copy per group of
g sequences on the R-workers (KVStore.fork; g defaults to the batch, g = 1 shares nothing), and
only a group's donor prefills them. Per sequence, with own = prompt - shared + shared/g:
    held      prompt - shared + S in whole pages, + shared/g (full); own + S/2 + (3·page + 1)/2 (grow)
    prefill   own tokens per starting sequence (the K, V crossing the link too)
and per mini-batch of m = B/depth sequences holding c = min(m, max(1, B/g)) groups (a mini-batch is cut
by R-load, not by group: it holds a part of every group), one layer's
R-part attends over, in streamed tokens (R seconds each),
    m·(prompt - shared + S/2) + c·shared + (m - c)·shared·ρ
The kernel streams a group's shared pages from memory once (c·shared at the full cost) and runs
every further member's heads over them while they sit in cache: ρ = shared_cost_ratio of a
streamed token (measured by `fastdecode profile`; 1 when not, the conservative case). With
shared = 0 every formula above is the unshared one; g = 1 gives c = m, the unshared R-part.
A group the placement splits over R-workers holds a copy on each: not counted.

The S-worker's own KV tier (profile.device_tier; sizing/split.py): B_t of the B sequences live
in the S-worker's memory and are attended there, on the S side of the step; the R-workers hold
the other B_R = B - B_t. Per layer and mini-batch (m_t = B_t/depth on the tier, m_R = B_R/depth
on the R-workers):
    tier      t = c_t + m_t·K_t·σ_t            (after the S-part, while the R-workers' rows are away)
    R-part    r as above over m_R sequences; the link carries m_R rows
    layer     max(depth·(s + t), depth·r, depth·link, s + max(t, r + link + hop))
Capacity counts both: the tier holds whole worst cases (full) or memory_batch's count (grow) of its
own pages; a windowed layer is charged in full where the tier keeps its pages (the device tier).
`plan` runs only what the engine's balance rule admits of a batch (sizing/balance.py): predict_run
takes that split in place of placement's.
"""
from __future__ import annotations

import math

import numpy as np

from fastdecode.sched.admission import memory_batch
from fastdecode.sched.placement import RESERVE_POLICIES, grow_overhead_tokens
from fastdecode.sizing.link import mini_batch_link
from fastdecode.sizing.prediction import Prediction
from fastdecode.sizing.schema import Profile, RWorkerProfile, TierProfile
from fastdecode.sizing.split import NO_TIER, Split, split_batch


def held_tokens(worker: RWorkerProfile, gen_len: int, prompt_len: int, kv_reserve: str,
                shared_prefix: int = 0, prefix_group: float = 1) -> float:
    """KV tokens one running sequence keeps from other sequences on `worker`, on average over its
    life, as fastdecode/sched/placement.py reserves them:
    - full: its worst case, prompt + S rounded up to whole pages, from admission to the end;
    - grow: the pages it has filled plus the one its next token goes to (on average half a page
      past its length, +1/2 for that token), and one page of admission headroom per resident
      sequence (grow_overhead_tokens); at the stabilized schedule's steady state its length
      averages prompt + S/2.
    A shared prefix (`shared_prefix` tokens of the prompt, one copy per `prefix_group` sequences)
    counts its 1/prefix_group share instead: the pages are the group's, not the sequence's."""
    if kv_reserve == "full":
        page = max(int(worker.page_tokens), 1)
        own = math.ceil((prompt_len - shared_prefix + gen_len) / page) * page
        return own + shared_prefix / prefix_group if shared_prefix else own
    if kv_reserve == "grow":
        return _avg_kv_len(gen_len, _own_prompt(prompt_len, shared_prefix, prefix_group)) + \
            grow_overhead_tokens(worker.page_tokens)
    raise ValueError(f"kv_reserve must be one of {RESERVE_POLICIES}, got {kv_reserve!r}")


def _own_prompt(prompt_len: float, shared_prefix: int = 0, prefix_group: float = 1) -> float:
    """Prompt tokens a sequence holds and prefills: its own part and a 1/prefix_group share of its
    group's prefix (held once for the group, prefilled once by the group's donor)."""
    if not shared_prefix:
        return prompt_len
    return prompt_len - shared_prefix + shared_prefix / prefix_group


def sequences_on_worker(capacity_tokens: float, worker: RWorkerProfile, gen_len: int, prompt_len: int,
                        kv_reserve: str, shared_prefix: int = 0, prefix_group: float = 1) -> int:
    """How many sequences `capacity_tokens` of one worker hold at once. full: whole worst cases
    (placement's hard bound). grow: the count the stabilized schedule admits
    (fastdecode/sched/admission.py memory_batch), which keeps the workload's peak, B*(prompt +
    (S+F)/2) plus the page overhead, within capacity: what it runs unless growth preempts. A
    shared prefix counts as held_tokens counts it (a 1/prefix_group share per sequence)."""
    if kv_reserve == "full":
        return int(capacity_tokens // held_tokens(worker, gen_len, prompt_len, kv_reserve, shared_prefix,
                                                  prefix_group))
    if kv_reserve == "grow":
        return memory_batch(capacity_tokens, gen_len, gen_len, _own_prompt(prompt_len, shared_prefix, prefix_group),
                            grow_overhead_tokens(worker.page_tokens))[0]
    raise ValueError(f"kv_reserve must be one of {RESERVE_POLICIES}, got {kv_reserve!r}")


def sequences_fitting(profile: Profile, workers: list[RWorkerProfile | TierProfile], gen_len: int, prompt_len: int,
                      kv_reserve: str, shared_prefix: int = 0, prefix_group: float = 1) -> int:
    """How many sequences the workers' memory holds at once (sequences_on_worker, summed). A
    worker that keeps a windowed layer's pages (the device tier: frees_windows False) is charged
    that layer in full."""
    m = profile.model
    held = prompt_len + (gen_len if kv_reserve == "full" else gen_len / 2)
    layer_bytes = m.num_layers * m.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    return sum(sequences_on_worker(w.capacity_bytes // (layer_bytes * (m.held_fraction(held) if getattr(
                                       w, "frees_windows", True) else 1.0)),
                                   w, gen_len, prompt_len, kv_reserve, shared_prefix, prefix_group)
               for w in workers)


def tier_fit(profile: Profile, gen_len: int, prompt_len: int, kv_reserve: str, shared_prefix: int = 0,
             prefix_group: float = 1) -> int:
    """Sequences the S-worker's own tier holds at once (0: the profile has none)."""
    tier = profile.device_tier
    if tier is None:
        return 0
    return sequences_fitting(profile, [tier], gen_len, prompt_len, kv_reserve, shared_prefix, prefix_group)


def _avg_kv_len(gen_len: int, prompt_len: float) -> float:
    return prompt_len + gen_len / 2


def _group(batch: float, prefix_group: int | None) -> float:
    """Sequences per prefix group: the whole batch by default, never more than the batch."""
    return batch if prefix_group is None else min(prefix_group, batch)


def _shared_ratio(workers: list[RWorkerProfile]) -> float:
    """The slowest worker's shared_cost_ratio: placement shares the load by bandwidth, so the
    worker whose shared tokens cost the most finishes last (1 without R-workers)."""
    return max((_worker_shared_ratio(w) for w in workers), default=1.0)


def _worker_shared_ratio(w: RWorkerProfile) -> float:
    """A member-token of shared prefix against a streamed token on `w`: from the measured absolute
    cost against the in-step cost of a streamed byte where the profile has it, else as stated."""
    if w.shared_seconds_per_kv_byte > 0:
        return min(max(w.shared_seconds_per_kv_byte / w.seconds_per_kv_byte, 0.01), 1.0)
    return w.shared_cost_ratio


def _r_tokens(mini: float, gen_len: int, prompt_len: int, shared_prefix: int = 0, prefix_group: float = 1,
              ratio: float = 1.0, depth: int = 1) -> float:
    """Streamed-token equivalents one mini-batch of `mini` sequences attends over in one layer:
    mini·(prompt + S/2) unshared. With a shared prefix: each sequence's own tokens, each of the
    c = min(mini, max(1, depth·mini/prefix_group)) groups in the mini-batch streaming its prefix
    once (the batch's mini-batches are cut by R-load, not by group, so each holds a part of every
    group), and the other (mini - c) members' heads over it at `ratio` of a streamed token."""
    if not shared_prefix:
        return mini * _avg_kv_len(gen_len, prompt_len)
    groups = min(mini, max(1.0, depth * mini / prefix_group))
    return (mini * _avg_kv_len(gen_len, prompt_len - shared_prefix) + groups * shared_prefix
            + (mini - groups) * shared_prefix * ratio)


def _r_time(profile: Profile, workers: list[RWorkerProfile], kv_tokens: float, read_share: float = 1.0) -> float:
    """One attention call per worker for `kv_tokens` of context in one layer (of which sliding
    windows leave `read_share` to read); placement gives each worker a share proportional to its
    bandwidth, so all finish together but for overhead."""
    kv_bytes = kv_tokens * profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes) * read_share
    total_bw = sum(w.bandwidth() for w in workers)
    return max(w.call_overhead_s for w in workers) + kv_bytes / total_bw


def _prefill_tokens(batch: float, gen_len: int, prompt_len: float) -> float:
    """Prompt tokens prefilled per step in steady state: batch/gen_len sequences start per step,
    each prefilling `prompt_len` tokens (_own_prompt with a shared prefix)."""
    return batch * prompt_len / gen_len


def tier_split(profile: Profile, batch: int, gen_len: int, prompt_len: int, rworkers: int, depth: int,
               shared_prefix: int = 0, prefix_group: int | None = None, kv_reserve: str = "full") -> Split:
    """How `batch` sequences split between the S-worker's own tier and `rworkers` R-workers, as
    the engine's placement splits them (sizing/split.py). The batch must fit in the two together."""
    m = profile.model
    if profile.device_tier is None:
        return Split(0, batch, NO_TIER, 0, batch)
    group = _group(batch, prefix_group)
    workers = profile.workers(rworkers)
    r_fit = sequences_fitting(profile, workers, gen_len, prompt_len, kv_reserve, shared_prefix, group)
    t_fit = tier_fit(profile, gen_len, prompt_len, kv_reserve, shared_prefix, group)
    if not t_fit:
        return Split(0, batch, NO_TIER, 0, r_fit)
    mini = batch / depth
    s_step = m.num_layers * depth * profile.s_worker.layer_time(mini) + profile.s_worker.head_time(batch)
    tier_bytes, r_bytes = _seq_read_bytes(profile, workers, mini, gen_len, prompt_len, shared_prefix, group, depth)
    # placement's speeds: each kernel timed alone, as the engine measures them at start-up
    r_bw = sum(1.0 / (w.kernel_seconds_per_kv_byte or w.seconds_per_kv_byte) for w in workers)
    t = profile.device_tier
    return split_batch(batch, s_step, m.num_layers, tier_bytes, t.kernel_seconds_per_kv_byte or t.seconds_per_kv_byte,
                       r_bytes, r_bw, t_fit, r_fit)


def _seq_read_bytes(profile: Profile, workers: list[RWorkerProfile], mini: float, gen_len: int, prompt_len: int,
                    shared_prefix: int, group: float, depth: int) -> tuple[float, float]:
    """(on the tier, on the R-workers) the KV bytes one sequence's attention reads per layer, in
    streamed bytes: the mini-batch's _r_tokens per sequence, a shared prefix at the R-workers'
    ratio there and at a full read on the tier (its kernel reads every member's pages)."""
    m = profile.model
    per_token = m.kv_bytes_per_token_layer(profile.kv_dtype_bytes) * m.read_fraction(_avg_kv_len(gen_len, prompt_len))
    tier = _r_tokens(mini, gen_len, prompt_len, shared_prefix, group, 1.0, depth) / mini
    r = _r_tokens(mini, gen_len, prompt_len, shared_prefix, group, _shared_ratio(workers), depth) / mini
    return tier * per_token, r * per_token


def layer_times(profile: Profile, batch: int, gen_len: int, prompt_len: int, rworkers: int,
                depth: int, shared_prefix: int = 0, prefix_group: int | None = None,
                kv_reserve: str = "full", split: Split | None = None) -> dict:
    """Per layer, with `depth` mini-batches of batch/depth in flight. Per mini-batch: s (S-part),
    r (R-part), link (Q,K,V out + O back: over the slowest R-worker's link or the S-worker's path
    to all of them, sizing/link.py, which the result names as link_by; in the chain out then
    back, as a load the busier direction). Each resource serves every mini-batch once per layer
    (its load, depth * x), and one mini-batch's chain s -> link -> r -> link must also fit in the
    cycle: layer = max(depth*s, depth*r, depth*link, s + r + link + hop). Depth 1 gives s + r +
    link + hop; depth 2 with balanced sides gives max(S, R, link) of the whole batch, unless the
    chain cannot hide behind the other mini-batch (a slow link, or small mini-batches whose work
    is shorter than the chain's hand-offs, `hop`). The step's prompt K, V cross during its
    prefill (prompt_kv_link); on a GPU S-worker the link includes the device<->host copies (PCIe) on both ends of the chain.
    A shared prefix (groups of prefix_group sequences, default the batch) is priced by _r_tokens on
    the R-part and _own_prompt on the prefill's K, V.
    With the S-worker's own tier the batch splits as tier_split says (its memory and the
    R-workers' as `kv_reserve` reserves them), or as `split` says where it is given (the balance
    rule's, sizing/balance.py; its two counts sum to `batch`): the tier's attention t follows the
    S-part on the S side, the R-workers and the link carry the rest (the module docstring)."""
    m = profile.model
    mini = batch / depth
    group = _group(batch, prefix_group)
    workers = profile.workers(rworkers)
    sp = split if split is not None else tier_split(profile, batch, gen_len, prompt_len, rworkers, depth,
                                                    shared_prefix, prefix_group, kv_reserve)
    mini_t, mini_r = sp.tier / depth, sp.rworkers / depth
    s = profile.s_worker.layer_time(mini)
    read = m.read_fraction(_avg_kv_len(gen_len, prompt_len))
    r = t = 0.0
    path = {"s": 0.0, "load": 0.0, "by": "no R-workers", "bytes": 0.0, "latency_s": 0.0}
    device = 0.0
    if mini_r > 0:
        tokens = _r_tokens(mini, gen_len, prompt_len, shared_prefix, group, _shared_ratio(workers), depth)
        r = _r_time(profile, workers, tokens * (sp.rworkers / batch), read)
        out_bytes, back_bytes = mini_r * m.to_rworker_bytes_per_token(), mini_r * m.from_rworker_bytes_per_token()
        path = mini_batch_link(profile.link, workers, out_bytes, back_bytes)
        device = profile.link.device_time(out_bytes, back_bytes)
    if mini_t > 0:
        tier = profile.device_tier
        t = tier.call_overhead_s + mini_t * _seq_read_bytes(profile, workers, mini, gen_len, prompt_len, shared_prefix,
                                                            group, depth)[0] * tier.seconds_per_kv_byte
    parts = {"S": s + t, "R": r, "link": path["load"] + device}
    round_trip = r + path["s"] + device + profile.link.hop_s if mini_r > 0 else 0.0
    chain = s + max(t, round_trip)
    layer = max(depth * max(parts.values()), chain)
    return {"s": depth * s, "r": depth * r, "link": depth * parts["link"], "tier": depth * t, "layer": layer,
            "bound": max(parts, key=parts.get), "link_by": path["by"], "link_bytes": depth * path["bytes"],
            "link_latency_s": depth * (path["latency_s"] + device), "split": sp}


def prompt_kv_link(profile: Profile, batch: int, gen_len: int, own_prompt: float,
                   workers: list[RWorkerProfile]) -> float:
    """Seconds per step the link takes to carry the step's prompt K, V (batch/gen_len sequences
    start per step, `own_prompt` tokens each), every layer's as it is computed: the prefill
    overlaps its own K, V's transfer, so a step's prefill takes the longer of the two. The layers'
    messages follow each other: their latencies overlap, one is paid."""
    m = profile.model
    per_layer = _prefill_tokens(batch, gen_len, own_prompt) * m.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    if per_layer <= 0 or not workers:
        return 0.0
    path = mini_batch_link(profile.link, workers, per_layer, 0.0)
    # the layers' messages follow each other on a busy direction: one latency, N times the bytes
    return path["latency_s"] + m.num_layers * (path["load"] - path["latency_s"] + profile.link.device_time(per_layer, 0.0))


def kv_tokens_capacity(profile: Profile, rworkers: int) -> float:
    """KV tokens (all layers) `rworkers` R-workers and the S-worker's own tier hold."""
    per_token = profile.model.num_layers * profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    tier = profile.device_tier.capacity_bytes if profile.device_tier is not None else 0.0
    return (sum(w.capacity_bytes for w in profile.workers(rworkers)) + tier) / per_token


def rworkers_needed(profile: Profile, batch: int, gen_len: int, prompt_len: int = 0,
                    depth: int = 2, max_workers: int = 1 << 14, kv_reserve: str = "full",
                    shared_prefix: int = 0, prefix_group: int | None = None) -> int | None:
    """Fewest R-workers whose R-part per mini-batch is no slower than the S-part (balance) and
    whose memory holds the batch as `kv_reserve` reserves it (capacity). None if no count up to
    max_workers does (e.g. the R-worker call overhead alone exceeds the S-part) or the profile
    has no R-worker. A shared prefix (groups of prefix_group sequences, default the batch) as
    _r_tokens and held_tokens count it. The S-worker's own tier does not change the count: at it the
    S-part alone is the slower side, so placement leaves the tier empty (sizing/split.py); below
    it the tier takes what keeps the two sides level."""
    if not profile.r_workers:
        return None
    mini = batch / depth
    group = _group(batch, prefix_group)
    t_s = profile.s_worker.layer_time(mini)
    kv_bytes = _r_tokens(mini, gen_len, prompt_len, shared_prefix, group, _shared_ratio(profile.r_workers), depth) * \
        profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes) * \
        profile.model.read_fraction(_avg_kv_len(gen_len, prompt_len))
    # [P] totals over the first P workers (the profiled list repeated): q full rounds + a prefix
    ws = profile.r_workers
    q, r = np.divmod(np.arange(1, max_workers + 1), len(ws))

    def total(values):
        prefix = np.concatenate([[0.0], np.cumsum(values)])
        return q * prefix[-1] + prefix[r]

    bw = total([w.bandwidth() for w in ws])
    held = total([sequences_fitting(profile, [w], gen_len, prompt_len, kv_reserve, shared_prefix, group) for w in ws])
    first_max = np.maximum.accumulate([w.call_overhead_s for w in ws])
    overhead = first_max[np.minimum(np.arange(max_workers), len(ws) - 1)]
    ok = (overhead + kv_bytes / bw <= t_s * (1 + 1e-9)) & (held >= batch)
    return int(np.argmax(ok)) + 1 if ok.any() else None


ADMIT_FRACTION = 16     # the stabilized schedule's default micro-batch: B/16 sequences every S/16 steps


def predict(profile: Profile, batch: int, gen_len: int, prompt_len: int = 0,
            rworkers: int | None = None, depth: int = 2, prefill_chunk: int | None = None,
            kv_reserve: str = "full", shared_prefix: int = 0, prefix_group: int | None = None,
            split: Split | None = None) -> Prediction:
    """Steady-state prediction with the stabilized schedule. If the batch does not fit in the
    R-workers' memory as `kv_reserve` reserves it (generate's --kv-reserve: full, the default,
    holds every sequence's worst case; grow what it has filled), the batch that fits runs
    instead and bound = "capacity". Prompts are prefilled in chunks of
    `prefill_chunk` tokens; by default one admitted micro-batch's prompts (B/16 of them) up to
    the largest chunk the profile measured (the engine's --max-prefill-tokens). The first
    `shared_prefix` prompt tokens are shared by groups of `prefix_group` sequences (default: the
    whole batch); a member prefills only its suffix, whose tokens attend over the whole prompt, so
    they cost the prompt length's per-token prefill. The batch splits between the S-worker's tier
    and the R-workers as placement splits it, or as `split` says (predict_run)."""
    if batch < 1 or gen_len < 1 or prompt_len < 0 or depth < 1:
        raise ValueError("need batch >= 1, gen_len >= 1, prompt_len >= 0, depth >= 1")
    if not 0 <= shared_prefix <= prompt_len or (prefix_group is not None and prefix_group < 1):
        raise ValueError("need 0 <= shared_prefix <= prompt_len and prefix_group >= 1")
    needed = rworkers_needed(profile, batch, gen_len, prompt_len, depth, kv_reserve=kv_reserve,
                             shared_prefix=shared_prefix, prefix_group=prefix_group)
    if rworkers is None:
        rworkers = needed if needed is not None else len(profile.r_workers)
    if rworkers < (0 if profile.device_tier is not None else 1):
        raise ValueError("need at least one R-worker" + (" (the profile has no S-worker tier)" if rworkers == 0 else ""))
    return predict_run(profile, batch, gen_len, prompt_len, rworkers, depth, needed, split, prefill_chunk, kv_reserve,
                       shared_prefix, prefix_group)


def predict_run(profile: Profile, batch: int, gen_len: int, prompt_len: int, rworkers: int, depth: int,
                needed: int | None, split: Split | None = None, prefill_chunk: int | None = None,
                kv_reserve: str = "full", shared_prefix: int = 0, prefix_group: int | None = None) -> Prediction:
    """predict's body, its arguments checked and the R-workers needed (`needed`) known: what runs
    of `batch` sequences asked for, split as placement splits them or, given `split` (the balance
    rule's, sizing/balance.py: at most what memory holds of the batch), as it says. Sequences of
    the batch that memory holds but the split leaves out wait (balance_waiting); the bound is then
    the step's, not capacity."""
    share = dict(shared_prefix=shared_prefix, prefix_group=prefix_group)
    tier = profile.device_tier
    workers = profile.workers(rworkers)
    cap = kv_tokens_capacity(profile, rworkers)
    group = _group(batch, prefix_group)
    r_fit = sequences_fitting(profile, workers, gen_len, prompt_len, kv_reserve, shared_prefix, group)
    fit = r_fit + tier_fit(profile, gen_len, prompt_len, kv_reserve, shared_prefix, group)
    held_in_memory = min(batch, fit)
    batch_run = held_in_memory if split is None else split.tier + split.rworkers
    if batch_run > held_in_memory:
        raise ValueError(f"a split of {batch_run} sequences: memory holds {held_in_memory} of the {batch} asked")
    common = dict(batch=batch, gen_len=gen_len, prompt_len=prompt_len, shared_prefix=shared_prefix,
                  prefix_group=int(min(group, max(batch_run, 1))), shared_cost_ratio=_shared_ratio(workers),
                  rworkers=rworkers, rworkers_needed=needed, pipeline_depth=depth, kv_reserve=kv_reserve,
                  kv_tokens_capacity=cap, rworker_capacity_sequences=r_fit,
                  balance_waiting=held_in_memory - batch_run)
    if batch_run < 1:
        held = _held_per_seq(profile, workers or ([tier] if tier is not None else []), gen_len, prompt_len,
                             kv_reserve, shared_prefix, group)
        return Prediction(**common, batch_run=0, kv_tokens_needed=batch * held,
                          s_layer_s=0.0, r_layer_s=0.0, link_layer_s=0.0,
                          layer_s=math.inf, prefill_s=0.0, step_latency_s=math.inf, tokens_per_s=0.0,
                          bound="capacity", efficiency=0.0)
    t = layer_times(profile, batch_run, gen_len, prompt_len, rworkers, depth, kv_reserve=kv_reserve, split=split,
                    **share)
    sp: Split = t["split"]
    held_t = _held_per_seq(profile, [tier] if sp.tier else [], gen_len, prompt_len, kv_reserve, shared_prefix, group)
    held_r = _held_per_seq(profile, workers, gen_len, prompt_len, kv_reserve, shared_prefix, group)
    # what the asked batch reserves: the split's tier share on the tier, the rest on the R-workers
    need = sp.tier * held_t + (batch - sp.tier) * (held_r if workers else held_t)
    n = profile.model.num_layers
    token_bytes = n * profile.model.kv_bytes_per_token_layer(profile.kv_dtype_bytes)
    sw = profile.s_worker
    grid_best = max(b / x for b, x in zip(sw.batch_grid, sw.layer_time_s))
    own = _own_prompt(prompt_len, shared_prefix, _group(batch_run, prefix_group))
    if prefill_chunk is None and sw.prefill_chunk_grid:
        prefill_chunk = min(max(own, batch_run * own / ADMIT_FRACTION), max(sw.prefill_chunk_grid))
    per_token = sw.prefill_time_per_token(prompt_len, prefill_chunk)
    if per_token is None:      # stated hardware: dense layers at the best efficiency, attention left out
        per_token = n / grid_best
    # every prompt runs the dense layers; only the R-workers' prompts send their K, V over the link
    prefill = max(_prefill_tokens(batch_run, gen_len, own) * per_token,
                  prompt_kv_link(profile, sp.rworkers, gen_len, own, workers))
    step = n * t["layer"] + sw.head_time(batch_run) + prefill
    return Prediction(**common, batch_run=batch_run, kv_tokens_needed=need, s_layer_s=t["s"], r_layer_s=t["r"],
                      link_layer_s=t["link"], layer_s=t["layer"], prefill_s=prefill,
                      step_latency_s=step, tokens_per_s=batch_run / step,
                      bound="capacity" if batch_run == fit < batch else t["bound"],
                      efficiency=sw.efficiency(batch_run / depth) / grid_best,
                      tier_sequences=sp.tier, rworker_sequences=sp.rworkers,
                      tier_kv_bytes=sp.tier * held_t * token_bytes, rworker_kv_bytes=sp.rworkers * held_r * token_bytes,
                      tier_capacity_sequences=sp.tier_fit, tier_split=sp.why, tier_layer_s=t["tier"])


def _held_per_seq(profile: Profile, workers: list, gen_len: int, prompt_len: int, kv_reserve: str,
                  shared_prefix: int, group: float) -> float:
    """KV tokens (all layers) one sequence reserves on average over `workers` (held_tokens, with the
    windowed layers' share where a worker frees them); 0 without workers."""
    if not workers:
        return 0.0
    m = profile.model
    held_share = m.held_fraction(prompt_len + (gen_len if kv_reserve == "full" else gen_len / 2))
    return sum(held_tokens(w, gen_len, prompt_len, kv_reserve, shared_prefix, group)
               * (held_share if getattr(w, "frees_windows", True) else 1.0) for w in workers) / len(workers)
