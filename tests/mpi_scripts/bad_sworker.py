"""Under `mpiexec -n 2`: rank 0 plays an S-worker that sends one malformed message to a real
R-worker (rank 1), which must end the job naming itself and the problem. usage: bad_sworker.py CASE

Rank 0 sends a valid HELLO, one valid prefill of sequence 1 (4 tokens), then the case's message,
and waits; a correct R-worker aborts the job within seconds, so rank 0 exits 3 if it is still
alive after 60 s (the test then sees that the job hung)."""
import sys
import time

import numpy as np
from mpi4py import MPI

from rworker.host.wait import node_layout
from rworker.protocol import control as P
from rworker.worker import run

HQ, HKV, D, LAYERS = 4, 2, 16, 2
comm = MPI.COMM_WORLD
if comm.Get_rank() != 0:
    sys.exit(run(comm, threads=1, capacity_bytes=64 << 20, timeout=20))

node_layout(comm)
send = lambda msg: comm.Send([msg, MPI.INT64_T], dest=1, tag=P.TAG_CTRL)   # noqa: E731
send(P.hello_message(P.Hello(LAYERS, HQ, HKV, D, "fp32", D ** -0.5, threads=1, capacity_bytes=64 << 20)))
status = MPI.Status()
comm.Probe(1, P.TAG_INFO, status)
comm.Recv(np.empty(status.Get_count(MPI.BYTE), np.uint8), source=1, tag=P.TAG_INFO)
send(P.prefill_message(1, np.ones(4, np.int64), 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64)))
for _ in range(LAYERS):
    comm.Send(np.zeros(2 * 4 * HKV * D, np.float32), dest=1, tag=P.TAG_KV)

qkv = (HQ + 2 * HKV) * D                       # floats per decode row
case = sys.argv[1]
if case == "short-data":                       # a decode message one row's worth short
    send(P.decode_message(2, [np.array([1], np.int64)], 0, 0))
    comm.Send(np.zeros(qkv - 8, np.float32), dest=1, tag=P.tag_qkv(0))
elif case == "long-data":
    send(P.decode_message(2, [np.array([1], np.int64)], 0, 0))
    comm.Send(np.zeros(qkv + 8, np.float32), dest=1, tag=P.tag_qkv(0))
elif case == "unknown-id":                     # never prefilled
    send(P.decode_message(2, [np.array([7], np.int64)], 0, 0))
elif case == "negative-id":
    send(P.control(P.DECODE, 2, 1, 0, 0, body=[[1], [-5]]))
elif case == "huge-id":
    send(P.control(P.FREE, 2, 1, body=[[1 << 62]]))
elif case == "too-many-minibatches":
    n = P.MAX_MINIBATCHES + 1
    send(P.control(P.DECODE, 2, n, 0, 0, body=[[1] * n, [1] * n]))
elif case == "free-unknown":
    send(P.free_message(2, [9]))
elif case == "prefill-again":
    send(P.prefill_message(2, np.ones(2, np.int64), 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64)))
elif case == "fork-unknown":                   # a fork from a sequence the worker never held
    send(P.prefill_message(2, np.full(2, 5, np.int64), 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64),
                           None, (np.array([5]), np.array([9]), np.array([4]))))
elif case == "bad-magic":
    msg = P.control(P.SHUTDOWN)
    msg[0] = 7
    send(msg)
elif case == "short-header":
    send(np.array([P.MAGIC, P.VERSION, P.DECODE], np.int64))
else:
    raise SystemExit(f"unknown case {case}")
time.sleep(60)
sys.exit(3)
