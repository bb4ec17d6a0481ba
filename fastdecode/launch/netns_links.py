"""Link profiles of the emulated cluster (fastdecode/launch/netns.py) and the `tc` commands that
shape one direction of a link.

A profile is a rate and a one-way delay with its jitter. Shaping uses `netem` (rate, delay and
jitter) where the kernel has it; a kernel without it (CONFIG_NET_SCH_NETEM unset) gets the rate
alone from `tbf`, and the cluster says the delay was not applied. Jitter alone in netem gives
each packet its own delay and so reorders them, which TCP takes as loss; with a rate in the same
netem instance each packet leaves no earlier than the one before it, so every profile with jitter
has a rate.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import asdict, dataclass

UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


@dataclass(frozen=True)
class Link:
    rate_bit: int | None = None      # bits per second; None: the veth's own speed
    delay_us: float = 0.0            # one way, each direction
    jitter_us: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


PROFILES = {
    "none": Link(),
    "1gbe": Link(10**9, 50.0, 5.0),
    "10gbe": Link(10 * 10**9, 25.0, 2.0),
    "25gbe": Link(25 * 10**9, 10.0, 1.0),
    "100g": Link(100 * 10**9, 2.0, 0.0),
}


def parse_rate(text: str) -> int:
    """"10gbit", "100mbit", "5e8" (bits per second) -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmgtKMGT]?)(?:bit|b|bps)?\s*", text)
    if not m:
        raise ValueError(f"rate {text!r}: expected a number of bits per second such as 10gbit or 100mbit")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    if value < 8000:
        raise ValueError(f"rate {text!r}: at least 8kbit")
    return int(value)


def parse_time_us(text: str) -> float:
    """"25us", "1ms", "0.5" (microseconds) -> microseconds."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*(us|ms|s)?\s*", text)
    if not m:
        raise ValueError(f"time {text!r}: expected a duration such as 25us or 1ms")
    return float(m.group(1)) * {None: 1, "us": 1, "ms": 1e3, "s": 1e6}[m.group(2)]


def link_from(profile: str | None = None, rate: str | None = None, delay: str | None = None,
              jitter: str | None = None) -> Link:
    """A profile by name, its fields overridden by whichever of rate/delay/jitter are given."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile {profile!r}: one of {', '.join(PROFILES)}")
    base = PROFILES[profile or "none"]
    if jitter and not (rate or base.rate_bit):
        raise ValueError("--jitter needs a rate (--rate or a profile with one): jitter alone reorders packets")
    return Link(parse_rate(rate) if rate else base.rate_bit,
                parse_time_us(delay) if delay else base.delay_us,
                parse_time_us(jitter) if jitter else base.jitter_us)


def has_netem() -> bool:
    """Whether this kernel has the netem qdisc: tried on the loopback of a throwaway namespace."""
    probe = ["unshare", "--net", "sh", "-c", "tc qdisc add dev lo root netem delay 1us"]
    try:
        return subprocess.run(probe, check=False, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def qdisc_args(link: Link, netem: bool) -> list[str] | None:
    """The root qdisc for one direction (`tc qdisc replace dev X root` + these), None: no shaping."""
    if link.rate_bit is None and link.delay_us == 0 and link.jitter_us == 0:
        return None
    if netem:
        args = ["netem", "limit", "100000"]
        if link.delay_us or link.jitter_us:
            args += ["delay", f"{link.delay_us}us"] + ([f"{link.jitter_us}us"] if link.jitter_us else [])
        return args + (["rate", f"{link.rate_bit}bit"] if link.rate_bit else [])
    if link.rate_bit is None:
        return None                    # a delay alone, and no netem: nothing to apply
    # burst: a 64 KiB segment (veth passes GSO super-packets) or one timer tick (1 ms) at the rate,
    # whichever is larger; the queue holds 50 ms at the rate (a 100x slower link still queues a step)
    burst = max(1 << 17, link.rate_bit // 8 // 1000)
    return ["tbf", "rate", f"{link.rate_bit}bit", "burst", str(burst), "latency", "50ms"]


def applied(link: Link, netem: bool) -> dict:
    """What shaping with `link` really does on this kernel (for `up`, `shape` and `counters`)."""
    out = {"asked": link.as_dict(), "rate_bit": link.rate_bit, "delay_us": link.delay_us if netem else 0.0,
           "jitter_us": link.jitter_us if netem else 0.0, "qdisc": (qdisc_args(link, netem) or ["none"])[0]}
    if not netem and (link.delay_us or link.jitter_us):
        out["not_applied"] = "delay and jitter: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM)"
    return out
