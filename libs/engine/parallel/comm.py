"""The collectives of one parallel engine: a standalone process group per engine (no torch.distributed global
state, so several engines and tests share a process), with a byte count per collective for the benchmark.

gloo on CPU, NCCL on CUDA devices. Every collective is bounded by the group's timeout: a rank that stops
answering fails the step instead of hanging it (a rank that died fails it at once: its sockets close).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    all_reduces: int = 0
    all_reduce_bytes: int = 0  # payload handed to all_reduce (each rank's tensor), summed
    sends: int = 0  # point-to-point sends of this rank (the KV hand-off's head slices: libs/engine/parallel/kvio.py)
    send_bytes: int = 0

    def reset(self) -> None:
        self.all_reduces = self.all_reduce_bytes = self.sends = self.send_bytes = 0


class Comm:
    """One rank's end of an engine's process group. Built unconnected (the model's all-reduce hooks hold it),
    then connect()ed once every rank is ready. Rank 0 hosts the rendezvous store: host_store() first."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.store: dist.TCPStore | None = None
        self.pg: Any = None
        self.stats = CommStats()

    def host_store(self, host: str, timeout_s: float) -> int:
        """Rank 0: start the rendezvous store on a free port of `host`; returns the port."""
        self.store = dist.TCPStore(host, 0, self.world, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        return self.store.port

    def connect(self, host: str, port: int, *, device: str = "cpu", timeout_s: float = 30.0) -> None:
        """Join the group (blocks until every rank has; bounded by `timeout_s`, which also bounds each
        collective afterwards)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.store is None:
            self.store = dist.TCPStore(host, port, self.world, False, timeout=timeout)
        if torch.device(device).type == "cuda":
            nccl = getattr(dist, "ProcessGroupNCCL", None)  # (absent from CPU builds of torch)
            if nccl is None:
                raise RuntimeError(f"device {device}: this torch build has no NCCL")
            torch.cuda.set_device(torch.device(device))
            self.pg = nccl(self.store, self.rank, self.world, nccl.Options())
        else:
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, timeout)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (it must be contiguous); returns it."""
        if self.pg is None:
            raise RuntimeError(f"rank {self.rank}: collective before the process group was connected")
        self.stats.all_reduces += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        self.pg.allreduce([t]).wait()
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        """Send contiguous `t` to rank `dst` (returns once it left; bounded by the group's timeout)."""
        self._connected()
        self.stats.sends += 1
        self.stats.send_bytes += t.numel() * t.element_size()
        self.pg.send([t], dst, 0).wait()

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into contiguous `t` what rank `src` sends (its shape and dtype agreed beforehand); returns it."""
        self._connected()
        self.pg.recv([t], src, 0).wait()
        return t

    def _connected(self) -> None:
        if self.pg is None:
            raise RuntimeError(f"rank {self.rank}: collective before the process group was connected")


def ring_all_reduce_bytes(nbytes: int, world: int) -> float:
    """Bytes each rank must send to all-reduce `nbytes` (the bandwidth-optimal bound, 2 (p - 1) / p * n)."""
    return 2 * (world - 1) / world * nbytes
