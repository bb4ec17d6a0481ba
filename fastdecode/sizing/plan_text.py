"""`fastdecode plan`'s text: the header naming the machine and model, the workload, a batch in
words, the sweep's table and the table per socket count (fastdecode/sizing/plan.py computes them)."""
from __future__ import annotations

from fastdecode.sizing.fidelity import fidelity_line
from fastdecode.sizing.hardware import GPU_MEMORY_UTILIZATION
from fastdecode.sizing.link_report import link_line
from fastdecode.sizing.schema import Profile
from fastdecode.sizing.split import ALL_ON_TIER, BALANCED, NONE_ON_TIER, R_FULL, TIER_FULL
from fastdecode.sizing.tensor_parallel import sizing_from_args, weight_bytes_per_gpu


def header(prof: Profile, knee: int, depth: int, args=None) -> list[str]:
    m, link, tier = prof.model, prof.link, prof.device_tier
    kvb = m.kv_bytes_per_token_layer(prof.kv_dtype_bytes)
    lines = [f"model {m.name}: {m.num_layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads} x {m.head_dim}, "
             f"KV {kvb * m.num_layers / 1024:.0f} KiB/token ({prof.kv_dtype_bytes:.4g} B/elem)",
             f"S-worker {prof.s_worker.device}: E(B) reaches 90% of its best at B = {knee // depth} per S-part "
             f"call, so B = {knee} with {depth} mini-batch(es)",
             f"S-worker's own KV tier {tier.name}: {tier.bandwidth() / 1e9:.0f} GB/s attention, "
             f"{tier.capacity_bytes / 1e9:.1f} GB KV, {tier.call_overhead_s * 1e6:.0f} us/call" if tier is not None
             else "S-worker's own KV tier: none (--device-kv-memory and --device-kv-gbps state one)"]
    if prof.r_workers:
        w = prof.r_workers[0]
        lines.append(f"R-worker {w.name}: {w.bandwidth() / 1e9:.1f} GB/s attention, {w.capacity_bytes / 1e9:.0f} GB KV, "
                     f"{w.call_overhead_s * 1e6:.0f} us/call"
                     + (f" (+{len(prof.r_workers) - 1} more profiled)" if len(prof.r_workers) > 1 else ""))
    else:
        lines.append("R-workers: none stated (--cpu-bw states a CPU socket): a GPU-only engine")
    lines += [f"link: {link.bandwidth_Bps / 1e9:.3g} GB/s, {link.latency_s * 1e6:.0f} us"
             + (f" (the slowest of {len(link.worker_names)} R-workers' links, {link.worker_name(link.slowest_worker())}'s)"
                if len(link.worker_names) > 1 else "")
             + (f"; to all at once {link.concurrent_Bps / 1e9:.3g} GB/s" if link.concurrent_Bps else "")
             + (f", {link.hop_s * 1e6:.0f} us of hand-offs per layer in a mini-batch's chain" if link.hop_s else "")]
    mem = prof.s_worker.mem_bytes
    tp = sizing_from_args(args) if args is not None else None
    weights = weight_bytes_per_gpu(m, tp) if tp is not None and tp.active else m.weight_bytes()
    if tp is not None and tp.active:
        lines.append(f"S-worker: {tp.describe()}: {weights / 1e9:.1f} GB of weights per GPU")
    if prof.cores_shared:
        lines.append(f"warning: {prof.cores_shared}")
    budget = mem * GPU_MEMORY_UTILIZATION
    if mem and weights > budget:        # generate refuses to load them: the plan is of a job that never starts
        lines.append(f"warning: {weights / 1e9:.1f} GB of weights per GPU exceed the job's budget of "
                     f"{budget / 1e9:.0f} GB ({GPU_MEMORY_UTILIZATION:g} x the GPU's {mem / 1e9:.0f} GB, generate's "
                     f"--gpu-memory-utilization): the job would not start; give the S-worker more GPUs "
                     f"(--tensor-parallel-size)" + ("" if tp is not None and tp.fp8 else " or fp8 weights (--quantization fp8)"))
    return lines


def target_line(args, depth: int | None) -> str:
    """The workload: the KV a sequence averages of its own, and the prefix it shares; `depth` the
    stated pipeline depth (None: the better of 1 and 2)."""
    kv = f"average KV {args.prompt_len - args.shared_prefix + args.context / 2:g} tokens/sequence"
    if args.shared_prefix:
        kv += (f" of its own + a {args.shared_prefix}-token prefix shared by "
               + ("the whole batch" if args.prefix_group is None else f"groups of {args.prefix_group}"))
    return (f"target: each sequence a {args.prompt_len}-token prompt, then S = {args.context} generated tokens "
            f"(--output-len; vLLM's --max-model-len would be {args.prompt_len + args.context}) -> {kv}; "
            + (f"pipeline depth {depth}" if depth else "pipeline depth 1 or 2, the better at each batch")
            + f"; --kv-reserve {args.kv_reserve}")


