"""KVStore: the R-worker's paged KV-cache in host memory and decode attention over it.

Thin Python over the C++ extension (csrc/avx512/): all shape/dtype checks and all work happen
in C++, with the GIL released. Arrays cross as numpy buffers; bf16 travels as raw uint16 bits.

    store = KVStore(num_layers, num_kv_heads, head_dim, kv_dtype="bf16")
    store.reserve(seq_ids, tokens)                 # optional: pages for each sequence's whole life
    store.append(layer, seq_ids, k, v)             # k, v [n, Hkv, D] float32 | uint16 (bf16 bits)
    o = store.attend(layer, seq_ids, q)            # q [n, Hq, D] -> o [n, Hq, D] float32
    o = store.append_attend(layer, seq_ids, q, k, v, out=np.empty(..., np.uint16))  # bf16 out
    blob = store.export_seq(seq_id)                # one sequence's KV, every layer, as bytes
    other.import_seq(seq_id, blob)                 # False: past capacity; ValueError: other geometry
    other.layout_signature() == store.layout_signature()   # would store's blobs fit other

Attention variants (csrc/avx512/attention.h), all off by default: `windows` (a sliding window per
layer: the last W tokens attended, pages before them freed), `softcap` (scores s -> cap tanh(s / cap))
and per-layer sinks (set_sinks: one more softmax column per query head, GPT-OSS style).

Determinism: a sequence's output is bitwise identical whatever else is in the batch, the thread
count, and the history of other sequences' appends/frees (split points depend only on its length),
unless it shares a prefix (fork) with other sequences of the call: then its output depends, within
fp32 rounding, on which of them the call holds.
Calls on one store from several threads are serialized (a mutex in C++); every call that touches
KV data releases the GIL.

Environment: FASTDECODE_ISA (rworker.isa), FASTDECODE_THREADS / FASTDECODE_PIN=0 (rworker/host/threads.py),
FASTDECODE_SPIN_US (how long idle workers spin before sleeping, default 50), FASTDECODE_RESERVE_PAGES=0
(`reserve` takes nothing: decode pages come by extents, for measurements), FASTDECODE_EXTENT_PAGES
(pages per head an unreserved sequence takes when it outgrows its pages, default 8; 1: one at a time),
FASTDECODE_PREFETCH (0/off, 1/on, scattered: see KVStore.prefetch), FASTDECODE_AMX (0/off, 1/on,
emulate: see KVStore.amx).
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np

from rworker import isa as _isa
from rworker.host.threads import default_threads, pin_cpus
from rworker.protocol.kvformat import KV_DTYPES, kv_token_bytes

V_PAIRS = -2      # the V layout "token pairs" (csrc/avx512/simd_avx512.h), where the build has it
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class KVCapacityError(MemoryError):
    """An append would take the store past its capacity_bytes; nothing of that call was stored."""


class KVStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str = "bf16",
                 threads: int | None = None, scale: float | None = None, capacity_bytes: int | None = None,
                 isa: str | None = None, v_tile: int | None = None, prefetch: bool | str | None = None,
                 amx: bool | str | None = None, windows=None, softcap: float | None = None):
        kv_dtype = _ALIASES.get(kv_dtype, kv_dtype)
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be 'bf16', 'fp16', 'fp32' or 'int8', got {kv_dtype!r}")
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if int(val) != val or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self.kv_dtype = kv_dtype
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.capacity_bytes = capacity_bytes
        self._mod = _isa.load(isa)
        self.isa: str = self._mod.ISA
        n = default_threads() if threads is None else int(threads)
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {threads!r}")
        spin_us = int(os.environ.get("FASTDECODE_SPIN_US", "50"))
        self._windows, self._softcap = _windows(windows, self.num_layers), _softcap(softcap)
        variants = {}          # passed only when set: a store without them runs exactly as before
        if any(self._windows):
            variants["windows"] = list(self._windows)
        if self._softcap is not None:
            variants["softcap"] = self._softcap
        self._sinks: dict[int, np.ndarray] = {}
        self._st = self._mod.Store(self.num_layers, self.num_kv_heads, self.head_dim, kv_dtype, self.scale,
                                   int(capacity_bytes or 0), n, pin_cpus(n), spin_us, self._layout(v_tile), **variants)
        if prefetch is not None:
            self.prefetch = prefetch
        if amx is not None:
            self.amx = amx
        else:
            self._amx_from_env()

    def _amx_from_env(self) -> None:
        """FASTDECODE_AMX asks for the AMX scores on every store of the process: "1"/"on" where the
        CPU has them (a job whose nodes differ keeps running: a store without falls back, with a
        warning), "emulate" (tests), "0"/"off" or unset: off."""
        env = os.environ.get("FASTDECODE_AMX", "").strip().lower()
        if env in ("", "0", "off"):
            return
        if env not in ("1", "on", "emulate"):
            raise ValueError(f"FASTDECODE_AMX must be 0/off, 1/on or emulate, got {env!r}")
        try:
            self.amx = "emulate" if env == "emulate" else "on"
        except ValueError as e:
            warnings.warn(f"FASTDECODE_AMX={env}: {e}; the AMX scores stay off", RuntimeWarning, stacklevel=3)

    def _layout(self, v_tile: int | None) -> int:
        """The V run layout: v_tile if given (must be one this ISA build has), else
        FASTDECODE_VTILE where the build has that layout (a measurement knob: other builds
        ignore it), else the build's default."""
        layouts = (self._mod.V_TILE, self._mod.V_TILE_ALT) + ((V_PAIRS,) if self.has_v_pairs else ())
        if v_tile is not None:
            if v_tile not in layouts:
                raise ValueError(f"v_tile={v_tile!r}: the {self.isa} build stores V in tiles of "
                                 f"{sorted(set(layouts) - {V_PAIRS})} dims (0: token-major)"
                                 + (f" or token pairs ({V_PAIRS})" if self.has_v_pairs else
                                    f"; token pairs ({V_PAIRS}) need bf16 KV and AVX512-BF16"))
            return int(v_tile)
        env = os.environ.get("FASTDECODE_VTILE", "").strip()
        return int(env) if env.lstrip("-").isdigit() and int(env) in layouts else self._mod.V_TILE

    @property
    def has_v_pairs(self) -> bool:
        """This store can take v_tile = V_PAIRS (bf16 KV in token pairs, probabilities rounded to
        bf16 for the PV product: other bits than the other layouts, within a bf16 bound): bf16 KV
        on a build and CPU with AVX512-BF16."""
        return self.kv_dtype == "bf16" and hasattr(self._mod, "V_PAIRS") and (
            self.isa == "avx512emu" or "avx512bf16" in _isa.cpu_features())     # SIMDe emulates it anywhere

    # ---- attention variants ---------------------------------------------------------------
    @property
    def windows(self) -> tuple:
        """Sliding window per layer in tokens (0: full attention). A layer with window W attends a
        sequence's last W stored tokens, positions [max(0, len - W), len) (the query is the last
        stored token; as transformers' sliding-window mask: key j visible to query i iff i - j < W).
        Its pages wholly before them are given back to the store as appends pass them, and never
        taken by an append that would leave them dead at once."""
        return self._windows

    @property
    def softcap(self) -> float | None:
        """The logit cap: every layer's scores s = q.k * scale become softcap * tanh(s / softcap)
        before the softmax (Gemma 2 style). None: no cap."""
        return self._softcap

    def set_sinks(self, layer: int, sinks) -> None:
        """Attention sinks of one layer: sinks float [Hq], a natural-log logit per query head (Hq as
        the layer's attend calls pass), or None to clear. The softmax runs over the scores and the
        sink: o = sum_t e^{s_t} v_t / (sum_t e^{s_t} + e^{sink}) (GPT-OSS). An attend whose q has
        another head count raises ValueError."""
        if isinstance(layer, (bool, np.bool_)) or int(layer) != layer or not 0 <= layer < self.num_layers:
            raise ValueError(f"set_sinks: layer {layer!r} out of range [0, {self.num_layers})")
        layer = int(layer)
        if sinks is None:
            self._st.set_sinks(layer, np.zeros(0, np.float32))
            self._sinks.pop(layer, None)
            return
        a = np.array(sinks, np.float32)
        if a.ndim != 1 or a.size < 1:
            raise ValueError(f"set_sinks: layer {layer}: sinks must be a 1-d array of one logit per query head, "
                             f"got shape {a.shape}")
        if a.size % self.num_kv_heads:
            raise ValueError(f"set_sinks: layer {layer}: {a.size} sinks, not a multiple of num_kv_heads={self.num_kv_heads}")
        bad = np.flatnonzero(~np.isfinite(a))
        if bad.size:
            raise ValueError(f"set_sinks: layer {layer}: sinks must be finite, head {bad[0]} is {a[bad[0]]}")
        self._st.set_sinks(layer, a)
        a.flags.writeable = False
        self._sinks[layer] = a

    def sinks(self, layer: int) -> np.ndarray | None:
        """The sinks set_sinks gave `layer` (float32 [Hq], read-only), or None."""
        return self._sinks.get(int(layer))

    # ---- data path ------------------------------------------------------------------------
    def append(self, layer: int, seq_ids, k: np.ndarray, v: np.ndarray) -> None:
        """Append rows in order: row i is the next token of sequence seq_ids[i]."""
        if not self._st.append(layer, _ids(seq_ids), k, v):
            raise self._capacity_error(len(_ids(seq_ids)))

    def attend(self, layer: int, seq_ids, q: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """o[i] = softmax(q[i] K_i^T * scale) V_i over all stored tokens of seq_ids[i] at `layer` (its
        last W with a window; scores capped with softcap; the layer's sinks in the softmax)."""
        ids = _ids(seq_ids)
        if out is None:
            out = np.empty(q.shape, np.float32)
        self._st.attend(layer, ids, q, out)
        return out

    def append_attend(self, layer: int, seq_ids, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      out: np.ndarray | None = None) -> np.ndarray:
        """Fused decode step: append one token per (unique) sequence, then attend."""
        ids = _ids(seq_ids)
        if out is None:
            out = np.empty(q.shape, np.float32)
        if not self._st.append_attend(layer, ids, q, k, v, out):
            raise self._capacity_error(len(ids))
        return out

    def reserve(self, seq_ids, tokens) -> bool:
        """Take now the pages for tokens[i] tokens of sequence seq_ids[i] (created if new) at every
        layer, so that its later appends land in one run of pages per (layer, kv head) instead of
        a page wherever the free list has one: decode then streams runs, not scattered 8-16 KB
        pages (bench/kernel/NOTES.md, "Page runs"). Pages already held count. False (and nothing
        taken) if that would pass capacity_bytes, or with FASTDECODE_RESERVE_PAGES=0 (a measurement
        knob): the appends then take pages as they go."""
        if os.environ.get("FASTDECODE_RESERVE_PAGES", "").strip() == "0":
            return False
        ids = _ids(seq_ids)
        tok = np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype=np.int64)
        if tok.shape != ids.shape:
            raise ValueError(f"reserve: {ids.size} seq_ids but {tok.size} token counts")
        return self._st.reserve(ids, tok)

    def fork(self, src_id: int, dst_id: int, tokens: int) -> None:
        """New sequence dst_id holding src_id's first `tokens` tokens at every layer: its
        tokens // page_tokens full pages shared by reference (refcounted: a page is freed with its
        last holder), the tokens of a partial last page copied into a page of dst's own, so that
        appends never write a shared page. Decode attention reads shared pages once for all the
        sequences of one call that hold them. ValueError: unknown src, existing dst, or src
        holding fewer than `tokens` at some layer, or a store with sliding windows (prefix sharing is
        not offered with them: a shared page would die for one holder and not the others)."""
        if any(self._windows):
            raise ValueError(f"fork of sequence {src_id} into {dst_id}: prefix sharing is not offered with sliding "
                             f"windows (windows={self._windows})")
        if not self._st.fork(int(src_id), int(dst_id), int(tokens)):
            raise KVCapacityError(f"KV store capacity {self.capacity_bytes} bytes reached ({self.bytes_used()} in use); "
                                  f"fork of sequence {src_id} into {dst_id} refused, nothing stored")

    def free(self, seq_id: int) -> bool:
        """Release the sequence's pages (all layers) for reuse; False if the id is unknown. Pages
        it shares with another sequence stay until their last holder is freed."""
        return self._st.free(int(seq_id))

    # ---- one sequence's KV as bytes (csrc/avx512/kv_blob.h: the format) ----------------------
    def export_seq(self, seq_id: int) -> bytes:
        """Sequence seq_id's KV over every layer as a self-describing blob: a header (magic "FDKV",
        format version, total size, this store's layout_signature at offset 16, each layer's length
        and dead pages) and the raw bytes of its live pages. Shared (forked) pages are written like
        its own. KeyError if the store does not hold seq_id."""
        return self._st.export_seq(int(seq_id))

    def import_seq(self, seq_id: int, blob) -> bool:
        """New sequence seq_id holding exactly blob's KV (export_seq of this or another store of the
        same layout_signature; bytes or any contiguous buffer): attend gives the exporter's bits and
        appends continue it. Its pages are its own (no sharing, no reservation). False, and nothing
        stored, past capacity_bytes. ValueError for a held seq_id, or a blob that is truncated or
        malformed, of another format version, or of another geometry (the field and both values)."""
        return self._st.import_seq(int(seq_id), blob)

    def layout_signature(self) -> bytes:
        """The geometry part of a blob's header (layers, kv heads, head dim, kv dtype, V layout, page
        tokens and bytes, windows): a blob fits this store iff blob[16:16 + len(sig)] equals it, and
        two stores take each other's blobs iff their signatures are equal. Scale, softcap and sinks
        are not in it: the importer must run the attention with the exporter's."""
        return self._st.layout_signature()

    def sharing_stats(self) -> dict:
        """shared_pages: pages held by >= 2 sequences; shared_page_refs: the references to them;
        bytes_saved: what the references beyond the first would hold as copies."""
        shared, saved = self._st.shared_pages(), self._st.saved_pages()
        return dict(shared_pages=shared, shared_page_refs=shared + saved, bytes_saved=saved * self.page_bytes)

    # ---- accounting -----------------------------------------------------------------------
    def num_tokens(self, seq_id: int, layer: int = 0) -> int:
        return self._st.num_tokens(int(seq_id), layer)

    def num_seqs(self) -> int:
        return self._st.num_seqs()

    def bytes_used(self) -> int:
        """Bytes of pages in use (whole pages: a page holds page_tokens tokens of one sequence, layer
        and kv head), extent slack included."""
        return self._st.bytes_used()

    def bytes_committed(self) -> int:
        """Bytes of the pages that hold tokens or a reservation: bytes_used less the extents' slack,
        which the store gives back when a call needs the room. What a caller counting tokens in
        whole pages (the engine's placement) should see held."""
        return self._st.bytes_committed()

    def page_runs(self, seq_id: int, layer: int = 0) -> int:
        """Runs of consecutive pages over the kv heads of one (sequence, layer): num_kv_heads when
        each head's pages are one run in memory (a probe of the layout, for tests and benches)."""
        return self._st.page_runs(int(seq_id), layer)

    @property
    def extent_pages(self) -> int:
        """Pages per kv head a sequence takes at once when it outgrows its pages unreserved (default
        8, FASTDECODE_EXTENT_PAGES), while 1/8 of the capacity stays free: decode growth then lands in
        runs of this many pages instead of one page per 32 steps wherever the free list has one."""
        return self._st.extent_pages

    @extent_pages.setter
    def extent_pages(self, n: int) -> None:
        if int(n) != n or n < 1:
            raise ValueError(f"extent_pages must be a positive integer, got {n!r}")
        self._st.extent_pages = int(n)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page: page_tokens tokens of one (sequence, layer, kv head), K and V."""
        return self._st.page_bytes

    def bytes_reserved(self) -> int:
        """Bytes of arena allocated (virtual; grows in chunks of >= 64 MiB, never shrinks)."""
        return self._st.bytes_reserved()

    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (int8: its scales included), padding aside."""
        return self.num_layers * kv_token_bytes(self.kv_dtype, self.num_kv_heads, self.head_dim)

    @property
    def vnni(self) -> bool:
        """int8 stores: the passes run on vpdpbusd (AVX512-VNNI; FASTDECODE_VNNI=0 turns it off),
        else on vpmaddubsw (AVX-512BW, AVX2) or in plain C++. The same integers either way."""
        return bool(getattr(self._st, "vnni", False))

    @property
    def page_tokens(self) -> int:
        return self._mod.PAGE_TOKENS

    @property
    def v_tile(self) -> int:
        """V run layout: 0 token-major, V_PAIRS (-2) token pairs with bf16 probabilities (has_v_pairs),
        else tiles of this many dims (FASTDECODE_VTILE, simd.h)."""
        return self._st.v_tile

    @property
    def prefetch(self) -> str:
        """Software prefetch of the next page in attend: "on" (every next page; the default), "off"
        (the hardware prefetcher alone) or "scattered" (only a next page that lies apart from both
        its neighbours in memory: a run of one, which no hardware prefetcher sees coming; along
        runs it is "off"). FASTDECODE_PREFETCH sets the default (0/off, 1/on, scattered);
        rworker.tune picks per host and model shape. Outputs are the same in every mode."""
        return PREFETCH_MODES[self._st.prefetch]

    @prefetch.setter
    def prefetch(self, mode: bool | str) -> None:
        self._st.prefetch = prefetch_code(mode)

    @property
    def amx(self) -> str:
        """Attention on the AMX tiles (csrc/avx512/amx.h, amx_i8.h): "off" (the default, unless
        FASTDECODE_AMX or the R-worker's tune says otherwise), "on" (the AMX instructions: Sapphire
        Rapids and later, Linux >= 5.16) or "emulate" (the same tile addressing in plain C++, for
        tests on any CPU with AVX512-BF16). They serve work items of 2 query rows or more (GQA
        groups, a shared prefix's members stacked): bf16 KV with bf16 queries and head dims padded
        to a multiple of 32 (the scores, and PV where V is in token pairs), outputs differing from
        the AVX-512 path only in the order of fp32 sums; int8 KV with head dims padded to a multiple
        of 64 (the scores and PV, on AMX-INT8), outputs equal to the AVX-512 int8 path's bit for
        bit. Other calls keep their path. Setting a mode this store cannot run raises ValueError."""
        return AMX_MODES[self._st.amx] if hasattr(self._st, "amx") else "off"

    @amx.setter
    def amx(self, mode: bool | str) -> None:
        if isinstance(mode, (bool, np.bool_)):
            mode = "on" if mode else "off"
        if mode not in AMX_MODES:
            raise ValueError(f"amx must be one of {AMX_MODES} or a bool, got {mode!r}")
        if not hasattr(self._st, "amx"):        # an old build's store (bench/kernel/kernel_ab.py)
            if mode != "off":
                raise ValueError(f"amx={mode!r}: this store's build has no AMX scores")
            return
        self._st.amx = AMX_MODES.index(mode)

    @property
    def threads(self) -> int:
        return self._st.threads

    @threads.setter
    def threads(self, n: int) -> None:
        n = int(n)
        if n < 1:
            raise ValueError(f"threads must be >= 1, got {n}")
        self._st.threads = n        # the C++ pool is rebuilt; worker pins follow FASTDECODE_PIN

    def _capacity_error(self, rows: int) -> KVCapacityError:
        return KVCapacityError(
            f"KV store capacity {self.capacity_bytes} bytes reached ({self.bytes_used()} in use); "
            f"append of {rows} rows refused, nothing stored"
        )

    def __repr__(self) -> str:
        variants = ((f", windows={self._windows}" if any(self._windows) else "")
                    + (f", softcap={self._softcap:g}" if self._softcap is not None else "")
                    + (f", sinks at layers {sorted(self._sinks)}" if self._sinks else ""))
        return (f"KVStore(layers={self.num_layers}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"kv_dtype={self.kv_dtype}, isa={self.isa}, v_tile={self.v_tile}, prefetch={self.prefetch}, amx={self.amx}, "
                f"threads={self.threads}{variants}, "
                f"seqs={self.num_seqs()}, bytes_used={self.bytes_used()})")


