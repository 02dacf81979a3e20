"""Executing KV page copies between the device pools and the host (L2) pools (the torch side; the
bookkeeping, which pages go where, is libs/kvcache/tiers.py).

Backups (device -> host) run synchronously at the start of a step, before anything can reuse the backed-up
device pages. Load-backs (host -> device) run layer by layer on a copy worker (a side stream on CUDA, a
thread on CPU), and decoder layer i waits, through a forward pre-hook, only for layer i's copies, so
loading overlaps computing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

# The copy plan is cache bookkeeping; re-exported for the runner.
from libs.kvcache.tiers import last_copies
from libs.kvcache.tiers import split_copies as split_copies

# Layer-wise load waits are bounded: a copy thread that died or hung must surface as an error.
LOAD_WAIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LayerSlot:
    """Where a global decoder layer's KV lives: pool group ("full"/"swa") and index in that group."""

    group: str
    index: int


def layer_slots(layer_is_swa: Sequence[bool]) -> list[LayerSlot]:
    slots, n_full, n_swa = [], 0, 0
    for is_swa in layer_is_swa:
        if is_swa:
            slots.append(LayerSlot("swa", n_swa))
            n_swa += 1
        else:
            slots.append(LayerSlot("full", n_full))
            n_full += 1
    return slots


def live_loads(copies: Sequence, device_pools) -> list:
    """A step's loads as `plan_copies` runs them (the last one per target page, those whose device page still
    holds the units they were made for), for processes whose arena has no unit tables: rank 0 of a parallel
    engine sends these, so the other ranks copy exactly what it copies (libs/engine/parallel/runner.py)."""
    return [c for cs in _live(last_copies(copies, "h2d"), "h2d", device_pools).values() for c in cs]


def _live(per_group: dict[str, list], direction: str, device_pools) -> dict[str, list]:
    """Drop h2d copies whose device page no longer holds their units (see plan_copies). An arena without unit
    tables (a parallel engine's other ranks) gets its loads filtered by rank 0 already (`live_loads`)."""
    arena = device_pools.arena
    if direction != "h2d" or arena is None or not arena.tables:
        return per_group
    out = {}
    for g, cs in per_group.items():
        table = arena.tables[g]
        kept = [c for c in cs if table[c.dst].tolist() == list(c.units)]
        if kept:
            out[g] = kept
    return out


def plan_copies(copies: Sequence, direction: str, device_pools,
                host_pools=None) -> dict[str, tuple[list[int], list[int], torch.Tensor | None, torch.Tensor | None]]:
    """Per group (src ids, dst ids, src units, dst units): `last_copies` plus, on each side that is an arena,
    the pages' units as the cache recorded them ([copies, units per page]; device: `PageCopy.units`, host:
    `PageCopy.host_units`; None for a static side).

    A backup reads the units its device source held (it may have been evicted since, its units reused: the
    backups run first, so the bytes are still there); a load whose device page no longer holds its units was
    evicted before it ran and is dropped (its units may be another load's destination in this step now). A
    host page's units are the ones it held when the copy was made: a host page freed since (its node left the
    tree) is not handed out again before the copies run (only a backup or an import allocates host pages)."""
    dev_arena = device_pools.arena is not None
    host_arena = host_pools is not None and host_pools.arena is not None
    out = {}
    for g, cs in _live(last_copies(copies, direction), direction, device_pools).items():
        dev = torch.tensor([c.units for c in cs], dtype=torch.int64) if dev_arena else None
        host = torch.tensor([c.host_units for c in cs], dtype=torch.int64) if host_arena else None
        src, dst = [c.src for c in cs], [c.dst for c in cs]
        out[g] = (src, dst, dev, host) if direction == "d2h" else (src, dst, host, dev)
    return out


def copy_pages(src_pools, dst_pools, group: str, src_ids: list[int] | torch.Tensor,
               dst_ids: list[int] | torch.Tensor, layer: int | None = None, *, src_units: torch.Tensor | None = None,
               dst_units: torch.Tensor | None = None) -> None:
    """dst[group][layer?, dst_ids] = src[group][layer?, src_ids] for K and V (all layers if layer is None).

    One index_select + one index_copy_ per pool tensor, over pages flattened to rows (a page-dim
    index on the 5-D tensor takes a slower strided path). With an arena on either side (device, host or
    both), still one per tensor: over both sides' flat views of all the group's layers (`KVPools.flat_kv` /
    `flat_rows`; `src_units` / `dst_units`: an arena side's pages' units, `plan_copies`; None reads that
    side's unit table now)."""
    if len(src_ids) == 0:
        return
    if src_pools.arena is not None or dst_pools.arena is not None:
        layers = range(src_pools.num_layers(group)) if layer is None else range(layer, layer + 1)
        s_rows = src_pools.flat_rows(group, torch.as_tensor(src_ids, dtype=torch.int64),
                                     src_units if src_pools.arena is not None else None, layers).flatten()
        d_rows = dst_pools.flat_rows(group, torch.as_tensor(dst_ids, dtype=torch.int64),
                                     dst_units if dst_pools.arena is not None else None, layers).flatten()
        for s, d in zip(src_pools.flat_kv(group), dst_pools.flat_kv(group), strict=True):
            d.index_copy_(0, d_rows, s.index_select(0, s_rows).to(d.device, non_blocking=True))
        return
    for src_t, dst_t in zip(src_pools.group(group), dst_pools.group(group), strict=True):
        src_idx = torch.as_tensor(src_ids, dtype=torch.int64, device=src_t.device)
        dst_idx = torch.as_tensor(dst_ids, dtype=torch.int64, device=dst_t.device)
        if layer is None:
            src_rows, dst_rows, dim = src_t.flatten(2), dst_t.flatten(2), 1  # [layers, pages, page elems]
        else:
            src_rows, dst_rows, dim = src_t[layer].flatten(1), dst_t[layer].flatten(1), 0  # [pages, page elems]
        moved = src_rows.index_select(dim, src_idx).to(dst_t.device, non_blocking=True)
        dst_rows.index_copy_(dim, dst_idx, moved)