def _sharing_line(r: dict) -> str:
    ratio = r["shared_cost_ratio"]
    return (f"shared prefix: {r['shared_prefix']} tokens held and prefilled once per group of {r['prefix_group']}; "
            f"a member's attention over it costs {ratio:.2f} of a streamed token"
            + (" (not measured: priced as streamed; --shared-cost-ratio states it)" if ratio == 1 else ""))


SPLIT_WHY = {BALANCED: "the two sides of the step end together",
             TIER_FULL: "the tier is full",
             ALL_ON_TIER: "the tier holds them all",
             NONE_ON_TIER: "the S-part alone outlasts the R-workers' attention: the tier would lengthen the step",
             R_FULL: "the R-workers are full: the tier holds the rest"}


def _split_line(r: dict) -> str:
    """Where the batch's KV lives: the S-worker's tier and the R-workers, and why there."""
    def gb(x: float) -> str:
        return f"{x / 1e9:,.1f} GB"

    why = "a GPU-only engine" if not r["rworkers"] else SPLIT_WHY[r["tier_split"]]
    return (f"split: {r['tier_sequences']:,} sequences ({gb(r['tier_kv_bytes'])} of KV) on the S-worker's tier "
            f"(it holds {r['tier_capacity_sequences']:,}), {r['rworker_sequences']:,} ({gb(r['rworker_kv_bytes'])}) "
            f"on {r['rworkers']} R-workers: {why}")


def _fmt_p(row) -> str:
    return "-" if row["rworkers_needed"] is None else str(row["rworkers_needed"])


def card_alone_words(row: dict, card_tokens_per_s: float) -> str:
    """What a socket count whose best puts nothing on its R-workers comes to."""
    n = row["rworkers"]
    return (f"{n} R-worker{'s' if n != 1 else ''} add{'s' if n == 1 else ''} nothing here: the card alone is best "
            f"({card_tokens_per_s:,.0f} tokens/s); the R-workers would take sequences only past their balance point")


def _balance_line(r: dict) -> str:
    return (f"balance: {r['batch_run']:,} sequences run, {r['balance_waiting']:,} more that memory holds wait: the "
            f"R-workers take sequences only up to their balance point (one more would lower tokens/s)")


def best_of_rows(rows: list[dict]) -> dict:
    """The row with the most tokens/s (ties: the smaller batch)."""
    return max(rows, key=lambda r: r["tokens_per_s"])


def groups_fields(r: dict, groups: int) -> dict:
    """--data-parallel-size D: the job is D groups as planned, each with its own R-workers."""
    return {"data_parallel_size": groups, "job_tokens_per_s": round(r["tokens_per_s"] * groups, 1),
            "job_rworkers": r["rworkers"] * groups}


def groups_line(r: dict, groups: int) -> str:
    f = groups_fields(r, groups)
    return (f"with --data-parallel-size {groups}: {groups} groups of this plan, {f['job_tokens_per_s']:,.0f} tokens/s "
            f"and {f['job_rworkers']} R-workers in all (rank 0 also deals the input and writes every group's rows: "
            f"docs/cluster.md)")


def best_line(r: dict) -> str:
    split = f" ({r['tier_sequences']:,} on the tier, {r['rworker_sequences']:,} on the R-workers)" \
        if r["tier_capacity_sequences"] and r["rworkers"] else ""
    return (f"best: {r['tokens_per_s']:,.0f} tokens/s at batch {r['batch_run']:,}{split}, depth "
            f"{r['pipeline_depth']}, step {r['step_latency_s'] * 1e3:.1f} ms; bound: {r['bound']}")


