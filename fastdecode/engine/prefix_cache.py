"""Shared prompt prefixes, the S-worker's side (issue 32): which sequence may start from pages
another sequence already holds on an R-worker, and the prefix K/V its prefill attends to.

Prompts are keyed by a hash chain over whole pages of token ids (a page = the R-workers'
page_tokens): key[i] = hash((key[i-1], tokens of page i)), so equal keys at depth i mean equal
first i pages. A match is checked against the token ids too,
so a hash collision costs a miss, never wrong tokens.

- Donor and entry. A sequence admitted while other waiting prompts share at least its first page
  donates: an *entry* opens, and while the donor prefills the S-worker keeps its K/V (per layer)
  of the deepest whole-page prefix a waiting prompt shares, within a token budget (`budget`; past
  it, no entry: those prompts prefill in full). The entry is pending until that K/V is complete.
- Member. A waiting sequence whose prompt shares T >= 1 whole pages with a ready entry (T capped
  so that at least one of its tokens is left to prefill: its last row's logits are needed) is
  placed on the entry's worker while that worker has room. The worker forks T tokens from a
  holder (`forks`, sent with the member's first prefill chunk) and the member prefills only tokens
  T.., attending to the kept K/V exactly as a chunked prefill's later chunk does (`Fork`). One
  whose best match is still pending waits a step (the scheduler holds it back) instead of
  prefilling the prefix again. A member may donate a deeper entry in turn (n samples of a question
  behind a shared system prompt); that entry's `parent` holds its first `base` tokens.
- Holders: the donor and the members. A member holds the pages of its entry and of the entry's
  ancestors. Once no waiting prompt shares an entry's first page its K/V is dropped (a later one
  prefills in full and donates again); an entry whose donor has ended and that no member reads is
  dropped.
- Pages: placement counts a member's own pages only; the donor's count its whole prompt. When a
  donor ends while members still read its pages, those pages (up to the deepest a holder reads)
  stay charged on its worker (Placement.set_lent) until the last reader ends, as the R-worker's
  refcounts keep them.
Requests asking for prompt_logprobs never share (their logits cover the whole prompt); nor do
prompts shorter than a page and a token.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fastdecode.engine.sequence import Sequence
from fastdecode.sched.placement import Placement


@dataclass(eq=False)
class Entry:
    """One donor's whole-page prefix on its worker, and who reads its pages."""
    donor: Sequence
    worker: int
    tokens: int                      # T: the prefix it offers (whole pages)
    base: int                        # tokens of it the donor itself reads from `parent` (0: none)
    parent: Entry | None
    keys: list[int]                  # page keys of the prefix (tokens // page of them)
    kv: list = field(default_factory=list)    # per layer (K, V) [tokens, Hkv, D], on the S-worker's device
    ready: bool = False              # kv complete (and so the donor's pages on its worker): members may join
    retired: bool = False            # kv dropped (no waiting prompt shares it): no more members
    donor_live: bool = True
    holders: dict[int, int] = field(default_factory=dict)   # member seq id -> tokens of these pages it reads
    depths: Counter = field(default_factory=Counter)        # those token counts -> members reading that many
    id: int = field(default_factory=itertools.count().__next__)   # unique in the process (a tensor-parallel
                                                                   # follower keeps its heads' K/V under it)

    @property
    def prompt(self) -> list[int]:
        return self.donor.request.prompt_ids

    def reach(self) -> int:
        """Tokens a new member may start from: the whole prefix while the donor lives, else the
        most a member still reads (pages nobody reads may be gone)."""
        return self.tokens if self.donor_live else max(self.depths, default=0)

    def source(self, tokens: int) -> int:
        """A sequence holding at least `tokens` of these pages (a fork's source)."""
        if self.donor_live:
            return self.donor.seq_id
        return next(sid for sid, t in self.holders.items() if t >= tokens)

    def add(self, seq_id: int, tokens: int) -> None:
        self.holders[seq_id] = tokens
        self.depths[tokens] += 1

    def remove(self, seq_id: int) -> None:
        tokens = self.holders.pop(seq_id)
        self.depths[tokens] -= 1
        if not self.depths[tokens]:
            del self.depths[tokens]


class Fork(NamedTuple):
    """What a member's first prefill chunk does: its worker forks `tokens` of `source`'s pages, and
    its rows attend to `kv` (per layer (K, V) [tokens, Hkv, D]) before their own."""
    source: int
    tokens: int
    kv: list
    entry: int = -1              # the entry whose K/V `kv` views (Entry.id)


