"""Admission controllers driven over a request trace without a model: what the tests and
`bench/schedule/admission_sim.py` use to see a controller's workload, queue and fairness over
thousands of steps in a second, with the engine's conventions (sched/admission.py docstring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fastdecode.sched.admission import as_pairs, peak_with, projected_workload


def earliest_step(running: Sequence[tuple[int, int]], items: Sequence[tuple[int, int]],
                  w_lim: float) -> int:
    """GETEARLIESTSTEP: the fewest steps from now after which `items` can start together with
    the running sequences without the projected workload passing w_lim. If the items exceed
    w_lim even alone, returns the offset at which nothing runs any more. admit() does not
    use it (it only asks "now?" and retries next step)."""
    run = as_pairs(running)
    w_run = projected_workload(run[:, 0], run[:, 1])
    new_items = as_pairs(items)
    new = projected_workload(new_items[:, 0], new_items[:, 1])
    for d in range(w_run.size):
        if peak_with(w_run, new, d) <= w_lim:
            return d
    return int(w_run.size)


@dataclass(slots=True)
class SimResult:
    """Trace of a simulated run. Per step (decode steps 0..T-1): workload [T] KV tokens held
    during the step, running [T] sequences decoding, waiting [T] queued after admission,
    admitted_now [T], w_lim [T] the limit in force at the latest admission.
    Per request [n]: arrival, head_since (first step at the queue head), admitted, finished
    (last decode step); -1 where it never happened."""
    workload: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    admitted_now: np.ndarray
    w_lim: np.ndarray
    arrival: np.ndarray
    head_since: np.ndarray
    admitted: np.ndarray
    finished: np.ndarray


def simulate(controller, requests: Sequence[tuple[int, int]], eos_steps: Sequence[int] | None = None,
             arrivals: Sequence[int] | None = None, capacity_tokens: float | None = None,
             max_steps: int = 100_000) -> SimResult:
    """Drive a controller over a request set with the engine's conventions (module docstring).
    requests[i] = (prompt_len, max_tokens); eos_steps[i] = decode steps it really runs
    (<= max_tokens; default max_tokens); arrivals[i] = step it joins the queue (default 0).
    An admitted request decodes from its admission step on, holding prompt + t + 1 tokens in
    its t-th step. Running sequences are reported with their age, and a controller with
    observe_finished() hears of each finished one (stopped: it ended before max_tokens)."""
    req = as_pairs(requests)
    n = len(req)
    eos = np.minimum(req[:, 1], eos_steps if eos_steps is not None else req[:, 1]).astype(np.int64)
    arrival = np.zeros(n, np.int64) if arrivals is None else np.asarray(arrivals, np.int64)
    order = np.lexsort((np.arange(n), arrival))        # FIFO: by arrival, then input order
    head_since, admitted, finished = (np.full(n, -1, np.int64) for _ in range(3))
    # running state, one entry per sequence: index, kv held, bound left, real steps left
    r_idx, r_kv, r_left, r_todo = (np.zeros(0, np.int64) for _ in range(4))
    trace = {k: [] for k in ("workload", "running", "waiting", "admitted_now", "w_lim")}
    nxt, limit = 0, math.inf                          # next position in `order` not yet admitted
    for step in range(max_steps):
        if nxt == n and r_idx.size == 0:
            break
        end = nxt + int(np.searchsorted(arrival[order[nxt:]], step, side="right"))
        queue = order[nxt:end]
        if queue.size and head_since[queue[0]] < 0:
            head_since[queue[0]] = step
        k = controller.admit(step, [tuple(x) for x in req[queue].tolist()],
                             list(zip(r_kv.tolist(), r_left.tolist(), (req[r_idx, 1] - r_left).tolist())),
                             capacity_tokens)
        if k:
            new = queue[:k]
            admitted[new] = step
            limit = controller.describe().get("w_lim") or math.inf
            head_since[new[head_since[new] < 0]] = step
            r_idx = np.concatenate([r_idx, new])
            r_kv = np.concatenate([r_kv, req[new, 0]])
            r_left = np.concatenate([r_left, req[new, 1]])
            r_todo = np.concatenate([r_todo, eos[new]])
            nxt += k
            if nxt < end and head_since[order[nxt]] < 0:
                head_since[order[nxt]] = step
        # decode: every running sequence appends one token
        r_kv, r_left, r_todo = r_kv + 1, r_left - 1, r_todo - 1
        trace["workload"].append(int(r_kv.sum()))
        trace["running"].append(r_idx.size)
        trace["waiting"].append(end - nxt)
        trace["admitted_now"].append(k)
        trace["w_lim"].append(limit)
        done = r_todo <= 0
        finished[r_idx[done]] = step
        if hasattr(controller, "observe_finished"):
            for i in r_idx[done].tolist():
                controller.observe_finished(int(eos[i]), bool(eos[i] < req[i, 1]))
        r_idx, r_kv, r_left, r_todo = r_idx[~done], r_kv[~done], r_left[~done], r_todo[~done]
    return SimResult(**{k: np.asarray(v) for k, v in trace.items()}, arrival=arrival,
                     head_since=head_since, admitted=admitted, finished=finished)
