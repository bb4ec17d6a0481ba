"""The S-worker's side of the R-part over MPI: scatter rows to the owning ranks, gather O back.

Only buffer-based (uppercase) mpi4py calls: per layer and mini-batch each R-worker gets one
message [q | k | v] of its rows and returns one [n, Hq, D]. Outputs are received straight into
the rows of one array, so the gather copies nothing.
"""
from __future__ import annotations

import json
import struct
import time

import numpy as np
import torch
from mpi4py import MPI

from rworker import protocol as P
from rworker.wait import wait_all, wait_message

from ..config import ModelConfig
from .base import RBackend, StepStats, WorkerInfo, as_numpy


class MPIBackend(RBackend):
    def __init__(self, comm: MPI.Comm, config: ModelConfig, kv_dtype: str, scale: float,
                 r_threads: int | None = None, rworker_mem: int | None = None, policy: str = "adaptive",
                 timeout: float | None = None):
        self.comm = comm
        self.ranks = list(range(1, comm.Get_size()))
        self.policy, self.timeout = policy, timeout
        c = config
        self.num_layers, self.hq, self.hkv, self.d = c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim
        scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
        hello = P.control(P.HELLO, 0, c.num_layers, c.num_kv_heads, c.head_dim, P.KV_CODES[kv_dtype],
                          c.num_heads, body=[[scale_bits, r_threads or 0, rworker_mem or 0]])
        for r in self.ranks:
            comm.Send([hello, MPI.INT64_T], dest=r, tag=P.TAG_CTRL)
        self.workers = [self._recv_info(r) for r in self.ranks]
        self.bytes_sent = 0          # activation payload bytes, S -> R (decode q/k/v and prefill k/v)
        self.bytes_received = 0      # attention outputs, R -> S
        self.step = 0
        self._pending_free: list[list[int]] = [[] for _ in self.ranks]
        self._stat_bufs = [np.zeros(4, dtype=np.float64) for _ in self.ranks]

    def _who(self, r: int) -> str:
        return f"rank {r} (R-worker)"

    def _recv_json(self, r: int, timeout: float | None) -> dict:
        status = wait_message(self.comm, r, P.TAG_INFO, self.policy, timeout, who=self._who(r))
        buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self.comm.Recv([buf, MPI.BYTE], source=r, tag=P.TAG_INFO)
        return json.loads(buf.tobytes())

    def _recv_info(self, r: int) -> WorkerInfo:
        info = self._recv_json(r, self.timeout)
        return WorkerInfo(rank=r, host=info["host"], threads=info["threads"], isa=info["isa"],
                          capacity_bytes=info["capacity_bytes"], page_tokens=info.get("page_tokens", 1))

    def _send_control(self, w: int, msg: np.ndarray) -> None:
        self.comm.Send([msg, MPI.INT64_T], dest=self.ranks[w], tag=P.TAG_CTRL)

    def _flush_frees(self) -> None:
        for w, ids in enumerate(self._pending_free):
            if ids:
                self._send_control(w, P.control(P.FREE, self.step, len(ids), body=[ids]))
                self._pending_free[w] = []

    # ------------------------------------------------------------------ prefill

    def prefill_begin(self, row_ids, counts):
        self._flush_frees()
        self._pf_bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        self._pf_reqs: list[MPI.Request] = []
        self._pf_bufs: list[np.ndarray] = []   # kept alive until their Isend completes
        self._pf_row_ids = row_ids
        self._pf_counts = counts

    def prefill_layer(self, layer, k, v):
        k, v = as_numpy(k), as_numpy(v)
        if layer == 0:        # the control message names the activation dtype, known only now
            code = P.ACT_CODES[k.dtype]
            for w, n in enumerate(self._pf_counts):
                if n:
                    s, e = self._pf_bounds[w], self._pf_bounds[w + 1]
                    self._send_control(w, P.control(P.PREFILL, self.step, n, code,
                                                    body=[self._pf_row_ids[s:e]]))
        wait_all(self._pf_reqs, self.policy, self.timeout, who="R-workers (prefill)")
        self._pf_reqs, self._pf_bufs = [], []
        for w, n in enumerate(self._pf_counts):
            if not n:
                continue
            s, e = self._pf_bounds[w], self._pf_bounds[w + 1]
            buf = np.concatenate([k[s:e].ravel(), v[s:e].ravel()])    # [k rows | v rows]
            self._pf_bufs.append(buf)
            self._pf_reqs.append(self.comm.Isend(buf, dest=self.ranks[w], tag=P.TAG_KV))
            self.bytes_sent += buf.nbytes

    def prefill_end(self):
        wait_all(self._pf_reqs, self.policy, self.timeout, who="R-workers (prefill)")
        self._pf_reqs, self._pf_bufs = [], []

    # ------------------------------------------------------------------ decode

    def decode_begin(self, minibatches):
        self._flush_frees()
        self.step += 1
        self._mbs = minibatches
        self._bounds = [np.concatenate([[0], np.cumsum(c)]).astype(int) for _, c in minibatches]
        self._sends: dict[int, list[MPI.Request]] = {}
        self._recvs: dict[int, list[MPI.Request]] = {}
        self._outs: dict[int, np.ndarray] = {}
        self._sendbufs: dict[int, list[np.ndarray]] = {}
        self._announced = False

    def _announce(self, code: int) -> None:
        n_mb = len(self._mbs)
        for w in range(len(self.ranks)):
            counts = [c[w] for _, c in self._mbs]
            ids = [ids[b[w]:b[w + 1]] for (ids, _), b in zip(self._mbs, self._bounds)]
            self._send_control(w, P.control(P.DECODE, self.step, n_mb, code, body=[counts] + ids))
        self._stat_reqs = [self.comm.Irecv(self._stat_bufs[w], source=r, tag=P.TAG_INFO)
                           for w, r in enumerate(self.ranks)]
        self._announced = True

    def decode_submit(self, layer, mb, q, k, v):
        q, k, v = as_numpy(q), as_numpy(k), as_numpy(v)
        if not self._announced:
            self._announce(P.ACT_CODES[q.dtype])
        wait_all(self._sends.get(mb, []), self.policy, self.timeout, who="R-workers")
        bounds = self._bounds[mb]
        out = np.empty_like(q)                                   # [n, Hq, D]
        sends, recvs, bufs = [], [], []
        for w, r in enumerate(self.ranks):
            s, e = bounds[w], bounds[w + 1]
            if s == e:
                continue
            buf = np.concatenate([q[s:e].ravel(), k[s:e].ravel(), v[s:e].ravel()])
            bufs.append(buf)
            recvs.append(self.comm.Irecv(out[s:e], source=r, tag=P.TAG_OUT + mb))
            sends.append(self.comm.Isend(buf, dest=r, tag=P.TAG_QKV + mb))
            self.bytes_sent += buf.nbytes
            self.bytes_received += out[s:e].nbytes
        self._sends[mb], self._recvs[mb], self._outs[mb], self._sendbufs[mb] = sends, recvs, out, bufs

    def decode_wait(self, layer, mb):
        wait_all(self._recvs.pop(mb), self.policy, self.timeout, who="R-workers")
        out = self._outs.pop(mb)
        if out.dtype == np.uint16:
            return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(out)

    def decode_end(self):
        for reqs in self._sends.values():
            wait_all(reqs, self.policy, self.timeout, who="R-workers")
        if not self._announced:
            return None
        wait_all(self._stat_reqs, self.policy, self.timeout, who="R-workers (step stats)")
        return StepStats(attend_s=[float(b[0]) for b in self._stat_bufs],
                         busy_s=[float(b[1]) for b in self._stat_bufs],
                         kv_bytes=[int(b[2]) for b in self._stat_bufs])

    # ------------------------------------------------------------------ profiling

    def profile_workers(self, seqs: int, target_bytes: int) -> list[dict]:
        """Each R-worker times its own kernel (all at once: they run on their own cores)."""
        for w in range(len(self.ranks)):
            self._send_control(w, P.control(P.PROFILE, self.step, seqs, target_bytes))
        return [self._recv_json(r, None) for r in self.ranks]

    def ping(self, sizes: list[int], repeats: int) -> list[list[float]]:
        """One-way time per message size to each R-worker: half the median echo round trip."""
        result = []
        for w, r in enumerate(self.ranks):
            self._send_control(w, P.control(P.PING, self.step, repeats, body=[sizes]))
            times = []
            for size in sizes:
                buf = np.ones(size, dtype=np.uint8)
                rtts = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    self.comm.Send([buf, MPI.BYTE], dest=r, tag=P.TAG_PING)
                    self.comm.Recv([buf, MPI.BYTE], source=r, tag=P.TAG_PING)
                    rtts.append(time.perf_counter() - t)
                times.append(float(np.median(rtts)) / 2)
            result.append(times)
        return result

    # ------------------------------------------------------------------ lifecycle

    def free(self, seq_ids_by_worker):
        for w, ids in enumerate(seq_ids_by_worker):
            self._pending_free[w].extend(int(i) for i in ids)

    def close(self):
        self._flush_frees()
        for w in range(len(self.ranks)):
            self._send_control(w, P.control(P.SHUTDOWN, self.step))
