"""A run in a few lines of text: what `generate` prints at its end and `fastdecode report` prints
for a run report (OUT.summary.json) or a --stats-json file. Requests ok and errors by code, tokens,
time, throughput, and which side bounded the decode steps."""
from __future__ import annotations


def throughput_line(summary: dict) -> str:
    """vLLM's benchmark line, the last line `generate` prints on stdout (scripts read it)."""
    wall = summary["wall_s"] or 1e-9
    return (f"Throughput: {summary['requests'] / wall:.2f} requests/s, "
            f"{(summary['output_tokens'] + summary['prompt_tokens']) / wall:.2f} total tokens/s, "
            f"{summary['output_tokens'] / wall:.2f} output tokens/s")


def _codes(codes: dict) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items()))


def requests_line(run: dict, report: dict | None) -> str:
    """The output file's lines when a run report is at hand (earlier runs included), else this run's."""
    if report and report.get("lines"):
        lines, codes = report["lines"], report.get("errors_by_code") or {}
        text = f"requests: {lines['ok']} ok, {lines['errors']} error(s)"
        text += f" ({_codes(codes)})" if codes else ""
        if lines.get("remaining"):
            text += f", {lines['remaining']} of {lines['input']} not answered yet"
        served, skipped = report["requests"]["served_this_run"], report["requests"]["skipped_done_by_earlier_runs"]
        return text + f"; this run served {served}" + (f", earlier runs answered {skipped}" if skipped else "")
    codes = run.get("errors_by_code") or {}
    return (f"requests: {run.get('requests', 0)} served, {run.get('errors', 0)} error(s)"
            + (f" ({_codes(codes)})" if codes else ""))


def bound_line(run: dict) -> str | None:
    """Which side bounded the decode steps: the one with the smaller bubble (idle) fraction."""
    s_idle, r_idle = run.get("s_bubble_fraction"), run.get("r_bubble_fraction")
    if s_idle is None or r_idle is None:
        return None
    bound = run.get("bound") or ("S" if s_idle <= r_idle else "R")
    return (f"bound: {bound} (decode steps {run['decode_s']:.2f} s: S-part busy {100 * (1 - s_idle):.0f}%, "
            f"busiest R-worker {100 * (1 - r_idle):.0f}%)")


def prefill_line(run: dict) -> str | None:
    """Where prefill time went: S-part compute and attention, the hand-off to the R-part (packing,
    waiting on it), and the R-workers' appends (the slowest)."""
    pf = run.get("prefill")
    if not pf or not pf.get("wall_s"):
        return None
    append = max(pf.get("r_append_s") or [0.0])
    return (f"prefill: {pf['tokens']} tokens in {pf['wall_s']:.2f} s ({pf['tokens_per_s']:.0f} tokens/s): "
            f"S-part {pf['s_compute_s']:.2f} s + attention {pf['s_attention_s']:.2f} s, hand-off "
            f"{pf['pack_s']:.2f} s packing + {pf['wait_s']:.2f} s waiting; R-worker appends {append:.2f} s")


def prefix_line(run: dict) -> str | None:
    """Shared prompt prefixes: the sequences that started from one, and what that spared."""
    hits = run.get("prefix_hits")
    if not hits:
        return None
    return (f"shared prefixes: {hits} sequence(s) started from another's KV pages, {run['prefix_shared_tokens']} "
            f"prompt tokens neither prefilled nor stored again ({run['prefix_kv_bytes_saved'] / 2**20:.1f} MiB of KV)")


def tiers_line(run: dict) -> str | None:
    """Where the KV lived, when the S-worker kept some itself: sequences and peak bytes per tier."""
    tiers = run.get("kv_tiers") or []
    if len(tiers) < 2:
        return None
    return "KV tiers: " + "; ".join(
        f"{t['tier']} {t['sequences']} sequence(s), peak {t['kv_bytes_peak'] / 2**30:.2f} of "
        f"{t['kv_capacity_bytes'] / 2**30:.1f} GiB" for t in tiers)


