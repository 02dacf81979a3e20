"""A shipment in torch terms: per model layer, the physical pages of a plan's logical pages, their bytes,
the sender's copies and the receiver's destination views; and the engine-thread hook that copies each
streamed segment out of the pools as soon as the prefill has computed it.

Payloads are described by the engine's own `PayloadSpec` (libs/engine does not import libs/transfer).
Services reach an engine's KV through a `KVAccess` (`runner.kv_access()`); the wire always carries every
KV head in a single process's page layout, whatever either side's parallelism. The plain access reads and
writes the engine's own pools in place (zero copy); a parallel engine's is libs/engine/parallel/kvio.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from libs.engine.disagg.plan import StreamPlan, full_kv_pages
from libs.engine.host_tier import LayerSlot, layer_slots
from libs.engine.request import PrefillProgress
from libs.model.paged import KVPools

log = logging.getLogger(__name__)

# One layer's payload: [K pages, V pages], each (pages, page elements), contiguous.
Payload = list[torch.Tensor]


class PageSet(Protocol):
    """Logical pages per layer group (a ShipPlan or one Segment of a StreamPlan)."""

    @property
    def full_pages(self) -> tuple[int, ...]: ...

    @property
    def swa_pages(self) -> tuple[int, ...]: ...


class PayloadSpec(NamedTuple):
    """What one layer payload holds (fields in libs.transfer.LayerSpec's order): pool group, the layer's
    index in that group, page count, torch dtype name and the payload's shape (pages, elements per page)."""

    group: str
    layer_index: int
    page_count: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LayerPages:
    """One model layer's share of a shipment: its pool slot and the physical pages to move."""

    slot: LayerSlot
    pages: tuple[int, ...]


def shipment_layers(layer_is_swa: Sequence[bool], pages: PageSet, full_table: Sequence[int],
                    swa_table: Sequence[int]) -> list[LayerPages]:
    """Per model layer (model order), the physical page ids of `pages`' logical pages in this engine; layers
    with nothing to send are left out.

    Raises ValueError when a page the plan needs is missing (-1), which would mean the engine no longer
    holds the window the plan was computed for."""
    full = [full_table[j] for j in pages.full_pages]
    swa = [swa_table[j] for j in pages.swa_pages]
    if min(full, default=0) < 0 or min(swa, default=0) < 0:
        raise ValueError(f"KV pages missing for the shipment (full {full}, swa {swa})")
    out = []
    for slot in layer_slots(layer_is_swa):
        ids = tuple(full if slot.group == "full" else swa)
        if ids:
            out.append(LayerPages(slot, ids))
    return out


def payload_specs(kv: KVPools, layers: Sequence[LayerPages]) -> list[PayloadSpec]:
    """One PayloadSpec per layer; payload = K pages then V pages, flattened per page."""
    dtype = str(kv.dtype).removeprefix("torch.")
    specs = []
    for lp in layers:
        per_page = kv.layer_page_bytes(lp.slot.group) // kv.dtype.itemsize
        specs.append(PayloadSpec(lp.slot.group, lp.slot.index, len(lp.pages), dtype, (len(lp.pages), per_page)))
    return specs


def stream_specs(kv: KVPools, layer_is_swa: Sequence[bool], plan: StreamPlan) -> list[PayloadSpec]:
    """The transfer header of a streamed shipment: every segment's layer payloads, in send order. Only page
    counts matter here, so the logical pages stand in for physical ones."""
    specs: list[PayloadSpec] = []
    for seg in plan.segments:
        logical = range(plan.ship.num_pages)
        specs += payload_specs(kv, shipment_layers(layer_is_swa, seg, logical, logical))
    return specs


def gather_layer(kv: KVPools, lp: LayerPages, units: torch.Tensor | None = None) -> Payload:
    """Sender payload of one layer: [K pages, V pages] as two contiguous tensors (copies). `units`: an arena's
    units of the pages, given (`KVArena.rows`), for an arena without unit tables."""
    k, v, _ = kv.layer_kv(lp.slot.group, lp.slot.index)
    idx = kv.page_rows(lp.slot.group, lp.slot.index, torch.tensor(lp.pages, dtype=torch.int64), units).to(k.device)
    return [k.index_select(0, idx), v.index_select(0, idx)]


def destination_views(kv: KVPools, lp: LayerPages) -> Payload:
    """Receiver destination of one layer: the pool's own page views (K pages, then V pages), written in
    place, in the same byte order as `gather_layer`."""
    k, v, _ = kv.layer_kv(lp.slot.group, lp.slot.index)
    rows = kv.page_rows(lp.slot.group, lp.slot.index, torch.tensor(lp.pages, dtype=torch.int64)).tolist()
    return [k[r] for r in rows] + [v[r] for r in rows]


def stream_layers(layer_is_swa: Sequence[bool], plan: StreamPlan, full_table: Sequence[int],
                  swa_table: Sequence[int]) -> list[LayerPages]:
    """Every layer payload of a streamed shipment with its physical pages, in header order (`stream_specs`)."""
    return [lp for seg in plan.segments for lp in shipment_layers(layer_is_swa, seg, full_table, swa_table)]


def stream_destinations(kv: KVPools, layer_is_swa: Sequence[bool], plan: StreamPlan, full_table: Sequence[int],
                        swa_table: Sequence[int]) -> list[Payload]:
    """Receiver destinations of a streamed shipment, in header order (`stream_specs`)."""
    return [destination_views(kv, lp) for lp in stream_layers(layer_is_swa, plan, full_table, swa_table)]


# ---------------------------------------------------------------------------------------------- KV access
class Landing:
    """Where one incoming shipment's bytes land: `payloads` (the transfer's destinations, in header order),
    then `land()`, on the engine thread once every layer arrived and before the engine computes over the
    pages. Here the payloads are the pool's own pages, so there is nothing left to do."""

    def __init__(self, payloads: list[Payload]) -> None:
        self.payloads = payloads

    def land(self) -> None:
        """Put the received pages where the engine reads them (engine thread)."""


class KVAccess:
    """The hand-off's access to one engine's KV, every KV head (see the module doc). This one: a single
    process's pools; a parallel engine's runner returns its own (libs/engine/parallel/kvio.py).

    `shapes`: pools with the wire's shapes and dtype (every KV head), for specs and byte counts only."""

    def __init__(self, kv: KVPools) -> None:
        self.kv = kv
        self.shapes = kv

    def gather(self, layers: Sequence[LayerPages]) -> list[Payload]:
        """Sender payloads of `layers` (engine thread, between steps): copies, complete when this returns."""
        payloads = [gather_layer(self.kv, lp) for lp in layers]
        synchronize_copies(self.kv.device)
        return payloads

    def receive(self, layers: Sequence[LayerPages]) -> Landing:
        """Receiver destinations of `layers`: the pool's page views, written in place by the transfer."""
        return Landing([destination_views(self.kv, lp) for lp in layers])


def synchronize_copies(device: torch.device) -> None:
    if device.type == "cuda":  # the copies must be complete before another thread reads them
        torch.cuda.current_stream(device).synchronize()


def shipment_bytes(kv: KVPools, layers: Sequence[LayerPages]) -> int:
    return sum(len(lp.pages) * kv.layer_page_bytes(lp.slot.group) for lp in layers)


def full_transfer_bytes(kv: KVPools, layer_is_swa: Sequence[bool], num_tokens: int) -> int:
    """What shipping every layer's pages for the whole prompt would move (the non-SWA-aware baseline)."""
    pages = full_kv_pages(num_tokens, kv.page_size)
    return sum(pages * kv.layer_page_bytes(s.group) for s in layer_slots(layer_is_swa))


# ---------------------------------------------------------------------------------------------- streaming
class SegmentCollector:
    """Progress hook (`Request.on_progress`) of one streamed prefill: runs on the engine thread after each
    step commits, and copies out every segment whose pages the prefill has now computed.

    Copying on the engine thread, between steps, is what makes the bytes safe: a later preemption (the
    prompt recomputed into other pages), an abort or the reuse of freed pages cannot change a segment
    after its copy. `deliver` (thread-safe, e.g. loop.call_soon_threadsafe) receives one list of payloads
    per segment, in plan order, or the exception that stopped the collection (nothing follows it).
    `kv`: the engine's KVAccess (a KVPools stands for its plain one)."""

    def __init__(self, kv: KVAccess | KVPools, layer_is_swa: Sequence[bool], plan: StreamPlan,
                 deliver: Callable[[list[Payload] | BaseException], None]) -> None:
        self.kv = kv if isinstance(kv, KVAccess) else KVAccess(kv)
        self.layer_is_swa = tuple(layer_is_swa)
        self.plan = plan
        self.deliver = deliver
        self.next = 0  # the first segment not copied yet (only moves forward, also across preemptions)

    @property
    def done(self) -> bool:
        return self.next >= len(self.plan.segments)

    def __call__(self, progress: PrefillProgress) -> None:
        try:
            while not self.done and self.plan.segments[self.next].ready_tokens <= progress.num_computed:
                seg = self.plan.segments[self.next]
                layers = shipment_layers(self.layer_is_swa, seg, progress.full_pages, progress.swa_pages)
                payloads = self.kv.gather(layers)
                self.next += 1
                self.deliver(payloads)
        except Exception as exc:
            log.warning("copying a KV segment out failed", exc_info=True)
            self.next = len(self.plan.segments)
            self.deliver(exc)