PREFETCH_MODES = ("off", "on", "scattered")     # the C++ store's codes 0, 1, 2
AMX_MODES = ("off", "on", "emulate")            # the C++ store's codes AMX_OFF, AMX_HW, AMX_EMU


def prefetch_code(mode: bool | str) -> int:
    """A prefetch mode (a name of PREFETCH_MODES, or a bool: True = "on") as the store's code."""
    if isinstance(mode, (bool, np.bool_)):
        return 1 if mode else 0
    if mode not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {PREFETCH_MODES} or a bool, got {mode!r}")
    return PREFETCH_MODES.index(mode)


def _windows(windows, num_layers: int) -> tuple:
    """windows as a tuple of num_layers ints >= 0 (None: all 0, full attention)."""
    if windows is None:
        return (0,) * num_layers
    if isinstance(windows, (str, bytes)) or not hasattr(windows, "__len__"):
        raise ValueError(f"windows must be a sequence of {num_layers} ints (one per layer, 0: full) or None, got {windows!r}")
    if len(windows) != num_layers:
        raise ValueError(f"windows: {len(windows)} values for {num_layers} layers")
    for layer, w in enumerate(windows):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)) or not 0 <= w < 2**31:
            raise ValueError(f"windows: layer {layer} has window {w!r}, must be an int >= 0 (0: full attention)")
    return tuple(int(w) for w in windows)


def _softcap(cap) -> float | None:
    """softcap as a finite float > 0, or None."""
    if cap is None:
        return None
    try:
        c = float(cap)
    except (TypeError, ValueError):
        raise ValueError(f"softcap must be a number > 0 or None, got {cap!r}") from None
    if not (math.isfinite(c) and c > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {cap!r}")
    return c


def _ids(seq_ids) -> np.ndarray:
    if type(seq_ids) is np.ndarray and seq_ids.dtype == np.int64 and seq_ids.ndim == 1:
        return seq_ids if seq_ids.flags.c_contiguous else np.ascontiguousarray(seq_ids)
    a = np.asarray(seq_ids)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.dtype.kind not in "iu":
        raise ValueError(f"seq_ids must be integers, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)
