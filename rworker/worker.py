"""The R-worker's MPI loop: hold the KV-cache, append K/V, attend, return O. Never imports torch.

Rank 0 (the S-worker) drives everything; rworker.protocol.control gives the message order. A step's data
messages have sizes known from its control message, so the next mini-batch's receive is posted
before the current one is attended.

A PREFILL's K/V layers are appended as their messages come. In a mixed step (a DECODE marked
mixed, its PREFILL right behind it) they interleave with the decode rows: layer i's appends, then
layer i's attention, so the S-worker sends one step's prompt-chunk K/V and decode rows layer by
layer together.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import numpy as np
from mpi4py import MPI

from rworker.host import faults
from rworker.host.capacity import default_capacity_bytes
from rworker.host.cores import bind, rworker_cpus
from rworker.host.progressor import Progressor
from rworker.host.shm_link import ShmLink, tick
from rworker.host.threads import physical_cpus
from rworker.host.wait import choose_policy, end_job_on_error, node_layout, wait_message
from rworker.kv_blobs import layout_hex
from rworker.kv_transfer import receive_blobs, send_blobs
from rworker.kvstore import KVStore
from rworker.protocol import control as P
from rworker.protocol.wire import split_kv, split_qkv
from rworker.tune import open_tuned_store

STATS = P.STEP_STATS     # what it reports after each DECODE step (rworker.protocol.control)


class RWorker:
    def __init__(self, comm: MPI.Comm, threads: int | None = None, capacity_bytes: int | None = None,
                 timeout: float | None = None, ranks_here: int = 1, s_worker_here: int = 0,
                 local_rank: int = 0):
        self.comm, self.rank = comm, comm.Get_rank()
        # s_worker_here: the S-worker's ranks on this node (a tensor-parallel S-worker has several,
        # each keeping HELLO's s_cores and s_kv_bytes), which come first among the node's ranks
        self.ranks_here, self.s_worker_here = ranks_here, int(s_worker_here)
        self.r_index = local_rank - self.s_worker_here      # among this node's R-workers
        self.progress = Progressor()
        self.s_name = "rank 0 (S-worker)"
        self.threads_arg, self.capacity_arg = threads, capacity_bytes
        # R-workers give rank 0 three times as long as rank 0 gives them, so that when a peer goes
        # silent rank 0 (which sees every R-worker) is the one that names it
        self.timeout = 3 * timeout if timeout else None
        self.policy = "adaptive"
        self.store: KVStore | None = None
        self.link: ShmLink | None = None    # decode rows through shared memory (an S-worker on this node)
        self.known: set[int] = set()    # sequences this worker holds (prefilled or imported, not freed)
        self.stats = np.zeros(len(STATS), dtype=np.float64)   # sent after every DECODE step
        self.append_s = 0.0             # prefill appends since the last DECODE step's stats
        self.stream = None              # the PREFILL whose K/V layers are still coming (a generator)
        self.stream_next = 0            # its next layer

    # ------------------------------------------------------------------ control

    def recv_control(self) -> np.ndarray:
        status = wait_message(self.comm, 0, P.TAG_CTRL, self.policy, self.timeout, who="rank 0 (S-worker)")
        msg = np.empty(status.Get_count(MPI.INT64_T), dtype=np.int64)
        self.comm.Recv([msg, MPI.INT64_T], source=0, tag=P.TAG_CTRL)
        return msg

    def serve(self) -> None:
        while True:
            kind, step, hdr, body = P.parse(self.recv_control())
            if kind != P.LINK:                 # a link's fault is its answer (attach_link)
                faults.check(self.rank, P.KIND_NAMES.get(kind, "?").lower())
            if (kind == P.HELLO) == (self.store is not None) and kind not in (P.SHUTDOWN, P.ABORT):
                raise P.ProtocolError(f"protocol error: {P.KIND_NAMES.get(kind, kind)} "
                                      f"{'after' if self.store is not None else 'before'} HELLO")
            if kind == P.HELLO:
                self.hello(hdr, body)
            elif kind == P.PREFILL:
                self.prefill(hdr, body)
                self.advance_prefill()
            elif kind == P.DECODE:
                self.decode(step, hdr, body)
            elif kind == P.FREE:
                self.free(P.parse_free(hdr, body))
            elif kind == P.PROFILE:
                self.profile(hdr)
            elif kind == P.PING:
                self.ping(hdr, body)
            elif kind in (P.KV_EXPORT, P.KV_IMPORT):
                self.move_kv(kind, hdr, body)
            elif kind == P.LINK:
                self.attach_link(hdr, body)
            elif kind in (P.SHUTDOWN, P.ABORT):
                self.progress.close()
                return
            else:
                raise P.ProtocolError(f"protocol error: unknown control kind {kind}")

    def hello(self, hdr: np.ndarray, body: np.ndarray) -> None:
        h = P.parse_hello(hdr, body)
        # R-workers on one node split its memory (the S-worker, if here, is covered by the reserve)
        # and, unless the launcher bound each rank, its cores (around what the S-worker keeps)
        r_here = self.ranks_here - self.s_worker_here
        cpus = rworker_cpus(self.r_index, r_here, h.s_cores * self.s_worker_here)
        bind(cpus)
        threads = self.threads_arg or h.threads or len(physical_cpus(cpus))
        capacity = self.capacity_arg or h.capacity_bytes or default_capacity_bytes(
            share=max(r_here, 1), taken=h.s_kv_bytes * self.s_worker_here)
        # the V layout and prefetch that stream fastest on these cores (a few seconds; rworker.tune)
        self.store, kernel = open_tuned_store(h.num_layers, h.num_heads, h.num_kv_heads, h.head_dim, h.kv_dtype,
                                              threads, capacity, scale=h.scale, bf16_probs=h.bf16_probs,
                                              windows=h.windows or None, softcap=h.softcap or None,
                                              sinks=h.sinks or None)
        self.num_heads, self.num_kv_heads, self.head_dim = h.num_heads, h.num_kv_heads, h.head_dim
        self.num_layers = h.num_layers
        self.policy = choose_policy(self.ranks_here, r_here * self.store.threads)
        forced = self.store.amx != "off" and kernel.amx == "off"      # FASTDECODE_AMX, not the tune
        amx = f", AMX tiles {self.store.amx} (FASTDECODE_AMX)" if forced else ""
        self.send_json({"rank": self.rank, "host": socket.gethostname(), "pid": os.getpid(), "cpus": cpus,
                        "protocol": P.VERSION, "threads": self.store.threads, "isa": self.store.isa,
                        "capacity_bytes": capacity, "page_tokens": int(self.store.page_tokens),
                        "wait_policy": self.policy, "kernel": kernel.describe() + amx,
                        "forks": hasattr(self.store, "fork") and not any(h.windows),
                        "kv_layout": layout_hex(self.store),
                        "kernel_choice": {**kernel.as_dict(), "amx": self.store.amx}})

    def attach_link(self, hdr: np.ndarray, body: np.ndarray) -> None:
        """LINK: map the S-worker's shared decode rows; answer "ok" or why not (it then stays on MPI)."""
        directory, nonce = P.parse_link(hdr, body)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        try:
            faults.check(self.rank, "link")
            self.link = ShmLink.attach(directory, nonce, (hq + 2 * hkv) * d, hq * d)
            self.send_json({"link": "ok"})
        except OSError as e:
            self.link = None
            self.send_json({"link": f"{type(e).__name__}: {e}"})

    def send_json(self, obj: dict) -> None:
        payload = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
        self.comm.Send([payload, MPI.BYTE], dest=0, tag=P.TAG_INFO)

    # ------------------------------------------------------------------ profile: kernel cost, link echo

    def profile(self, hdr: np.ndarray) -> None:
        from rworker.bench import measure_attention
        result = measure_attention(self.num_heads, self.num_kv_heads, self.head_dim, self.store.kv_dtype,
                                   self.store.threads, seqs=int(hdr[0]), target_bytes=int(hdr[1]),
                                   v_tile=self.store.v_tile, prefetch=self.store.prefetch, amx=self.store.amx)
        result.update(rank=self.rank, host=socket.gethostname(), capacity_bytes=self.store.capacity_bytes)
        self.send_json(result)

    def ping(self, hdr: np.ndarray, body: np.ndarray) -> None:
        repeats = int(hdr[0])
        for size in body.tolist():
            buf = np.empty(int(size), dtype=np.uint8)
            for _ in range(repeats):
                self.comm.Recv([buf, MPI.BYTE], source=0, tag=P.TAG_PING)
                self.comm.Send([buf, MPI.BYTE], dest=0, tag=P.TAG_PING)

    def _layers(self, announced: int) -> int:
        """Layers a PREFILL/DECODE step covers, 0 meaning all of them."""
        layers = announced or self.num_layers
        if not 0 < layers <= self.num_layers:
            raise P.ProtocolError(f"protocol error: a step over {layers} layers (the model has {self.num_layers})")
        return layers

    # ------------------------------------------------------------------ what the wire may ask

    def free(self, ids: np.ndarray) -> None:
        for sid in ids.tolist():
            if sid not in self.known:
                raise P.ProtocolError(f"protocol error: FREE of sequence {sid}, which this worker does not hold")
            self.known.discard(sid)
            self.store.free(sid)

    def move_kv(self, kind: int, hdr: np.ndarray, body: np.ndarray) -> None:
        """KV_EXPORT: send the sequences' blobs (kept here); KV_IMPORT: take blobs as sequences held
        as if prefilled here, and answer which were stored (rworker.kv_transfer)."""
        move = P.parse_kv_move(kind, hdr, body)
        if kind == P.KV_EXPORT:
            send_blobs(self.comm, self.store, self.known, move, self.policy, self.timeout)
        else:
            self.send_json(receive_blobs(self.comm, self.store, self.known, move, self.policy, self.timeout))

    def _received(self, ticket, buf: np.ndarray, what: str) -> None:
        """A data message must be exactly as long as its control message said."""
        got = ticket.received[0]
        if got != buf.nbytes:
            raise P.ProtocolError(f"protocol error: a {what} message of {got} bytes, expected {buf.nbytes}")

    # ------------------------------------------------------------------ prefill: append prompt K/V

    def prefill(self, hdr: np.ndarray, body: np.ndarray, patient: bool = True) -> None:
        """Start a prefill: check and reserve now, append its layers as they come (advance_prefill).
        patient: the S-worker computes a whole layer between two K/V messages (not a mixed step),
        so waiting for them need not keep the progress thread polling fast."""
        msg = P.parse_prefill(hdr, body)
        layers, rows = self._layers(msg.layers), len(msg.row_ids)
        continued = set(msg.continued.tolist())
        new = set(msg.row_ids.tolist()) - continued
        if new & self.known:
            raise P.ProtocolError(f"protocol error: PREFILL of sequence {min(new & self.known)}, which this worker "
                                  f"already holds")
        if continued - self.known:
            raise P.ProtocolError(f"protocol error: PREFILL continues sequence {min(continued - self.known)}, which "
                                  f"this worker does not hold")
        # a fork's source: held before this prefill, or an earlier fork's destination (parse_prefill)
        unheld = set(msg.fork_src.tolist()) - self.known - set(msg.fork_dst.tolist())
        if unheld:
            raise P.ProtocolError(f"protocol error: PREFILL forks from sequence {min(unheld)}, which this worker "
                                  f"does not hold")
        self.known |= new
        for dst, src, tokens in zip(msg.fork_dst.tolist(), msg.fork_src.tolist(), msg.fork_tokens.tolist()):
            self.store.fork(src, dst, tokens)       # before the reservations: the shared pages count as held
        if len(msg.reserve_ids):    # pages for each sequence's whole reservation now: one run per (layer, head)
            self.store.reserve(msg.reserve_ids, msg.reserve_tokens)
        self.stream, self.stream_next = self._prefill_layers(msg, layers, rows, patient), 0

    def advance_prefill(self, upto: int | None = None) -> None:
        """Append the pending prefill's layers up to and including `upto` (None: all of them)."""
        while self.stream is not None and (upto is None or self.stream_next <= upto):
            try:
                next(self.stream)
                self.stream_next += 1
            except StopIteration:
                self.stream = None

    def _prefill_layers(self, msg: P.Prefill, layers: int, rows: int, patient: bool):
        """Per layer: wait for its [k | v] message, append it, yield; the next one is received meanwhile."""
        hkv, d = self.num_kv_heads, self.head_dim
        bufs = [np.empty(2 * rows * hkv * d, dtype=msg.act_dtype) for _ in range(2)]
        tickets = [self.progress.track([self.comm.Irecv(bufs[0], source=0, tag=P.TAG_KV)], self.s_name, sizes=True),
                   None]
        for layer in range(layers):
            cur = layer % 2
            if layer + 1 < layers:
                tickets[1 - cur] = self.progress.track(
                    [self.comm.Irecv(bufs[1 - cur], source=0, tag=P.TAG_KV)], self.s_name, sizes=True)
            self.progress.wait(tickets[cur], self.timeout, patient=patient)
            self._received(tickets[cur], bufs[cur], "PREFILL K/V")
            k, v = split_kv(bufs[cur], rows, hkv, d)
            t = time.perf_counter()
            self.store.append(layer, msg.row_ids, k, v)
            self.append_s += time.perf_counter() - t
            if layer == 0:
                faults.check(self.rank, "prefill-stream")
            yield layer

    # ------------------------------------------------------------------ decode: append + attend per layer

    def decode(self, step: int, hdr: np.ndarray, body: np.ndarray) -> None:
        """Per layer, per mini-batch: receive [q|k|v], append + attend, send O back. Every
        mini-batch's next message is already posted while this one is attended. In a mixed step
        each layer first appends that layer of the prompt chunks' K/V."""
        msg = P.parse_decode(hdr, body)
        layers, ids = self._layers(msg.layers), msg.ids
        if msg.mixed:                          # this step's prompt chunks: their PREFILL comes next
            kind, _, phdr, pbody = P.parse(self.recv_control())
            if kind != P.PREFILL:
                raise P.ProtocolError(f"protocol error: a mixed DECODE followed by {P.KIND_NAMES.get(kind, kind)}, "
                                      f"not PREFILL")
            faults.check(self.rank, "prefill")
            self.prefill(phdr, pbody, patient=False)
        unknown = set(np.concatenate(ids).tolist()) - self.known
        if unknown:
            raise P.ProtocolError(f"protocol error: DECODE of sequence {min(unknown)}, which this worker does not "
                                  f"hold (never prefilled, or freed)")
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        inbufs = [np.empty(len(x) * (hq + 2 * hkv) * d, dtype=msg.act_dtype) for x in ids]
        outbufs = [np.empty((len(x), hq, d), dtype=msg.act_dtype) for x in ids]
        active = [m for m, x in enumerate(ids) if len(x)]     # the S-worker sends nothing for empty ones
        prog = self.progress

        def post_recv(m: int):
            return prog.track([self.comm.Irecv(inbufs[m], source=0, tag=P.tag_qkv(m))], self.s_name, sizes=True)

        # mini-batches whose rows come through the shared-memory link (the same rule as the S-worker's)
        linked = {m for m in active if self.link is not None and self.link.fits(m, len(ids[m]))}
        recvs = {m: post_recv(m) for m in active if m not in linked}
        sends = {}
        t_step = time.perf_counter()
        attend_s = idle_s = 0.0        # idle: blocked on the S-worker's next rows (not R-part work)
        for layer in range(layers):
            self.advance_prefill(layer)        # a prefill's layer before the attention that may read it
            for m in active:
                t = time.perf_counter()
                if m in linked:
                    q, k, v, out = self._linked_rows(m, len(ids[m]), step, layer, msg.act_dtype)
                    idle_s += time.perf_counter() - t
                    t = time.perf_counter()
                    self.store.append_attend(layer, ids[m], q, k, v, out=out)
                    attend_s += time.perf_counter() - t
                    self.link.ring(m, tick(step, layer))
                    continue
                prog.wait(recvs[m], self.timeout)
                self._received(recvs[m], inbufs[m], "DECODE q/k/v")
                idle_s += time.perf_counter() - t
                q, k, v = split_qkv(inbufs[m], len(ids[m]), hq, hkv, d)
                if m in sends:
                    prog.wait(sends[m], self.timeout)   # the previous layer's O has left this buffer
                t = time.perf_counter()
                self.store.append_attend(layer, ids[m], q, k, v, out=outbufs[m])
                attend_s += time.perf_counter() - t
                sends[m] = prog.track([self.comm.Isend(outbufs[m], dest=0, tag=P.tag_out(m))], self.s_name)
                if layer + 1 < layers:
                    recvs[m] = post_recv(m)
        self.advance_prefill()
        for t in sends.values():
            prog.wait(t, self.timeout)
        busy_s = time.perf_counter() - t_step - idle_s
        self.stats[:] = (attend_s, busy_s, self.store.bytes_committed(), step, self.append_s,
                         self.store.sharing_stats()["bytes_saved"])    # the store's counters: O(1)
        self.append_s = 0.0
        self.comm.Send(self.stats, dest=0, tag=P.TAG_INFO)


    def _linked_rows(self, m: int, n: int, step: int, layer: int, act_dtype):
        """Wait for mini-batch m's rows of this layer in the link; -> q, k, v views and the O view."""
        self.link.wait(m, tick(step, layer), self.timeout, self.s_name)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        rows = np.frombuffer(self.link.qkv_buffer(m), dtype=act_dtype, count=n * (hq + 2 * hkv) * d)
        out = np.frombuffer(self.link.out_buffer(m, layer % 2), dtype=act_dtype, count=n * hq * d)
        return (*split_qkv(rows, n, hq, hkv, d), out.reshape(n, hq, d))


def run(comm: MPI.Comm, threads: int | None = None, capacity_bytes: int | None = None,
        timeout: float | None = None, end_notice_to: dict | None = None, s_ranks: int = 1) -> int:
    """Serve rank 0 until it says SHUTDOWN. Any exception aborts the whole job, naming this rank
    (on stderr, and to rank 0's end-notice listener at end_notice_to, for its run report); rank 0
    silent past the timeout is named as the silent one (its listener still answers) and the job
    ends with 75."""
    # SLURM signals every task of a step (preemption, time limit). Rank 0 decides: it finishes the
    # step in flight, saves the outputs and then tells the R-workers to stop, so they keep serving.
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    try:
        ranks_here, s_here, local_rank = node_layout(comm, s_ranks)    # collective: every rank calls it
        RWorker(comm, threads, capacity_bytes, timeout, ranks_here, s_here, local_rank).serve()
    except BaseException as e:  # noqa: BLE001 - every failure must end the job, not hang it
        end_job_on_error(comm, e, "R-worker", end_notice_to)    # an R-worker waits on rank 0 alone
    return 0