def print_batch(prof: Profile, r: dict, fid: dict, args, advice: str | None = None) -> None:
    """plan --batch: the one batch in words; `advice` the flag generate needs to run it so."""
    where = f"{r['rworkers']} R-workers" + (" and the S-worker's tier" if prof.device_tier is not None else "")
    held = r["batch_run"] + r["balance_waiting"]
    print(f"batch {r['batch']}" + (f" (memory holds {held})" if held < r["batch"] else "")
          + f": KV {r['kv_tokens_needed']:,.0f} tokens reserved of {r['kv_tokens_capacity']:,.0f} on "
          f"{where}; R-workers needed: {_fmt_p(r)}")
    if r["balance_waiting"]:
        print(_balance_line(r))
    if prof.device_tier is not None and r["batch_run"]:
        print(_split_line(r))
    if r["shared_prefix"]:
        print(_sharing_line(r))
    if "batch_run_if_grow" in r:
        print(f"  (with --kv-reserve grow, sequences reserve as they grow: memory holds {r['batch_run_if_grow']})")
    tier_ms = f" + tier {r['tier_layer_s'] * 1e3:.3f} ms" if r["tier_sequences"] else ""
    print(f"per layer: S {r['s_layer_s'] * 1e3:.3f} ms{tier_ms}, R {r['r_layer_s'] * 1e3:.3f} ms, "
          f"link {r['link_layer_s'] * 1e3:.3f} ms -> {r['layer_s'] * 1e3:.3f} ms")
    if "link_bound_by" in r and (r["bound"] == "link" or not r["link_hidden"]):
        print(link_line(r))
    if r["prefill_s"]:
        own = r["prompt_len"] - r["shared_prefix"] + r["shared_prefix"] / r["prefix_group"]
        print(f"prefill of {r['batch_run'] * own / args.context:,.0f} prompt tokens per step: "
              f"{r['prefill_s'] * 1e3:.1f} ms on the S-worker")
    print(f"step latency {r['step_latency_s'] * 1e3:.1f} ms at depth {r['pipeline_depth']} (depth 1: "
          f"{r['step_latency_depth1_s'] * 1e3:.1f} ms), {r['tokens_per_s']:,.0f} tokens/s "
          f"({r['tokens_per_s_depth1']:,.0f} at depth 1), {r['step_latency_s'] * 1e3:.1f} ms/token per sequence; "
          f"bound: {r['bound']}")
    if advice:
        print(advice)
    print(fidelity_line(fid, r["bound"]))


def print_sweep(prof: Profile, rows: list[dict], knee: int) -> None:
    """The sweep's table: a row per batch offered, `run` what the balance rule runs of it."""
    tier = prof.device_tier is not None
    print(f"{'batch':>7} {'run':>7} {'d':>2} {'E(B)':>6} {'P need':>6} {'P':>5} "
          + (f"{'tier':>6} {'tier ms':>8} " if tier else "")
          + f"{'S ms':>8} {'R ms':>8} {'link ms':>8} {'step ms':>9} {'tokens/s':>10} {'bound':>8}")
    for r in rows:
        print(f"{r['batch']:>7} {r['batch_run']:>7} {r['pipeline_depth']:>2} {r['efficiency']:>6.0%} {_fmt_p(r):>6} "
              f"{r['rworkers']:>5} " + (f"{r['tier_sequences']:>6} {r['tier_layer_s'] * 1e3:>8.3f} " if tier else "")
              + f"{r['s_layer_s'] * 1e3:>8.3f} {r['r_layer_s'] * 1e3:>8.3f} {r['link_layer_s'] * 1e3:>8.3f} "
              f"{r['step_latency_s'] * 1e3:>9.1f} {r['tokens_per_s']:>10,.0f} {r['bound']:>8}"
              + ("  <- knee" if r["batch"] == knee else ""))


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+,.0f}"


def print_sockets(rows: list[dict]) -> None:
    """plan --rworkers P1 P2 ...: a row per socket count, its best and what it adds, then the words
    where the card alone is best."""
    print(f"{'R-workers':>9} {'tokens/s':>10} {'+previous':>10} {'+card':>8} {'batch':>7} {'d':>2} {'tier':>6} "
          f"{'on R':>6} {'step ms':>9} {'bound':>8}")
    for r in rows:
        over_card = r["over_card_alone_tokens_per_s"] if r["rworkers"] else None      # the card's own row: "-"
        print(f"{r['rworkers']:>9} {r['tokens_per_s']:>10,.0f} {_signed(r['adds_tokens_per_s']):>10} "
              f"{_signed(over_card):>8} {r['batch_run']:>7} {r['pipeline_depth']:>2} {r['tier_sequences']:>6} "
              f"{r['rworker_sequences']:>6} {r['step_latency_s'] * 1e3:>9.1f} {r['bound']:>8}")
    card = rows[0]["tokens_per_s"] if rows[0]["rworkers"] == 0 else None
    for r in rows:
        if r["card_alone_best"]:
            print(card_alone_words(r, card))
