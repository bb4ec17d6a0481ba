"""Start-up tune of the attention kernel: the V layout and software prefetch that stream this
host's KV fastest for this model shape.

Neither choice changes a bit of the output (tests/test_kernel_tune.py runs every candidate and
prefetch mode on the same data; the exception, V in token pairs with bf16 probabilities, is timed
only when the job allows it: --attn-probs bf16), only the speed, and the best one depends on the
host and the shape. On 2 Zen 5 cores token-major V without software prefetch beat the build's
default then (32-dim V tiles, spread prefetch) 1.01-1.19x on 20 of 24 shapes and lost 0.90-0.94x
on Llama-3 fp32 (bench/kernel/results/kernel_ab_dev-2core-zen5-avx512-tokmajor-noprefetch.json); on
the GPU box's Xeon the prefetch was worth 1.12-1.19x (bench/kernel/NOTES.md, "Prefetch on the GPU
box"). The default is now token-major V with prefetch (bench/kernel/CHANGELOG.md, version 17), the
tiles a candidate. "Without" is
prefetch "scattered": none along runs of pages, which the hardware prefetcher follows by itself,
but a next page that lies apart from both its neighbours (a sequence grown a page at a time:
bench/kernel/CHANGELOG.md, version 15). So each R-worker
times the candidates on its own cores before it builds its store: one probe store per V layout,
a working set past the caches, the candidates interleaved over several rounds, and it keeps the
fastest unless that is within `margin` of the default (noise must not move it).

Where the CPU has AMX-BF16 and the kernel grants this process the tile state, the AMX tiles
(csrc/avx512/amx.h, amx_i8.h) join as candidates at GQA shapes. For int8 KV (64-dim steps,
AMX-INT8) both passes on the tiles, with the AVX-512 passes' bits: timed in every job. For bf16 KV
(32-dim steps) the scores on the tiles with token-major V, and PV too with V in token pairs: these
give other bits than the AVX-512 paths (the order of fp32 sums, within the same bound of the
float64 reference), so, like V pairs, only a job that allows other bits times them (--attn-probs
bf16): a tune that picked by timing among candidates of different bits could make a rerun (a
resumed job) decode other tokens than the first run. FASTDECODE_AMX=0/1 forces the tiles off/on on
every store instead (the same bits run to run; the tune then leaves them out).

FASTDECODE_KERNEL_TUNE=0 skips the tune (the build's default, or FASTDECODE_VTILE /
FASTDECODE_PREFETCH where set). numpy only, no torch.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import numpy as np

from rworker import isa as _isa
from rworker.bench import default_target_bytes
from rworker.kvstore import V_PAIRS, KVStore
from rworker.protocol.kvformat import kv_token_bytes

CONTEXT = 1024                # tokens per probe sequence: the contexts the targets name
MAX_WORKING_SET = 256 << 20   # bytes per probe store: the ">= 256 MB", past this VM's 32 MiB L3
                              # (the GPU box's 300 MB L3 holds part of it: a compute-leaning test, as there)


@dataclass
class KernelChoice:
    v_tile: int                       # V run layout (0: token-major; else tiles of this many dims)
    prefetch: str                     # software prefetch of the next page: on / off / scattered (KVStore.prefetch)
    tuned: bool                       # False: the untimed default (tune off, or one candidate)
    gbps: dict[str, float] = field(default_factory=dict)   # candidate -> median GB/s over the rounds
    working_set_bytes: int = 0
    seconds: float = 0.0
    amx: str = "off"                  # the AMX tiles (KVStore.amx) the tune picked: off / on (emulate: tests)
    amx_note: str = ""                # why the tiles were not timed on a CPU that has them (amx_here)

    def describe(self) -> str:
        what = f"v_tile {self.v_tile}, prefetch {self.prefetch}" + (f", AMX tiles {self.amx}" if self.amx != "off" else "")
        note = f"; {self.amx_note}" if self.amx_note else ""
        if not self.tuned:
            return what + " (untuned)" + note
        rates = ", ".join(f"{k} {v:.1f}" for k, v in self.gbps.items())
        return f"{what} (tuned in {self.seconds:.1f} s on {self.working_set_bytes >> 20} MiB: {rates} GB/s){note}"

    def as_dict(self) -> dict:
        return {"v_tile": self.v_tile, "prefetch": self.prefetch, "amx": self.amx, "tuned": self.tuned,
                "gbps": self.gbps, "working_set_bytes": self.working_set_bytes, "seconds": round(self.seconds, 3),
                **({"amx_note": self.amx_note} if self.amx_note else {})}


PF_LABEL = {"on": "pf", "off": "nopf", "scattered": "scattered"}


def label(v_tile: int, prefetch: str, amx: str = "off") -> str:
    layout = "token-major" if v_tile == 0 else "pairs" if v_tile == V_PAIRS else f"tiles{v_tile}"
    return f"{layout}/{PF_LABEL[prefetch]}" + ("" if amx == "off" else "/amx" if amx == "on" else f"/amx-{amx}")


def amx_here(isa: str | None = None) -> tuple[str, str]:
    """("on", "") where this build, CPU and kernel run the AMX tiles and the tune may time them;
    else ("off", why) where the CPU has AMX-BF16 but they cannot or may not run (the kernel
    refused the tile state, FASTDECODE_AMX forces a mode), ("off", "") on a CPU without AMX."""
    env = os.environ.get("FASTDECODE_AMX", "").strip()
    if "amx-bf16" not in _isa.cpu_features():
        return "off", ""
    if env:
        return "off", f"AMX tiles forced by FASTDECODE_AMX={env}, not timed"
    try:
        KVStore(1, 1, 32, "bf16", threads=1, isa=isa, amx="on")
    except ValueError as e:
        return "off", f"AMX tiles not usable ({e}): AVX-512 kept"
    return "on", ""


def pairs_allowed(isa: str | None, kv_dtype: str, bf16_probs: bool) -> bool:
    """V in token pairs is a candidate: the job allows bf16 probabilities (--attn-probs bf16) and
    this build, CPU and KV dtype have the layout (KVStore.has_v_pairs)."""
    return bf16_probs and KVStore(1, 1, 16, kv_dtype, threads=1, isa=isa).has_v_pairs


def candidates(isa: str | None = None, kv_dtype: str = "fp32", bf16_probs: bool = False) -> list[tuple[int, str]]:
    """(v_tile, prefetch) pairs worth timing on this build; the first is its default. Tiles
    without prefetch ran at 0.5-0.6x the others on every bf16 shape here, so with a second V
    layout to try they are left out. "scattered" stands for "off": the same along the probe's
    runs, and it prefetches where a grown sequence's pages scatter. With bf16_probs (and bf16 KV
    on AVX512-BF16) V in token pairs joins, with both prefetch modes: it gives other bits, within
    a bf16 bound, so only a job that allows it times it."""
    mod = _isa.load(isa)
    if mod.V_TILE == mod.V_TILE_ALT or kv_dtype == "int8":     # int8 has one V layout (quant.h)
        cands = [(mod.V_TILE, "on"), (mod.V_TILE, "scattered")]
    else:                                   # AVX-512: token-major with both modes, tiles with prefetch
        tiles = max(mod.V_TILE, mod.V_TILE_ALT)
        first = (mod.V_TILE, "on")
        cands = [first] + [c for c in ((0, "scattered"), (0, "on"), (tiles, "on")) if c != first]
    if pairs_allowed(isa, kv_dtype, bf16_probs):
        cands += [(V_PAIRS, "scattered"), (V_PAIRS, "on")]
    return cands


def tune_candidates(num_heads: int, num_kv_heads: int, head_dim: int, isa: str | None = None,
                    kv_dtype: str = "fp32", bf16_probs: bool = False, amx: str = "off") -> list[tuple[int, str, str]]:
    """What tune_kernel times: candidates() with the AMX tiles off, then, with `amx` a mode
    (amx_here's "on"; "emulate" in tests) at a GQA shape (2 query heads or more per KV head): for
    int8 KV with head dims in 64-dim steps, on AMX-INT8, the int8 passes on the tiles (the same bits
    as AVX-512's); for bf16 KV with head dims in 32-dim steps, where the job allows other bits
    (bf16_probs: --attn-probs bf16), the tiles with token-major V (the scores) and with V in token
    pairs (the scores and PV)."""
    out = [(vt, pf, "off") for vt, pf in candidates(isa, kv_dtype, bf16_probs)]
    padded = -(-head_dim // 16) * 16
    if amx == "off" or num_heads // num_kv_heads < 2:
        return out
    if kv_dtype == "bf16" and padded % 32 == 0 and bf16_probs:
        out.append((0, "on", amx))
        if pairs_allowed(isa, kv_dtype, bf16_probs):
            out.append((V_PAIRS, "on", amx))
    elif kv_dtype == "int8" and padded % 64 == 0 and (amx != "on" or "amx-int8" in _isa.cpu_features()):
        out.append((out[0][0], "on", amx))
    return out


def tune_enabled() -> bool:
    return os.environ.get("FASTDECODE_KERNEL_TUNE", "1").strip() != "0"


def default_choice(isa: str | None = None, kv_dtype: str = "fp32") -> KernelChoice:
    """What a KVStore of kv_dtype built with no v_tile/prefetch arguments runs (env knobs included:
    FASTDECODE_VTILE=-2 only where the dtype and CPU have token pairs)."""
    probe = KVStore(1, 1, 16, kv_dtype, threads=1, isa=isa)
    return KernelChoice(probe.v_tile, probe.prefetch, tuned=False)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) >> 16).astype(np.uint16)          # truncation: values don't matter here


def _fill(store: KVStore, num_kv_heads: int, head_dim: int, kv_dtype: str, seqs: int, rng) -> None:
    """Every probe sequence gets the same CONTEXT random tokens (values don't change the speed)."""
    blk = rng.standard_normal((CONTEXT, num_kv_heads, head_dim), dtype=np.float32)    # [T, Hkv, D]
    if kv_dtype == "bf16":
        blk = _bf16_bits(blk)
    per_call = max(1, (64 << 20) // blk.nbytes)                                         # <= 64 MiB a call
    slab = np.tile(blk, (per_call, 1, 1))                                               # [per_call*T, Hkv, D]
    for s0 in range(0, seqs, per_call):
        n = min(per_call, seqs - s0)
        ids = np.repeat(np.arange(s0, s0 + n, dtype=np.int64), CONTEXT)
        store.append(0, ids, slab[: n * CONTEXT], slab[: n * CONTEXT])


def pick(rates: dict[tuple, float], cands: list[tuple], margin: float) -> tuple:
    """The fastest candidate by rate (GB/s), or cands[0] (the default) unless the fastest beats it
    by more than `margin` (a fraction): a near-tie on a noisy host keeps the default."""
    best = max(cands, key=lambda c: rates[c])
    return best if rates[best] > rates[cands[0]] * (1 + margin) else cands[0]


def tune_kernel(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str, threads: int | None = None,
                isa: str | None = None, working_set_bytes: int = 0, rounds: int = 3, margin: float = 0.02,
                seed: int = 0, bf16_probs: bool = False, amx: str | None = None) -> KernelChoice:
    """Time every candidate of tune_candidates on a decode batch of this shape and return the
    fastest (median over `rounds` interleaved rounds of each candidate's best of 2 calls), or the
    default unless the fastest beats it by more than `margin`. working_set_bytes 0: 3x the largest
    cache (rworker.bench.default_target_bytes), at most MAX_WORKING_SET, per probe store. amx: the
    AMX mode to time (None: amx_here's)."""
    if num_heads % num_kv_heads or rounds < 1:
        raise ValueError(f"tune_kernel: num_heads {num_heads} must be a multiple of num_kv_heads "
                         f"{num_kv_heads}, rounds {rounds} >= 1")
    amx, amx_note = (amx, "") if amx is not None else amx_here(isa)
    cands = tune_candidates(num_heads, num_kv_heads, head_dim, isa, kv_dtype, bf16_probs, amx)
    if len(cands) == 1:
        return KernelChoice(cands[0][0], cands[0][1], tuned=False, amx_note=amx_note)
    t_start = time.perf_counter()
    rng = np.random.default_rng(seed)
    token_bytes = kv_token_bytes(kv_dtype, num_kv_heads, head_dim)            # K and V, one layer
    want = working_set_bytes or min(default_target_bytes(), MAX_WORKING_SET)
    seqs = max(2 * (threads or 1), -(-want // (CONTEXT * token_bytes)))
    nbytes = seqs * CONTEXT * token_bytes

    stores = {}
    for v_tile in dict.fromkeys(v for v, *_ in cands):                   # one probe store per V layout
        st = KVStore(1, num_kv_heads, head_dim, kv_dtype, threads=threads, isa=isa, v_tile=v_tile)
        _fill(st, num_kv_heads, head_dim, kv_dtype, seqs, rng)
        stores[v_tile] = st
    q = rng.standard_normal((seqs, num_heads, head_dim), dtype=np.float32)          # [B, Hq, D]
    if kv_dtype == "bf16":                                                # what a bf16 S-worker ships
        q = _bf16_bits(q)
    out = np.empty((seqs, num_heads, head_dim), np.float32)
    ids = np.arange(seqs, dtype=np.int64)

    def timed(c: tuple[int, str, str]) -> float:
        st = stores[c[0]]
        st.prefetch, st.amx = c[1], c[2]
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            st.attend(0, ids, q, out)
            best = min(best, time.perf_counter() - t)
        return nbytes / max(best, 1e-12) / 1e9

    for c in cands:                                                       # warm pages, threads, caches
        timed(c)
    rates: dict[tuple[int, str, str], list[float]] = {c: [] for c in cands}
    for r in range(rounds):
        for j in range(len(cands)):                                       # rotate the order each round
            c = cands[(j + r) % len(cands)]
            rates[c].append(timed(c))
    stores.clear()                                                        # the probe stores freed before the real one
    med = {c: float(np.median(v)) for c, v in rates.items()}
    best = pick(med, cands, margin)
    return KernelChoice(best[0], best[1], tuned=True, gbps={label(*c): med[c] for c in cands},
                        working_set_bytes=int(nbytes), seconds=time.perf_counter() - t_start, amx=best[2],
                        amx_note=amx_note)


def choose_kernel(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str, threads: int | None = None,
                  isa: str | None = None, capacity_bytes: int | None = None, bf16_probs: bool = False) -> KernelChoice:
    """The R-worker's choice at start-up: tuned unless FASTDECODE_KERNEL_TUNE=0 (or an explicit
    FASTDECODE_VTILE / FASTDECODE_PREFETCH, which a user set to measure one layout); the probe
    stores take at most a quarter of the KV capacity."""
    pinned = any(os.environ.get(k, "").strip() for k in ("FASTDECODE_VTILE", "FASTDECODE_PREFETCH"))
    if not tune_enabled() or pinned:
        return default_choice(isa, kv_dtype)
    ws = min(default_target_bytes(), MAX_WORKING_SET)
    if capacity_bytes:
        ws = min(ws, capacity_bytes // (4 * len({v for v, _ in candidates(isa, kv_dtype, bf16_probs)})))
    try:
        return tune_kernel(num_heads, num_kv_heads, head_dim, kv_dtype, threads, isa, working_set_bytes=ws,
                           bf16_probs=bf16_probs)
    except MemoryError:                       # a node short of memory still serves, untuned
        return default_choice(isa, kv_dtype)


def open_tuned_store(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str,
                     threads: int | None, capacity_bytes: int, scale: float | None = None,
                     bf16_probs: bool = False, windows=None, softcap: float | None = None,
                     sinks=None) -> tuple[KVStore, KernelChoice]:
    """The KV store an R-worker (or the local backend) serves from, built with choose_kernel's pick
    (bf16_probs: the job allows V in token pairs, --attn-probs bf16) and the model's attention
    variants: per-layer sliding windows (0: full), a logit soft-cap, sinks [num_layers][num_heads]."""
    kernel = choose_kernel(num_heads, num_kv_heads, head_dim, kv_dtype, threads, capacity_bytes=capacity_bytes,
                           bf16_probs=bf16_probs)
    variants = {}
    if windows is not None and any(windows):
        variants["windows"] = [int(w) for w in windows]
    if softcap:
        variants["softcap"] = float(softcap)
    store = KVStore(num_layers, num_kv_heads, head_dim, kv_dtype=kv_dtype, threads=threads, scale=scale,
                    capacity_bytes=capacity_bytes, v_tile=kernel.v_tile, prefetch=kernel.prefetch,
                    amx=None if kernel.amx == "off" else kernel.amx, **variants)   # None: FASTDECODE_AMX decides
    if sinks is not None:
        for layer, row in enumerate(np.asarray(sinks, dtype=np.float32).reshape(num_layers, num_heads)):
            store.set_sinks(layer, row)
    return store, kernel
