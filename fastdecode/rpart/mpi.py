"""The S-worker's side of the R-part over MPI: scatter rows to the owning ranks, gather O back.

Only buffer-based (uppercase) nonblocking mpi4py calls on preallocated host buffers that are
reused across layers and steps. Per layer and mini-batch each R-worker gets one message
[q | k | v] of its rows (rworker.protocol.wire: the S-part writes the whole buffer in one pass) and returns
one [n, Hq, D], received straight into its rows of a double-buffered output (the gather copies
nothing). A Progressor thread keeps messages moving while the S-part computes the other
mini-batch. `bytes_sent/bytes_received` count payload.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager

import numpy as np
import torch
from mpi4py import MPI

from fastdecode.launch.ranks import role_name, world_rank
from fastdecode.model.config import ModelConfig
from fastdecode.rpart.base import PrefillTimes, RBackend, StepStats, WorkerInfo, check_kv_import, check_kv_lists
from fastdecode.rpart.kv_transfer import check_answer, receive_answer, receive_exports, send_imports
from fastdecode.rpart.shm_links import open_links, slot_plan, tensor
from fastdecode.rpart.staging import HostBuffer, Stager
from fastdecode.rpart.variants import AttentionVariants
from rworker.host.progressor import Progressor
from rworker.host.shm_link import tick
from rworker.host.wait import PeerTimeout, wait_all, wait_message
from rworker.protocol import control as P
from rworker.protocol.kvformat import ACT_CODES

ACT_CODE = {torch.float32: ACT_CODES[np.dtype(np.float32)], torch.bfloat16: ACT_CODES[np.dtype(np.uint16)]}
AUTO_FIRST_S = 900.0      # before any step was timed (first steps warm caches and allocate)
AUTO_MIN_S = 300.0


class _MiniBatch:
    """Buffers and in-flight state of one mini-batch slot (reused every step)."""

    def __init__(self, dtype: torch.dtype, pinned: bool):
        self.send = HostBuffer(dtype, pinned)
        self.out = [HostBuffer(dtype, pinned), HostBuffer(dtype, pinned)]     # layer parity
        self.out_free = [None, None]        # CUDA event: the device copy of that buffer is done
        self.send_ticket = None
        self.recv_ticket = None
        self.recv_expect: list[int] = []        # bytes each R-worker's answer must have
        self.ids: np.ndarray | None = None
        self.bounds: np.ndarray | None = None
        self.linked: list[int] = []         # workers whose rows go through their shared-memory link
        self.direct: int | None = None      # the linked worker holding every row: the S-part writes in place


class MPIBackend(RBackend):
    blob_chunk = P.MAX_BLOB_CHUNK       # bytes of one KV blob message at most (tests make it small)

    def __init__(self, comm: MPI.Comm, config: ModelConfig, kv_dtype: str, variants: AttentionVariants | float,
                 r_threads: int | None = None, rworker_mem: int | None = None, policy: str = "adaptive",
                 timeout: float | None = None, device: torch.device | None = None,
                 act_dtype: torch.dtype = torch.float32, s_cores: int = 0, bf16_probs: bool = False,
                 s_kv_bytes: int = 0, ranks: range | None = None, link_rows: int = 0):
        if not isinstance(variants, AttentionVariants):      # a bare softmax scale
            variants = AttentionVariants(float(variants))
        self.comm = comm
        # the R-workers: every rank but 0, or those after a tensor-parallel S-worker's T ranks
        self.ranks = list(ranks if ranks is not None else range(1, comm.Get_size()))
        self.policy, self.timeout = policy, timeout
        c = config
        self.num_layers, self.hq, self.hkv, self.d = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
        self.device = device or torch.device("cpu")
        self.act_dtype = act_dtype if act_dtype in ACT_CODE else torch.float32
        self.pinned = self.device.type == "cuda"
        self.stager = Stager(self.device)
        self.progress = Progressor()
        hello = P.hello_message(P.Hello(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, kv_dtype,
                                        variants.scale, r_threads or 0, rworker_mem or 0, s_cores, bf16_probs,
                                        windows=variants.windows, softcap=variants.softcap, sinks=variants.sinks,
                                        s_kv_bytes=s_kv_bytes))
        for r in self.ranks:
            comm.Send([hello, MPI.INT64_T], dest=r, tag=P.TAG_CTRL)
        self.workers = [self._recv_info(r) for r in self.ranks]
        self._names = [f"{self._who(w.rank)[:-1]} on {w.host})" for w in self.workers]
        self.bytes_sent = 0          # activation payload bytes, S -> R (decode q/k/v and prefill k/v)
        self.bytes_received = 0      # attention outputs, R -> S
        self.step = 0
        self._pending_free: list[list[int]] = [[] for _ in self.ranks]
        self._stat_bufs = [np.zeros(len(P.STEP_STATS), dtype=np.float64) for _ in self.ranks]
        self._slots: list[_MiniBatch] = []
        # without --timeout: a silent rank is declared after max(AUTO_MIN_S, 50 x the slowest step)
        self._auto_timeout = AUTO_FIRST_S
        self._slowest_step = 0.0
        self._silent_rank = False      # a rank stayed silent past the timeout: no goodbyes at close
        self._pf_bufs = [HostBuffer(self.act_dtype, self.pinned), HostBuffer(self.act_dtype, self.pinned)]
        self._pf_tickets = [None, None]
        self.prefill_times = PrefillTimes()
        # R-workers on this node take a CPU S-worker's decode rows through shared memory, up to
        # link_rows per mini-batch (rpart/shm_links.py)
        self._links = open_links(self, link_rows, self.act_dtype.itemsize, self.device)

    def _who(self, r: int) -> str:
        return f"rank {world_rank(r)} ({role_name(world_rank(r))})"

    def _recv_json(self, r: int, timeout: float | None) -> dict:
        status = wait_message(self.comm, r, P.TAG_INFO, self.policy, timeout, who=self._who(r))
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([buf, MPI.BYTE], source=r, tag=P.TAG_INFO)
        return json.loads(buf.tobytes())

    def _recv_info(self, r: int) -> WorkerInfo:
        info = self._recv_json(r, self.timeout)
        if info.get("protocol") != P.VERSION:
            raise P.ProtocolError(f"{self._who(r)[:-1]} on {info.get('host', '?')}) speaks fastdecode protocol "
                                  f"version {info.get('protocol', 'unknown')}, rank 0 (S-worker) version "
                                  f"{P.VERSION}: run the same fastdecode installation on every rank")
        return WorkerInfo(rank=r, host=info["host"], threads=info["threads"], isa=info["isa"],
                          capacity_bytes=info["capacity_bytes"], page_tokens=info.get("page_tokens", 1),
                          pid=info.get("pid", 0), kernel=info.get("kernel", ""), forks=bool(info.get("forks")),
                          kv_layout=info.get("kv_layout", ""))

    def _send_control(self, w: int, msg: np.ndarray) -> None:
        """A Send with the silent-rank timeout: to a rank whose link is down a message stays queued
        once the connection's window is full, and a plain Send would wait for it forever."""
        req = self.comm.Isend([msg, MPI.INT64_T], dest=self.ranks[w], tag=P.TAG_CTRL)
        try:
            wait_all([req], self.policy, self.timeout or self._auto_timeout, who=self._names[w])
        except PeerTimeout:
            self._silent_rank = True
            raise

    def _flush_frees(self) -> None:
        for w, ids in enumerate(self._pending_free):
            if ids:
                self._send_control(w, P.free_message(self.step, ids))
                self._pending_free[w] = []

    def _wait(self, ticket) -> None:
        if ticket is not None:
            try:
                self.progress.wait(ticket, self.timeout or self._auto_timeout)
            except PeerTimeout:
                self._silent_rank = True
                raise

    # ------------------------------------------------------------------ prefill: stream prompt K/V per layer

    def prefill_begin(self, row_ids, counts, layers=0, reserve=None, continued=None, forks=None):
        self.prefill_times = PrefillTimes()
        self._flush_frees()
        self._pf_bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._pf_counts = list(counts)
        code = ACT_CODE[self.act_dtype]
        empty = np.zeros(0, np.int64)
        res_ids, res_tokens, res_counts = reserve if reserve is not None else (empty, empty, [0] * len(counts))
        res_bounds = np.concatenate([[0], np.cumsum(res_counts)]).astype(np.int64)
        fork_dst, fork_src, fork_tokens, fork_counts = forks if forks is not None else \
            (empty, empty, empty, [0] * len(counts))
        fork_bounds = np.concatenate([[0], np.cumsum(fork_counts)]).astype(np.int64)
        for w, n in enumerate(counts):
            if n:
                s, e = self._pf_bounds[w], self._pf_bounds[w + 1]
                r0, r1 = res_bounds[w], res_bounds[w + 1]
                f = slice(fork_bounds[w], fork_bounds[w + 1])
                mine = row_ids[s:e]
                more = np.intersect1d(mine, continued) if continued is not None and len(continued) else ()
                mine_forks = tuple(np.asarray(x[f], np.int64) for x in (fork_dst, fork_src, fork_tokens))
                self._send_control(w, P.prefill_message(self.step, mine, code, layers, np.asarray(res_ids[r0:r1]),
                                                        np.asarray(res_tokens[r0:r1]), np.asarray(more, np.int64),
                                                        mine_forks))

    def prefill_layer(self, layer, k, v):
        slot = layer % 2
        t = time.perf_counter()
        self._wait(self._pf_tickets[slot])             # the send two layers ago has left this buffer
        t1 = time.perf_counter()
        self.prefill_times.wait_s += t1 - t
        b = self._pf_bounds
        parts = []
        for w in range(len(self.ranks)):
            parts += [k[b[w]:b[w + 1]].reshape(-1), v[b[w]:b[w + 1]].reshape(-1)]
        buf = self._pf_bufs[slot]
        numel = sum(p.numel() for p in parts)
        packed = self.stager.buffer(numel, self.act_dtype, buf)          # [sum_w (k_w | v_w)]
        if packed.dtype == k.dtype:
            torch.cat(parts, out=packed)
        else:
            packed.copy_(torch.cat(parts))
        ready = self.stager.to_host(packed, buf)
        self.prefill_times.pack_s += time.perf_counter() - t1
        row = 2 * self.hkv * self.d
        names = [self._names[w] for w, n in enumerate(self._pf_counts) if n]

        def post_sends():
            reqs = []
            for w, n in enumerate(self._pf_counts):
                if n:
                    reqs.append(self.comm.Isend(buf.array[b[w] * row:b[w + 1] * row], dest=self.ranks[w],
                                                tag=P.TAG_KV))
            return reqs
        self.bytes_sent += numel * buf.array.itemsize
        # on a GPU the next layer's compute is queued while this layer's K/V cross PCIe and MPI
        self._pf_tickets[slot] = self.progress.track(post_sends(), names) if ready is None \
            else self.progress.track_after(ready.query, post_sends, names)

    def prefill_end(self):
        t = time.perf_counter()
        for slot in (0, 1):
            self._wait(self._pf_tickets[slot])
            self._pf_tickets[slot] = None
        self.prefill_times.wait_s += time.perf_counter() - t

    # ------------------------------------------------------------------ decode

    def decode_begin(self, minibatches, layers=0, mixed=None):
        self._flush_frees()
        self.step += 1
        while len(self._slots) < len(minibatches):
            self._slots.append(_MiniBatch(self.act_dtype, self.pinned))
        self._n_mb = len(minibatches)
        code = ACT_CODE[self.act_dtype]
        per_worker_ids = [[] for _ in self.ranks]
        for m, (ids, counts) in enumerate(minibatches):
            slot = self._slots[m]
            slot.ids = ids
            slot.bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            slot.linked, slot.direct = slot_plan(self._links, m, slot.bounds)
            for w in range(len(self.ranks)):
                per_worker_ids[w].append(ids[slot.bounds[w]:slot.bounds[w + 1]])
        for w in range(len(self.ranks)):
            self._send_control(w, P.decode_message(self.step, per_worker_ids[w], code, layers,
                                                   bool(mixed and mixed[w])))
        self._stat_reqs = [self.comm.Irecv(self._stat_bufs[w], source=r, tag=P.TAG_INFO)
                           for w, r in enumerate(self.ranks)]
        self._step_start = time.perf_counter()

    def decode_buffer(self, layer, mb, numel, device, dtype):
        """Where the S-part writes this mini-batch's packed q|k|v rows (protocol.wire layout): the
        host send buffer itself on a CPU S-worker, device memory on a GPU."""
        slot = self._slots[mb]
        self._wait(slot.send_ticket)                  # the previous layer's rows have left the buffer
        if slot.direct is not None:
            return tensor(self._links[slot.direct].qkv_buffer(mb), self.act_dtype, numel)
        return self.stager.buffer(numel, self.act_dtype, slot.send)

    def decode_submit(self, layer, mb, packed):
        slot = self._slots[mb]
        self._wait(slot.send_ticket)
        b = slot.bounds
        n = int(b[-1])
        row_in = (self.hq + 2 * self.hkv) * self.d
        for w in slot.linked:
            link = self._links[w]
            if w != slot.direct:
                s, e = int(b[w]) * row_in, int(b[w + 1]) * row_in
                tensor(link.qkv_buffer(mb), self.act_dtype, e - s).copy_(packed.reshape(-1)[s:e])
            link.ring(mb, tick(self.step, layer))
        if slot.direct is not None:
            self.bytes_sent += n * row_in * packed.element_size()
            self.bytes_received += n * self.hq * self.d * packed.element_size()
            slot.send_ticket = slot.recv_ticket = None
            return
        ready = self.stager.to_host(packed, slot.send)
        out = slot.out[layer % 2]
        out.ensure(n * self.hq * self.d)
        self.stager.wait(slot.out_free[layer % 2])    # its device copy from two layers ago is done
        out_rows = out.array[: n * self.hq * self.d].reshape(n, self.hq * self.d)
        recvs, names, expect = [], [], []
        for w, r in enumerate(self.ranks):
            s, e = int(b[w]), int(b[w + 1])
            if w in slot.linked:
                self.bytes_received += out_rows[s:e].nbytes
            elif s < e:
                recvs.append(self.comm.Irecv(out_rows[s:e], source=r, tag=P.tag_out(mb)))
                names.append(self._names[w])
                expect.append(out_rows[s:e].nbytes)
                self.bytes_received += out_rows[s:e].nbytes

        def post_sends():
            sends = []
            for w, r in enumerate(self.ranks):
                s, e = int(b[w]), int(b[w + 1])
                if s < e and w not in slot.linked:
                    sends.append(self.comm.Isend(slot.send.array[s * row_in:e * row_in], dest=r, tag=P.tag_qkv(mb)))
            return sends

        self.bytes_sent += n * row_in * slot.send.array.itemsize
        slot.recv_ticket = self.progress.track(recvs, names, sizes=True)
        slot.recv_expect = expect
        if ready is None:                             # host buffer already filled (CPU S-worker)
            slot.send_ticket = self.progress.track(post_sends(), names)
        else:                                         # GPU: send once the device copy has landed
            slot.send_ticket = self.progress.track_after(ready.query, post_sends, names)

    def decode_wait(self, layer, mb):
        slot = self._slots[mb]
        n, parity = int(slot.bounds[-1]), layer % 2
        if slot.direct is not None:
            self._wait_link(slot.direct, mb, layer)
            return tensor(self._links[slot.direct].out_buffer(mb, parity), self.act_dtype,
                          n * self.hq * self.d).view(n, self.hq, self.d)
        self._wait(slot.recv_ticket)
        for got, want, name in zip(slot.recv_ticket.received, slot.recv_expect, slot.recv_ticket.names):
            if got != want:
                raise P.ProtocolError(f"protocol error: {name} answered with {got} bytes of attention output, "
                                      f"expected {want}")
        host = slot.out[parity].tensor[: n * self.hq * self.d].view(n, self.hq, self.d)
        for w in slot.linked:
            self._wait_link(w, mb, layer)
            s, e = int(slot.bounds[w]), int(slot.bounds[w + 1])
            host[s:e].copy_(tensor(self._links[w].out_buffer(mb, parity), self.act_dtype,
                                   (e - s) * self.hq * self.d).view(e - s, self.hq, self.d))
        o, slot.out_free[parity] = self.stager.to_device(host)    # H2D on its own stream
        return o

    def _wait_link(self, w: int, mb: int, layer: int) -> None:
        try:
            self._links[w].wait(mb, tick(self.step, layer), self.timeout or self._auto_timeout, self._names[w])
        except PeerTimeout:
            self._silent_rank = True
            raise

    def decode_end(self):
        for slot in self._slots[: self._n_mb]:
            self._wait(slot.send_ticket)
            slot.send_ticket = None
        t = self.progress.track(self._stat_reqs, self._names)
        self._wait(t)
        self._slowest_step = max(self._slowest_step, time.perf_counter() - self._step_start)
        self._auto_timeout = max(AUTO_MIN_S, 50 * self._slowest_step)
        return StepStats(attend_s=[float(b[0]) for b in self._stat_bufs],
                         busy_s=[float(b[1]) for b in self._stat_bufs],
                         kv_bytes=[int(b[2]) for b in self._stat_bufs],
                         append_s=[float(b[4]) for b in self._stat_bufs],
                         kv_saved_bytes=[int(b[5]) for b in self._stat_bufs])

    # ------------------------------------------------------------------ profiling

    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]:
        """Each R-worker times its own kernel (all at once: they run on their own cores)."""
        for w in range(len(self.ranks)):
            self._send_control(w, P.control(P.PROFILE, self.step, seqs, target_bytes))
        return [self._recv_json(r, None) for r in self.ranks]

    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]:
        """One-way time per message size to each R-worker alone: half the median echo round trip."""
        return [self._echo_times([w], sizes, repeats) for w in range(len(self.ranks))]

    def ping_all(self, sizes: list[int], repeats: int) -> list[float]:
        """One-way time per message size to every R-worker at once (one echo from each, all in
        flight together): what the S-worker's own path carries when a step's messages go to all."""
        return self._echo_times(list(range(len(self.ranks))), sizes, repeats)

    def _echo_times(self, workers: list[int], sizes: list[int], repeats: int) -> list[float]:
        """[sizes] half the median round trip of one echo from each of `workers` (the workers echo
        every message of the PING's sizes, `repeats` times each)."""
        for w in workers:
            self._send_control(w, P.control(P.PING, self.step, repeats, body=[sizes]))
        ranks = [self.ranks[w] for w in workers]
        times = []
        for size in sizes:
            out = [np.ones(size, dtype=np.uint8) for _ in ranks]          # [workers][size]
            back = [np.empty(size, dtype=np.uint8) for _ in ranks]
            rtts = []
            for _ in range(repeats):
                t = time.perf_counter()
                reqs = [self.comm.Irecv([b, MPI.BYTE], source=r, tag=P.TAG_PING) for b, r in zip(back, ranks)]
                reqs += [self.comm.Isend([o, MPI.BYTE], dest=r, tag=P.TAG_PING) for o, r in zip(out, ranks)]
                MPI.Request.Waitall(reqs)
                rtts.append(time.perf_counter() - t)
            times.append(float(np.median(rtts)) / 2)
        return times

    # ------------------------------------------------------------------ KV hand-over (rpart/kv_transfer.py)

    @contextmanager
    def _naming_silence(self):
        """A peer silent past the timeout: PeerTimeout naming it, and no goodbyes at close."""
        try:
            yield self.timeout or self._auto_timeout
        except PeerTimeout:
            self._silent_rank = True
            raise

    def export_kv(self, seq_ids_by_worker):
        """Every asked R-worker exports at once; their blobs are read worker by worker."""
        check_kv_lists(self, seq_ids_by_worker)
        self._flush_frees()                   # a sequence freed before is gone, as the caller expects
        asked = [(w, [int(s) for s in ids]) for w, ids in enumerate(seq_ids_by_worker) if len(ids)]
        for w, ids in asked:
            self._send_control(w, P.kv_export_message(self.step, ids, self.blob_chunk))
        out: list[dict[int, bytes]] = [{} for _ in self.ranks]
        missing = []
        with self._naming_silence() as timeout:
            for w, ids in asked:
                out[w], gone = receive_exports(self.comm, self.ranks[w], self._names[w], ids, self.blob_chunk,
                                               self.policy, timeout)
                missing += [f"sequence {s} on {self._names[w]}" for s in gone]
        if missing:
            raise KeyError(f"export_kv: {', '.join(missing)}: not held")
        return out

    def import_kv(self, worker, seq_ids, blobs):
        """The blobs to one R-worker, which answers per sequence once all are in (JSON, TAG_INFO)."""
        check_kv_import(self, worker, seq_ids, blobs)
        if not len(seq_ids):
            return []
        self._flush_frees()                   # an id freed before may come back
        ids = [int(s) for s in seq_ids]
        self._send_control(worker, P.kv_import_message(self.step, ids, [len(b) for b in blobs], self.blob_chunk))
        rank, who = self.ranks[worker], self._names[worker]
        with self._naming_silence() as timeout:
            send_imports(self.comm, rank, who, blobs, self.blob_chunk, self.policy, timeout)
            answer = receive_answer(self.comm, rank, who, self.policy, timeout)
        return check_answer(answer, rank, who, ids)

    # ------------------------------------------------------------------ lifecycle

    def free(self, seq_ids_by_worker):
        for w, ids in enumerate(seq_ids_by_worker):
            self._pending_free[w].extend(int(i) for i in ids)

    def close(self):
        for link in self._links:
            if link is not None:
                link.close()
        if self._silent_rank:     # the job is being aborted (mpi_env.fail); a SHUTDOWN would wait for it
            self.progress.close()
            return
        self._flush_frees()
        for w in range(len(self.ranks)):
            self._send_control(w, P.control(P.SHUTDOWN, self.step))
        self.progress.close()