class PrefixCache:
    def __init__(self, page_tokens: int, num_layers: int, placement: Placement, budget_tokens: int):
        self.page, self.num_layers = page_tokens, num_layers
        self.placement = placement
        self.budget = budget_tokens      # most prefix tokens whose K/V the S-worker keeps at once
        self.kept_tokens = 0             # tokens of the entries' K/V (pending ones' included)
        self.interest: Counter = Counter()              # page key -> waiting sequences that could share it
        self.cover: dict[int, list[Entry]] = {}         # page key -> entries whose prefix holds that page
        self.entries: set[Entry] = set()
        self.joined: dict[int, list[tuple[Entry, int]]] = {}   # member -> (entry, tokens it reads), ancestors after
        self.donated: dict[int, Entry] = {}             # donor seq id -> its entry
        self.forks: dict[int, Fork] = {}                # member seq id -> the fork of its next prefill
        self.hits = self.shared_tokens = 0              # members placed, and the tokens they started from
        self.version = 0                 # bumped when what a waiting sequence could share changes
        self._estimates: dict[int, tuple[int, int]] = {}   # waiting seq id -> (version, shareable tokens)
        self.retired_ids: list[int] | None = None   # ids of entries whose K/V was dropped, where someone
                                                    # keeps a copy to drop with it (tensor-parallel followers: tp/leader.py)

    # ------------------------------------------------------------------ keys and the queue's interest

    def keys(self, seq: Sequence) -> list[int]:
        """The hash chain over the prompt's whole pages (computed once per request: its n samples share it)."""
        req = seq.request
        if req.page_keys is None:
            ids, p, key, keys = req.prompt_ids, self.page, 0, []
            for i in range(len(ids) // p):
                key = hash((key, *ids[i * p:(i + 1) * p]))
                keys.append(key)
            req.page_keys = keys
        return req.page_keys

    def shareable_pages(self, seq: Sequence) -> int:
        """Whole pages of its prompt the sequence could start from: all but the last KV token must stay
        to be prefilled (its logits are needed); none for a request asking prompt_logprobs."""
        if seq.request.params.prompt_logprobs is not None:
            return 0
        return min(len(seq.request.prompt_ids) // self.page, (seq.kv_len - 1) // self.page)

    def queued(self, seq: Sequence) -> None:
        """seq joins the waiting queue (new, or preempted): a donor ahead of it keeps K/V for it."""
        self.interest.update(self.keys(seq)[:self.shareable_pages(seq)])

    def _dequeued(self, seq: Sequence) -> None:
        self._estimates.pop(seq.seq_id, None)
        for key in self.keys(seq)[:self.shareable_pages(seq)]:
            self.interest[key] -= 1
            if not self.interest[key]:
                del self.interest[key]
                for e in [e for e in self.cover.get(key, ()) if e.ready and e.keys[0] == key]:
                    self._retire(e)          # no waiting prompt shares even its first page

    # ------------------------------------------------------------------ matching and placement

    def candidates(self, seq: Sequence) -> list[tuple[Entry, int]]:
        """(entry, tokens seq would start from), deepest first, ready before pending at equal depth."""
        pages = self.shareable_pages(seq)
        if not pages:
            return []
        keys, ids, found = self.keys(seq), seq.request.prompt_ids, {}
        for d in range(pages, 0, -1):
            for e in self.cover.get(keys[d - 1], ()):
                if e in found:
                    continue
                t = min(d * self.page, e.reach())
                found[e] = t if t and ids[:t] == e.prompt[:t] else 0
        return sorted(((e, t) for e, t in found.items() if t), key=lambda c: (-c[1], not c[0].ready))

    def shareable(self, seq: Sequence) -> int:
        """Tokens a waiting sequence would start from if placed now (admission's estimate of its
        footprint; kept until the entries change, since admission asks every step)."""
        version, tokens = self._estimates.get(seq.seq_id, (-1, 0))
        if version != self.version:
            best = self.candidates(seq)
            tokens = best[0][1] if best else 0
            self._estimates[seq.seq_id] = (self.version, tokens)
        return tokens

    def place(self, seq: Sequence) -> int | None:
        """Place a sequence leaving the queue: as a member on an entry's worker, else anywhere in
        full. -> its worker, or None if it must wait (no room; or the entry it would join is still
        being prefilled: it joins next step). The deepest prefix wins, then the load: a member goes
        in full to a less loaded worker rather than join a busier one (it donates the prefix there),
        so a hot prefix spreads over the workers, one copy each."""
        pl = self.placement
        full = pl.best(seq)
        for entry, tokens in sorted(self.candidates(seq), key=lambda c: (-c[1], pl.cost(c[0].worker, seq, c[1]))):
            if full is not None and pl.cost(entry.worker, seq, tokens) > pl.cost(full, seq):
                continue
            if pl.best(seq, (entry.worker,), tokens) is None:
                continue
            if not entry.ready:
                return None
            pl.place(seq, entry.worker, tokens)
            self._join(seq, entry, tokens)
            break
        else:
            if full is None:
                return None
            pl.place(seq, full)
        self._dequeued(seq)
        self._donate(seq)
        return seq.worker

    def _join(self, seq: Sequence, entry: Entry, tokens: int) -> None:
        kv = [(k[:tokens], v[:tokens]) for k, v in entry.kv]      # views of the prefix K/V
        kv_of = entry.id
        while entry.parent is not None and tokens <= entry.base:
            entry = entry.parent                       # it reads only the parent's pages
        self.forks[seq.seq_id] = Fork(entry.source(tokens), tokens, kv, kv_of)
        seq.prefilled = tokens                         # its prefill starts there, as a later chunk does
        chain, e = [(entry, tokens)], entry
        while e.parent is not None:                    # the ancestors' pages it reads through this one
            chain.append((e.parent, e.base))
            e = e.parent
        for e, t in chain:
            e.add(seq.seq_id, t)
        self.joined[seq.seq_id] = chain
        self.hits += 1
        self.shared_tokens += tokens

    def _donate(self, seq: Sequence) -> None:
        """Open an entry if other waiting prompts share pages of seq's prompt beyond what it reads."""
        shared = self.placement.shared_tokens(seq)
        keys, d = self.keys(seq), len(self.keys(seq))
        while d * self.page > shared and not self.interest[keys[d - 1]]:
            d -= 1
        room = (self.budget - self.kept_tokens) // self.page * self.page    # its K/V is kept from token 0
        tokens = min(d * self.page, room)
        if tokens <= shared or seq.request.params.prompt_logprobs is not None:
            return
        parent = self.joined[seq.seq_id][0][0] if shared else None
        entry = Entry(seq, seq.worker, tokens, shared, parent, keys[:tokens // self.page])
        for key in entry.keys:
            self.cover.setdefault(key, []).append(entry)
        self.entries.add(entry)
        self.donated[seq.seq_id] = entry
        self.kept_tokens += tokens
        self.version += 1

    # ------------------------------------------------------------------ the runner's side

    def take_fork(self, seq: Sequence) -> Fork | None:
        """The fork its worker runs before this prefill chunk, once; None: no fork."""
        return self.forks.pop(seq.seq_id, None)

    def capture_tokens(self, seq: Sequence) -> int:
        """Prefix tokens whose K/V this prefill keeps for a pending entry of seq's (0: none)."""
        entry = self.donated.get(seq.seq_id)
        return entry.tokens if entry is not None and not entry.ready else 0

    def keep(self, seq: Sequence, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The donor's prefix K/V [T, Hkv, D] of `layer` (layers come in order); after the last
        the entry is ready: the donor's pages are on its worker before any member's fork."""
        entry = self.donated.get(seq.seq_id)
        if entry is None or entry.ready or entry.retired or layer != len(entry.kv):
            return
        entry.kv.append((k, v))
        entry.ready = len(entry.kv) == self.num_layers
        self.version += entry.ready
        if entry.ready and not self.interest[entry.keys[0]]:
            self._retire(entry)              # those who shared it were placed elsewhere meanwhile

    def not_prefilled(self, seq: Sequence) -> None:
        """seq's K/V came another way (a stop's saved KV, reloaded: engine/kv_reload.py): no prefill
        keeps its prefix, so the entry it donated is dropped before anyone waits on it (those who
        share its prompt prefill in full, or donate again)."""
        entry = self.donated.pop(seq.seq_id, None)
        if entry is not None:
            entry.donor_live = False
            self._retire(entry)
            self.entries.discard(entry)

    # ------------------------------------------------------------------ ends

    def released(self, seq: Sequence) -> None:
        """seq left its worker (finished or preempted; placement has released its own pages)."""
        self.forks.pop(seq.seq_id, None)
        for entry, _ in self.joined.pop(seq.seq_id, ()):
            entry.remove(seq.seq_id)
            self._settle(entry)
        entry = self.donated.pop(seq.seq_id, None)
        if entry is not None:
            entry.donor_live = False
            self._settle(entry)

    def _settle(self, entry: Entry) -> None:
        """After a holder of a donor-less entry ended: charge the pages still read, or drop it."""
        if entry.donor_live:
            return
        self.version += 1                # its reach may have shrunk
        if entry.holders:
            self.placement.set_lent(entry, entry.worker, max(max(entry.depths) - entry.base, 0))
            return
        self.placement.set_lent(entry, entry.worker, 0)
        self._retire(entry)
        self.entries.discard(entry)

    def _retire(self, entry: Entry) -> None:
        """Drop an entry's K/V and stop offering it (its holders stay counted until they end)."""
        if entry.retired:
            return
        entry.retired, entry.ready, entry.kv = True, False, []
        if self.retired_ids is not None:
            self.retired_ids.append(entry.id)
        for key in entry.keys:
            bucket = self.cover[key]
            bucket.remove(entry)
            if not bucket:
                del self.cover[key]
        self.kept_tokens -= entry.tokens
        self.version += 1

    def summary(self, kv_bytes_per_token: int) -> dict:
        """The run summary's prefix sharing figures."""
        return {"prefix_hits": self.hits, "prefix_shared_tokens": self.shared_tokens,
                "prefix_kv_bytes_saved": self.shared_tokens * kv_bytes_per_token}
