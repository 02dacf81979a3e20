"""The KV hand-off of a parallel engine (docs/parallel.md): a shipment's pages with every KV head, although each
rank process holds only its own heads (tp), or a replica of all of them (ep alone).

The wire keeps a single process's layout, so prefill and decode may run different tp. `ShardedKV.gather`
collects each head slice once, from its lowest owning rank, onto rank 0; `ShardedKV.receive` lands pages in
full-head staging tensors that `Staged.land()` scatters to the ranks before any step reads them. Both run on
the engine thread between steps (never meeting a step's all-reduce), bounded by the group's timeout, counted
in `CommStats`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from libs.engine.disagg.shipment import (
    KVAccess,
    Landing,
    LayerPages,
    Payload,
    gather_layer,
    synchronize_copies,
)
from libs.engine.gcache_tier import StagedValues, write_host_blocks
from libs.engine.host_tier import LayerSlot
from libs.engine.parallel.comm import Comm
from libs.engine.parallel.layout import ParallelLayout
from libs.model.config import ModelConfig
from libs.model.paged import KVPools

# One layer payload in a control message: (pool group, layer index in the group, page ids, their units). With an
# arena the units are rank 0's unit-table rows of those pages ([pages][units per page]): the other ranks hold no
# tables, only arenas of the same units (libs/engine/parallel/runner.py `rank_sizes`); () with the static pools.
LayerRef = tuple[str, int, tuple[int, ...], tuple[tuple[int, ...], ...]]

GATHER, SCATTER = "kv_gather", "kv_scatter"  # the control ops (libs/engine/parallel/rank.py)
HOST_WRITE = "kv_host_write"  # an L3 import into the host tier: (op, full page ids, SWA page ids, their units)


def head_owners(layout: ParallelLayout, cfg: ModelConfig, swa: bool) -> list[tuple[int, range]]:
    """(rank, its KV heads) of the ranks whose slices, in this order, hold every KV head of a pool exactly once."""
    owners: list[tuple[int, range]] = []
    for rank in range(layout.world):
        heads = layout.kv_heads(cfg, rank, swa)
        if all(heads != h for _, h in owners):
            owners.append((rank, heads))
    return owners


def owners(layout: ParallelLayout, cfg: ModelConfig, group: str) -> list[int]:
    """The ranks `head_owners` names for pool `group` ("full" / "swa")."""
    return [r for r, _ in head_owners(layout, cfg, group == "swa")]


def refs(layers: Sequence[LayerPages], kv: KVPools | None) -> list[LayerRef]:
    """The layers' control-message refs, with the pages' units as `kv`'s (rank 0's) unit tables hold them now
    (None: no units yet)."""
    return [(lp.slot.group, lp.slot.index, tuple(lp.pages), () if kv is None else page_units(kv, lp.slot.group,
                                                                                              lp.pages))
            for lp in layers]


def page_units(kv: KVPools, group: str, pages: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The units pages `pages` of `group` hold in `kv`'s arena (its unit tables), () for the static pools."""
    if kv.arena is None:
        return ()
    table = kv.arena.tables[group]
    return tuple(tuple(row) for row in table[torch.tensor(list(pages), dtype=torch.int64)].tolist())


def _units(units: Sequence[Sequence[int]]) -> torch.Tensor | None:
    return torch.tensor(units, dtype=torch.int64) if len(units) else None


def layer_shapes(kv: KVPools, ref: LayerRef, heads: int | None = None) -> list[torch.Size]:
    """[K, V] shapes of a layer's pages in `kv`'s pools ([pages, page_size, heads, dim]); `heads`: that many
    instead of the pools' own."""
    group, index, pages, _ = ref
    out = []
    for t in kv.layer_kv(group, index)[:2]:
        h = t.shape[2] if heads is None else heads
        out.append(torch.Size((len(pages), t.shape[1], h, t.shape[3])))
    return out