class LoadMode(StrEnum):
    THREAD = "thread"  # a copy thread (CPU) / side stream (CUDA) runs ahead of the compute, layer by layer
    INLINE = "inline"  # layer i's pages are copied right before layer i runs, on the compute thread
    SYNC = "sync"  # everything is copied before the forward starts (one indexed copy per pool tensor)


class CopyWorker:
    """One long-lived copy thread (and, on CUDA, one side stream) per runner: a step's load is a job
    on its queue, so no thread or stream is created per step."""

    def __init__(self, cuda: bool) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.stream = torch.cuda.Stream() if cuda else None
        self._thread = threading.Thread(target=self._run, name="kv-l2-load", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(LOAD_WAIT_TIMEOUT_S)


class LayerwiseLoad:
    """One in-flight host -> device load, copied layer by layer in model layer order."""

    def __init__(self, host, device_pools, slots: list[LayerSlot], copies: Sequence,
                 mode: LoadMode = LoadMode.THREAD, worker: CopyWorker | None = None) -> None:
        groups = plan_copies(copies, "h2d", device_pools, host)
        self._host, self._dev, self._slots, self._mode = host, device_pools, slots, mode
        # Index tensors are built once per group, not once per layer.
        self._index = {g: (torch.tensor(src, dtype=torch.int64, device=host.device),
                           # (an arena side's ids stay on the CPU: its rows are translated there)
                           torch.tensor(dst, dtype=torch.int64,
                                        device=device_pools.device if device_pools.arena is None else "cpu"), su, du)
                       for g, (src, dst, su, du) in groups.items()}
        self._cuda = device_pools.device.type == "cuda"
        self._copied = [slot.group not in self._index for slot in slots]  # inline bookkeeping
        self._error: BaseException | None = None
        self._done: list[threading.Event] = []
        self._cuda_events: list = []
        if mode is LoadMode.SYNC:
            for g, (src, dst, su, du) in self._index.items():
                copy_pages(host, device_pools, g, src, dst, src_units=su, dst_units=du)
            self._copied = [True] * len(slots)
        elif mode is LoadMode.THREAD:
            if worker is None:
                raise ValueError("LayerwiseLoad: thread mode needs the runner's CopyWorker")
            self._done = [threading.Event() for _ in slots]
            self._cuda_events = [torch.cuda.Event() for _ in slots] if self._cuda else []
            self._stream = worker.stream
            worker.submit(self._run)

    def _copy_layer(self, i: int) -> None:
        slot = self._slots[i]
        src, dst, su, du = self._index[slot.group]
        copy_pages(self._host, self._dev, slot.group, src, dst, layer=slot.index, src_units=su, dst_units=du)

    def _run(self) -> None:
        try:
            for i in range(len(self._slots)):
                if self._copied[i]:
                    pass
                elif self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._copy_layer(i)
                        self._cuda_events[i].record(self._stream)
                else:
                    self._copy_layer(i)
                self._done[i].set()
        except BaseException as exc:  # surfaced to the compute side in wait_layer()
            self._error = exc
            for ev in self._done:
                ev.set()

    def wait_layer(self, layer: int) -> None:
        """Block the compute side until layer's pages are on the device (CUDA: stream-ordered)."""
        if self._mode is not LoadMode.THREAD:
            if not self._copied[layer]:
                self._copy_layer(layer)
                self._copied[layer] = True
            return
        if not self._done[layer].wait(LOAD_WAIT_TIMEOUT_S):
            raise TimeoutError(f"L2 load-back of layer {layer} did not finish in {LOAD_WAIT_TIMEOUT_S}s")
        if self._error is not None:
            raise RuntimeError(f"L2 load-back copy thread failed at layer {layer}") from self._error
        if self._cuda and not self._copied[layer]:
            torch.cuda.current_stream().wait_event(self._cuda_events[layer])

    def finish(self) -> None:
        for i in range(len(self._slots)):
            self.wait_layer(i)
