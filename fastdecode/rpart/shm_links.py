"""The S-worker's side of the same-node decode links (rworker.host.shm_link): who gets one, and the rows.

A CPU S-worker opens one link per R-worker that reported its own host name, after HELLO's
answers: it creates the shared rows, sends LINK, and keeps the link only if the R-worker answered
"ok" and wrote the nonce back into the shared header. Either way the names are unlinked at once.
A GPU S-worker keeps MPI: its rows reach the host by an asynchronous device copy that the MPI path
already waits for off the compute stream.
"""
from __future__ import annotations

import socket

import numpy as np
import torch

from rworker.host.shm_link import ShmLink, enabled
from rworker.protocol import control as P

LINK_SLOTS = 2          # mini-batches a link carries (deeper pipelines send the rest over MPI)
LINK_BYTES = 64 << 20   # shared memory per link at most: mini-batches with more rows go over MPI


def open_links(backend, rows: int, itemsize: int, device: torch.device) -> list[ShmLink | None]:
    """[workers] a link to each R-worker on this node (None: MPI). Marks each worker's `link`."""
    links: list[ShmLink | None] = [None] * len(backend.ranks)
    if rows <= 0 or device.type != "cpu" or not enabled():
        return links
    here = socket.gethostname()
    in_row, out_row = (backend.hq + 2 * backend.hkv) * backend.d, backend.hq * backend.d
    rows = min(rows, LINK_BYTES // (LINK_SLOTS * (in_row + 2 * out_row) * itemsize))
    for w, info in enumerate(backend.workers):
        if info.host != here:
            continue
        try:
            link = ShmLink.create(rows, LINK_SLOTS, in_row, out_row, itemsize)
        except OSError as e:
            info.link = f"MPI (no shared memory: {e})"
            continue
        try:
            backend._send_control(w, P.link_message(link.directory, link.nonce))
            answer = backend._recv_json(backend.ranks[w], backend.timeout).get("link")
        finally:
            link.unlink()
        if answer == "ok" and link.confirmed():
            links[w], info.link = link, "shared memory"
        else:
            link.close()
            info.link = f"MPI (the link failed: {answer})"
    return links


def slot_plan(links: list[ShmLink | None], slot: int, bounds: np.ndarray) -> tuple[list[int], int | None]:
    """Which workers get mini-batch `slot`'s rows by their link -> (those workers, the one worker
    holding every row when it is linked, else None: its rows are then written in place)."""
    linked = [w for w, link in enumerate(links)
              if link is not None and link.fits(slot, int(bounds[w + 1] - bounds[w]))]
    holders = [w for w in range(len(links)) if bounds[w + 1] > bounds[w]]
    direct = holders[0] if len(holders) == 1 and holders[0] in linked else None
    return linked, direct


def tensor(buffer, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first numel elements of a link's buffer as a torch tensor (no copy)."""
    return torch.frombuffer(buffer, dtype=dtype, count=numel)