class RankKV:
    """One rank's end: reads and writes its own pools' head slice (the pools hold exactly its heads)."""

    def __init__(self, kv: KVPools, layout: ParallelLayout, cfg: ModelConfig, rank: int, comm: Comm,
                 host: KVPools | None = None) -> None:
        self.kv, self.comm, self.rank, self.host = kv, comm, rank, host
        self.owns = {group: rank in owners(layout, cfg, group) for group in ("full", "swa")}

    def read(self, ref: LayerRef) -> Payload:
        """This rank's [K, V] of a layer's pages ([pages, page_size, its heads, dim] each, copies)."""
        group, index, pages, units = ref
        return gather_layer(self.kv, LayerPages(LayerSlot(group, index), pages), _units(units))

    def write(self, ref: LayerRef, k: torch.Tensor, v: torch.Tensor) -> None:
        """Into this rank's pools at a layer's pages (an arena's rows from the units in the ref: this rank may hold
        no unit tables)."""
        group, index, pages, units = ref
        pool_k, pool_v, _ = self.kv.layer_kv(group, index)
        rows = self.kv.page_rows(group, index, torch.tensor(pages, dtype=torch.int64), _units(units)).to(pool_k.device)
        pool_k.index_copy_(0, rows, k.to(pool_k.device))
        pool_v.index_copy_(0, rows, v.to(pool_v.device))

    # ------------------------------------------------------------------ the ops (worker ranks)
    def send_slices(self, layers: Sequence[LayerRef]) -> None:
        """GATHER: this rank's slices of the layers of the pools it owns heads of, as one message to rank 0."""
        parts = [t.reshape(-1) for ref in layers if self.owns[ref[0]] for t in self.read(ref)]
        if parts:
            self.comm.send(torch.cat(parts), 0)

    def receive_slices(self, layers: Sequence[LayerRef]) -> None:
        """SCATTER: this rank's slices of every layer, one message from rank 0, into its pools."""
        shapes = [s for ref in layers for s in layer_shapes(self.kv, ref)]
        buf = self.comm.recv(_empty(self.kv, shapes), 0)
        parts = iter(_split(buf, shapes))
        for ref in layers:
            self.write(ref, next(parts), next(parts))


    def receive_host(self, full_ids: Sequence[int], swa_ids: Sequence[int],
                     units: tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]] = ((), ())) -> None:
        """HOST_WRITE: this rank's head slice of imported L3 values, one message from rank 0, into its host tier
        (`units`: a host arena's units of the full and the SWA pages, from rank 0's tables)."""
        assert self.host is not None, "an L3 import needs the host tier"
        shapes = host_value_shapes(self.host, len(full_ids), len(swa_ids))
        if not sum(s.numel() for s in shapes):
            return
        parts = _split(self.comm.recv(_empty(self.host, shapes), 0), shapes)
        write_host_blocks(self.host, full_ids, swa_ids, StagedValues(*parts),
                          units={"full": _units(units[0]), "swa": _units(units[1])})


def host_value_shapes(host: KVPools, n_full: int, n_swa: int) -> list[torch.Size]:
    """Shapes of the staged L3 values (StagedValues: full K, V; SWA K, V) of `n_full` / `n_swa` pages in `host`'s
    layout ([layers, pages, page size, heads, dim])."""
    out = []
    for t, n in ((host.full_k, n_full), (host.full_v, n_full), (host.swa_k, n_swa), (host.swa_v, n_swa)):
        out.append(torch.Size((t.shape[0], n, *t.shape[2:])))
    return out


def _empty(kv: KVPools, shapes: Sequence[torch.Size]) -> torch.Tensor:
    """One flat tensor of `kv`'s dtype and device with room for tensors of `shapes`, back to back."""
    return torch.empty(sum(s.numel() for s in shapes), dtype=kv.full_k.dtype, device=kv.full_k.device)