def balance_line(run: dict) -> str | None:
    """The balance point (sched/balance.py) as the last decode step measured it, where the rule
    weighed the S-worker's own tier against the R-workers."""
    b = run.get("balance") or {}
    if not b.get("gates_admission") or "s_step_s" not in b:
        return None
    return (f"balance: {b['sequences_tier']} sequence(s) on the tier, {b['sequences_rworkers']} on the R-workers; "
            f"S-side {b['s_step_s'] * 1e3:.1f} ms, slowest R-worker {b['r_step_s'] * 1e3:.1f} ms a step, bound "
            f"{b['bound']}; the queue's head held back {b['held_back']} time(s)")


def text_lines(run: dict, report: dict | None = None) -> list[str]:
    """run: a run's summary (--stats-json's `summary`, a report's `this_run`); report: the run
    report, for the output file's requests. The Throughput line comes last."""
    out = [requests_line(run, report)]
    if report and report.get("state") not in (None, "done"):
        out.append(f"state: {report['state']}" + (f" ({report['signal']})" if report.get("signal") else "")
                   + (f": {report['error']}" if report.get("error") else ""))
    if run.get("model_not_found"):
        out.append(f"{run['model_not_found']} line(s) named a model this job does not serve (it serves "
                   f"{', '.join(run.get('served_model_names') or ())}; --served-model-name adds names, and a rerun "
                   f"retries those lines)")
    # a run that made no engine (every line answered before, or a stop before the model load) has no steps
    out.append(f"tokens: {run.get('prompt_tokens', 0)} prompt, {run.get('output_tokens', 0)} generated")
    out.append(f"time: {run['wall_s']:.1f} s, {run.get('steps', 0)} steps ({run.get('decode_steps', 0)} decoding)")
    for line in (prefill_line(run), prefix_line(run), tiers_line(run), balance_line(run)):
        if line:
            out.append(line)
    bound = bound_line(run)
    if bound:
        out.append(bound)
    out.append(throughput_line(run))
    return out


def of_document(doc: dict, run: int | None = None) -> list[str]:
    """The text of a run report or a --stats-json file (ValueError if it is neither); run: that run
    of a run report's history instead of its last."""
    if run is not None:
        return of_history(doc, run)
    if isinstance(doc, dict) and isinstance(doc.get("summary"), dict) and "steps" in doc:
        return text_lines(doc["summary"])
    if isinstance(doc, dict) and isinstance(doc.get("this_run"), dict):
        return text_lines(doc["this_run"], doc)
    if isinstance(doc, dict) and doc.get("state") in ("running", "failed"):
        raise ValueError(f"the run is {doc['state']}" + (f" ({doc['error']})" if doc.get("error") else "")
                         + ": its report has no figures yet")
    raise ValueError("neither a run report (OUTPUT.summary.json) nor a --stats-json file")


def of_history(doc: dict, run: int) -> list[str]:
    """Run `run` of a run report, from the figures its history entry keeps (ValueError if it has none)."""
    history = doc.get("history") if isinstance(doc, dict) else None
    if not isinstance(history, list):
        raise ValueError("not a run report (OUTPUT.summary.json): only a run report lists its runs")
    entry = next((h for h in history if isinstance(h, dict) and h.get("run") == run), None)
    listed = [h.get("run") for h in history if isinstance(h, dict) and isinstance(h.get("run"), int)]
    if entry is None:
        kept = f"runs {min(listed)}-{max(listed)}" if listed else "no runs"
        raise ValueError(f"run {run} is not in its history (it lists {kept})")
    figures = entry.get("figures")
    if not isinstance(figures, dict) or "wall_s" not in figures:
        raise ValueError(f"run {run} ({entry.get('state')}) has no figures in the report: its run ended before "
                         f"writing them, or an older fastdecode wrote it")
    head = f"run {run} of {doc.get('runs', max(listed))}: {entry.get('state')}"
    stopped = entry.get("state") == "interrupted" and entry.get("signal")
    return [head + (f" ({entry['signal']})" if stopped else "")] + text_lines(figures)
