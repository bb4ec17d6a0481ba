"""What `plan` says about the S<->R link: which path bounds it, how it compares with the next side,
what it adds to a step, whether a deeper pipeline hides it, and the bandwidth that would balance it.

The link is hidden at depth k when the layer time is what it would be over a free link (within
HIDDEN_WITHIN): its load k·link stays under the larger side's and one mini-batch's chain
s + r + link + hop fits in the cycle. No depth hides a link whose load is above the larger
side's (each scales as 1/k); only bandwidth does.
"""
from __future__ import annotations

import dataclasses

from fastdecode.sizing.model import layer_times
from fastdecode.sizing.schema import LinkProfile, Profile
from fastdecode.sizing.split import Split

HIDDEN_WITHIN = 0.02        # a layer at most 2% slower than over a free link: the link is hidden
MAX_HIDE_DEPTH = 8          # depths tried for link_hiding_depth


def free_link(profile: Profile) -> Profile:
    """The profile with a link that costs nothing (the chain's hand-offs, `hop`, kept)."""
    return dataclasses.replace(profile, link=LinkProfile(latency_s=0.0, bandwidth_Bps=1e18, hop_s=profile.link.hop_s))


def link_report(profile: Profile, batch: int, gen_len: int, prompt_len: int, rworkers: int, depth: int,
                shared_prefix: int = 0, prefix_group: int | None = None, kv_reserve: str = "full",
                split: Split | None = None) -> dict:
    """The link's figures for `batch` sequences (what runs; split as `split` says, placement's
    split by default) at `depth` (the module docstring):
    link_bound_by (the slowest R-worker's name or the S-worker's path), link_next_side ("S" or
    "R") and link_over_next (per-layer load of the link / of that side), link_exposed_s (what the
    link adds to a step at this depth), link_hidden, link_hiding_depth (the smallest depth up to
    MAX_HIDE_DEPTH that hides it; None: none does), link_balance_Bps (the bandwidth on the
    bounding path at which the link's load would equal the next side's; None: its latency alone
    exceeds that side)."""
    share = dict(shared_prefix=shared_prefix, prefix_group=prefix_group, kv_reserve=kv_reserve, split=split)
    free = free_link(profile)

    def exposed(k: int) -> tuple[float, float]:
        real = layer_times(profile, batch, gen_len, prompt_len, rworkers, k, **share)["layer"]
        return real - layer_times(free, batch, gen_len, prompt_len, rworkers, k, **share)["layer"], real

    def hidden(k: int) -> bool:
        extra, real = exposed(k)
        return extra <= HIDDEN_WITHIN * (real - extra)

    t = layer_times(profile, batch, gen_len, prompt_len, rworkers, depth, **share)
    s_side = t["s"] + t["tier"]            # the S-part and the S-worker's own tier's attention
    side = "S" if s_side >= t["r"] else "R"
    next_load = max(s_side, t["r"])
    room = next_load - t["link_latency_s"]
    return {"link_bound_by": t["link_by"], "link_next_side": side,
            "link_over_next": t["link"] / next_load if next_load > 0 else float("inf"),
            "link_exposed_s": profile.model.num_layers * exposed(depth)[0], "link_hidden": hidden(depth),
            "link_hiding_depth": next((k for k in range(1, min(MAX_HIDE_DEPTH, batch) + 1) if hidden(k)), None),
            "link_balance_Bps": t["link_bytes"] / room if room > 0 else None}


def link_line(row: dict) -> str:
    """plan's line on the link for one batch (`row`: predict's fields and link_report's)."""
    by = row["link_bound_by"]
    line = (f"link: {row['link_layer_s'] * 1e3:.3f} ms per layer over {by}"
            + ("" if by.startswith("the ") else "'s link")
            + f", {row['link_over_next']:.2f}x the {row['link_next_side']} side")
    if row["link_hidden"]:
        return line + f"; hidden at depth {row['pipeline_depth']}"
    line += f"; adds {row['link_exposed_s'] * 1e3:.1f} ms to a step at depth {row['pipeline_depth']}"
    depth = row["link_hiding_depth"]
    line += (f", hidden from depth {depth}" if depth else
             "; no pipeline depth hides it" + (" (its load exceeds the other side's)" if row["link_over_next"] > 1 else ""))
    balance = row["link_balance_Bps"]
    return line + (f"; it would balance at {balance / 1e9:.3g} GB/s" if balance else
                   "; its latency alone exceeds the other side")