def _split(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, at = [], 0
    for s in shapes:
        out.append(flat[at: at + s.numel()].view(s))
        at += s.numel()
    return out


class ShardedKV(KVAccess):
    """Rank 0's KVAccess of a parallel engine: `kv` its own pools, `cfg` the whole model's config; `send`
    broadcasts a control message to the other ranks, `alive` raises when one is gone."""

    def __init__(self, kv: KVPools, layout: ParallelLayout, cfg: ModelConfig, comm: Comm,
                 send: Callable[[tuple], None], alive: Callable[[], None]) -> None:
        super().__init__(kv)
        self.layout, self.cfg, self.comm = layout, cfg, comm
        self._send, self._alive = send, alive
        self.own = RankKV(kv, layout, cfg, 0, comm)
        self.owners = {group: owners(layout, cfg, group) for group in ("full", "swa")}
        # the wire's shapes: every KV head (meta tensors: no memory)
        self.shapes = KVPools.allocate(cfg, kv.full_k.shape[1], kv.swa_k.shape[1], kv.page_size, kv.full_k.dtype,
                                       "meta", n_full_layers=kv.full_k.shape[0], n_swa_layers=kv.swa_k.shape[0])

    def empty(self, shapes: Sequence[torch.Size]) -> torch.Tensor:
        return _empty(self.kv, shapes)

    def _heads(self, rank: int, group: str) -> range:
        return self.layout.kv_heads(self.cfg, rank, group == "swa")

    # ------------------------------------------------------------------ sender
    def gather(self, layers: Sequence[LayerPages]) -> list[Payload]:
        layer_refs = refs(layers, self.kv)
        if any(r != 0 for ref in layer_refs for r in self.owners[ref[0]]):  # (ep alone: rank 0 holds every head)
            self._send((GATHER, layer_refs))
        slices: list[list[Payload]] = [[] for _ in layer_refs]  # per layer, the owners' [K, V] in head order
        with _rank_failures("gathering KV heads", self._alive):
            for rank in range(self.layout.world):
                mine = [i for i, ref in enumerate(layer_refs) if rank in self.owners[ref[0]]]
                if not mine:
                    continue
                if rank == 0:
                    got = [self.own.read(layer_refs[i]) for i in mine]
                else:
                    got = self._receive(rank, [(i, layer_refs[i]) for i in mine])
                for i, pair in zip(mine, got, strict=True):
                    slices[i].append(pair)
        payloads = [[torch.cat([s[0] for s in per], dim=2), torch.cat([s[1] for s in per], dim=2)]
                    if len(per) > 1 else per[0] for per in slices]
        synchronize_copies(self.kv.full_k.device)
        return payloads

    def _receive(self, rank: int, layers: list[tuple[int, LayerRef]]) -> list[Payload]:
        shapes = [s for _, ref in layers for s in layer_shapes(self.shapes, ref, len(self._heads(rank, ref[0])))]
        buf = self.comm.recv(self.empty(shapes), rank)
        parts = _split(buf, shapes)
        return [parts[j: j + 2] for j in range(0, len(parts), 2)]

    def gather_group(self, group: str, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer of one pool group at `pages`, every KV head, page-major ([pages, layers, page size, heads,
        dim], as `KVPools.gather_pages`): what the L3 write-back copies out."""
        n = (self.kv.full_k if group == "full" else self.kv.swa_k).shape[0]
        payloads = self.gather([LayerPages(LayerSlot(group, i), tuple(pages)) for i in range(n)])
        return torch.stack([p[0] for p in payloads], 1), torch.stack([p[1] for p in payloads], 1)

    def write_host(self, host: KVPools, full_ids: Sequence[int], swa_ids: Sequence[int],
                   staged: StagedValues, skip: int = 0) -> None:
        """An L3 import (every KV head, `staged` as libs/engine/gcache_tier.stage_values lays it out) into every
        rank's host tier, each its own heads (replicas included)."""
        values = (staged.full_k[:, skip:], staged.full_v[:, skip:], staged.swa_k, staged.swa_v)
        groups = ("full", "full", "swa", "swa")

        def mine(rank: int) -> list[torch.Tensor]:
            out = []
            for t, group in zip(values, groups, strict=True):
                h = self._heads(rank, group)
                out.append(t[:, :, :, h.start:h.stop])
            return out

        units = (page_units(host, "full", full_ids), page_units(host, "swa", swa_ids))
        self._send((HOST_WRITE, tuple(full_ids), tuple(swa_ids), units))
        if sum(t.numel() for t in values):
            with _rank_failures("scattering L3 values", self._alive):
                for rank in range(1, self.layout.world):
                    self.comm.send(torch.cat([t.reshape(-1) for t in mine(rank)]).to(self.kv.full_k.dtype), rank)
        write_host_blocks(host, full_ids, swa_ids, StagedValues(*(t.contiguous() for t in mine(0))))

    # ------------------------------------------------------------------ receiver
    def receive(self, layers: Sequence[LayerPages]) -> Staged:
        return Staged(self, refs(layers, None))  # (the units are read when it lands: `scatter`)

    def scatter(self, layer_refs: list[LayerRef], full: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every rank's head slice of the full-head [K, V] of each layer into its pools (engine thread)."""
        if not layer_refs:
            return
        # (the pages' units as they are now, when the shipment lands: they stay reserved for it until then)
        layer_refs = [(g, i, pages, page_units(self.kv, g, pages)) for g, i, pages, _ in layer_refs]
        self._send((SCATTER, layer_refs))
        with _rank_failures("scattering KV heads", self._alive):
            for rank in range(1, self.layout.world):
                parts = [t.reshape(-1) for ref, kv in zip(layer_refs, full, strict=True)
                         for t in self._slice(kv, rank, ref[0])]
                self.comm.send(torch.cat(parts), rank)
            for ref, kv in zip(layer_refs, full, strict=True):
                self.own.write(ref, *self._slice(kv, 0, ref[0]))

    def _slice(self, kv: tuple[torch.Tensor, torch.Tensor], rank: int, group: str) -> list[torch.Tensor]:
        """`rank`'s heads of a full-head [K, V] (views)."""
        h = self._heads(rank, group)
        return [t[:, :, h.start:h.stop] for t in kv]


class Staged(Landing):
    """An incoming shipment of a parallel engine: full-head staging tensors, scattered to the ranks by `land()`."""

    def __init__(self, access: ShardedKV, layer_refs: list[LayerRef]) -> None:
        self.access, self.refs = access, layer_refs
        self.full: list[tuple[torch.Tensor, torch.Tensor]] = []
        payloads: list[Payload] = []
        for ref in layer_refs:
            shapes = layer_shapes(access.shapes, ref)
            flat = access.empty(shapes)
            k, v = _split(flat, shapes)
            self.full.append((k, v))
            payloads.append([flat])  # one contiguous tensor: the transfer lands into it directly
        super().__init__(payloads)

    def land(self) -> None:
        self.access.scatter(self.refs, self.full)


@contextmanager
def _rank_failures(what: str, alive: Callable[[], None]) -> Iterator[None]:
    """A failed send / recv: RankDied naming the rank when one is gone (`alive` raises it), else the error."""
    try:
        yield
    except RuntimeError as exc:
        alive()
        raise RuntimeError(f"{what} over the parallel engine's group failed: {exc}") from exc
