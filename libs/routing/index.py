"""The cluster-wide prefix index (pure): which worker holds which KV blocks, fed by each worker's numbered
`KVEvent`s, and the hit each worker's `KVCache.match` would return for a request's block-hash chain.

Per block hash it keeps 4 bits (`BlockState`) per worker slot, so one walk along the chain answers every
worker; validity is computed with `match`'s rule, so it stays exact when SWA KV is evicted or healed later.
A gap in a worker's event ids marks its view stale (its blocks stop counting, events are buffered) until
`load_snapshot` replaces it and replays them; `sweep` retires stale slots off the hot path. Details:
docs/routing.md, "The prefix index".
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from libs.kvcache.types import EventKind, KVEvent, Tier

_W = 4  # bits per slot
_NIB = 0xF


class BlockState(enum.IntFlag):
    """What one worker holds of one block (bits of a slot's nibble)."""

    DEVICE = 1
    DEVICE_SWA = 2
    HOST = 4
    HOST_SWA = 8


_TIER_BITS = {Tier.DEVICE: (int(BlockState.DEVICE), int(BlockState.DEVICE_SWA)),
              Tier.HOST: (int(BlockState.HOST), int(BlockState.HOST_SWA))}


@dataclass(frozen=True, slots=True)
class PredictedHit:
    """What `KVCache.match(prompt, rebuild=...)` would return on one worker (its `PrefixHit` fields).

    `tokens` is R, what the worker skips; `full_tokens` E >= R the full KV it reuses: a rebuild hit
    (E > R) recomputes [R, E) (`recompute_tokens`) to rebuild the SWA window before E. `host_tokens` of
    [0, E) come from the host tier (copied to device first). `raw_tokens` is the page-aligned overlap of
    cached full KV in any tier, whatever its SWA validity (what an SWA-blind router would credit)."""

    tokens: int = 0
    full_tokens: int = 0
    raw_tokens: int = 0
    host_tokens: int = 0

    @property
    def recompute_tokens(self) -> int:
        return self.full_tokens - self.tokens

    @property
    def device_tokens(self) -> int:
        return self.full_tokens - self.host_tokens


NO_HIT = PredictedHit()


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """A worker's whole cached block set, consistent with its events up to `last_event_id` (-1: none yet):
    block i is `block_hashes[i]` holding `BlockState(states[i])` (one byte per block: compact on the wire)."""

    last_event_id: int
    block_hashes: tuple[int, ...] = ()
    states: bytes = b""

    def __post_init__(self) -> None:
        if len(self.block_hashes) != len(self.states):
            raise ValueError(f"KVSnapshot: {len(self.block_hashes)} hashes but {len(self.states)} states")


@dataclass(slots=True)
class _View:
    slot: int
    next_event: int = 0
    stale: bool = False
    buffer: list[KVEvent] = field(default_factory=list)
    blocks: int = 0


def held_from_flags(flags: Sequence[bool], window_pages: int) -> tuple[bool, ...]:
    """Per block, SWA KV held, inferred from validity flags: a hit ending after block j is valid only when the
    window before it holds SWA KV, so block i holds SWA if a flag j in [i, i + window_pages) is set (true
    at any depth: near the root the window is the whole prefix). Misses SWA that ends no valid window yet."""
    out = [False] * len(flags)
    for j, ok in enumerate(flags):
        if ok:
            for i in range(max(0, j - window_pages + 1), j + 1):
                out[i] = True
    return tuple(out)


class ClusterPrefixIndex:
    """Per-worker cached block sets of a cluster and the hit `KVCache.match` would give on each.

    `page_size`, `window` and `rebuild_tokens` must be the workers' `KVCacheConfig` values (one model, one
    hash chain: the gateway hashes with the same page size and seed). `max_buffered` bounds the events
    kept per stale worker while its snapshot is awaited (past it, a newer snapshot is needed)."""

    def __init__(self, page_size: int, window: int, rebuild_tokens: int = 0, max_buffered: int = 1 << 16) -> None:
        if page_size <= 0 or window <= 0 or rebuild_tokens < 0 or rebuild_tokens % page_size:
            raise ValueError(f"ClusterPrefixIndex: page_size={page_size}, window={window} must be > 0 and "
                             f"rebuild_tokens={rebuild_tokens} a multiple of the page size (0 = off)")
        self.page_size = page_size
        self.window_pages = -(-window // page_size)
        self.rebuild_tokens = rebuild_tokens
        self.max_buffered = max_buffered
        self._blocks: dict[int, int] = {}
        self._views: dict[str, _View] = {}
        self._owner: dict[int, str] = {}  # live slot -> worker
        self._retired: set[int] = set()  # slots whose bits wait for `sweep`
        self._free: list[int] = []
        self._next_slot = 0
        self._ones = 0  # bit 0 of every live, in-sync slot
        self._live = 0  # all 4 bits of every live, in-sync slot

    # ---------------------------------------------------------------- workers and events

    @property
    def workers(self) -> list[str]:
        return list(self._views)

    def is_stale(self, worker: str) -> bool:
        view = self._views.get(worker)
        return view is not None and view.stale

    def next_event_id(self, worker: str) -> int:
        """The event id the worker's view expects next (0 for an unknown worker)."""
        view = self._views.get(worker)
        return 0 if view is None else view.next_event

    def blocks_of(self, worker: str) -> dict[int, int]:
        """The worker's view: block hash -> `BlockState` bits (O(indexed blocks): tests and debugging)."""
        view = self._views.get(worker)
        if view is None:
            return {}
        shift = _W * view.slot
        return {h: n for h, v in self._blocks.items() if (n := (v >> shift) & _NIB)}

    def stale_workers(self) -> list[str]:
        """Workers whose view awaits a snapshot (ask each for one)."""
        return [w for w, v in self._views.items() if v.stale]

    def apply(self, worker: str, events: Iterable[KVEvent]) -> bool:
        """Apply a worker's events in order; False when its view is (or became) stale: an event id was
        skipped. Events older than the view (already in a loaded snapshot) are ignored."""
        view = self._views.get(worker) or self._add(worker)
        for ev in events:
            if view.stale:
                self._buffer(view, ev)
            elif ev.event_id < view.next_event:
                continue
            elif ev.event_id > view.next_event:
                self._go_stale(worker, view)
                self._buffer(view, ev)
            else:
                self._apply_one(view, ev)
                view.next_event += 1
        return not view.stale

    def mark_stale(self, worker: str) -> None:
        """About to ask the worker for a snapshot (it joined, or the router started): its view stops counting
        and buffers the events that arrive meanwhile, so the snapshot and the events after it join without a
        hole (a view kept in sync meanwhile would lose the events between the snapshot's id and its reply)."""
        view = self._views.get(worker) or self._add(worker)
        if not view.stale:
            self._go_stale(worker, view)

    def load_snapshot(self, worker: str, snap: KVSnapshot) -> bool:
        """Replace the worker's view by `snap`, then replay buffered events after it. False when those do not
        continue the snapshot's event id (still stale: ask for a newer snapshot)."""
        old = self._views.pop(worker, None)
        if old is not None:
            self._retire(worker, old)
        view = self._add(worker)
        view.next_event = snap.last_event_id + 1
        shift = _W * view.slot
        blocks = self._blocks
        for h, st in zip(snap.block_hashes, snap.states, strict=True):
            if st & _NIB:
                blocks[h] = blocks.get(h, 0) | (st & _NIB) << shift
                view.blocks += 1
        pending = old.buffer if old is not None else []
        return self.apply(worker, pending)

    def remove_worker(self, worker: str) -> None:
        """The worker left the registry: its blocks stop counting now (bits cleared by `sweep`)."""
        view = self._views.pop(worker, None)
        if view is not None:
            self._retire(worker, view)

    def sweep(self) -> int:
        """Clear the bits of retired slots (stale views replaced, workers removed) and free the slots; returns
        the entries touched. O(indexed blocks): call it off the request path (`needs_sweep`), or in slices
        (`sweep_steps`)."""
        return max(self.sweep_steps(max(1, len(self._blocks))), default=0)  # the counts only grow

    def sweep_steps(self, batch: int = 1 << 16) -> Iterator[int]:
        """`sweep` in slices of `batch` blocks, yielding the entries touched so far after each, so that a
        caller can give its event loop back in between (a 1M-block sweep is about a second of Python).
        Between slices the index stays right: reads mask the retired slots out (`_live`), retired slots get
        no new bits, and they are reused only when the last slice is done. Slots retired meanwhile wait for the
        next sweep."""
        if not self._retired:
            return
        retired = set(self._retired)
        mask = 0
        for s in retired:
            mask |= _NIB << (_W * s)
        keep = ~mask
        touched = 0
        blocks = self._blocks
        keys = list(blocks)
        for start in range(0, len(keys), batch):
            for h in keys[start:start + batch]:
                v = blocks.get(h)
                if v is None or not v & mask:
                    continue  # gone meanwhile, or no retired bit
                touched += 1
                v &= keep
                if v:
                    blocks[h] = v
                else:
                    del blocks[h]
            yield touched
        self._free.extend(sorted(retired))
        self._retired -= retired
        yield touched

    @property
    def needs_sweep(self) -> bool:
        """Retired slots hold bits: as many as live workers (each widens every packed int) is the bar."""
        return len(self._retired) >= max(1, len(self._views))

    def _add(self, worker: str) -> _View:
        slot = self._free.pop(0) if self._free else self._next_slot
        if slot == self._next_slot:
            self._next_slot += 1
        view = self._views[worker] = _View(slot)
        self._owner[slot] = worker
        self._ones |= 1 << (_W * slot)
        self._live |= _NIB << (_W * slot)
        return view

    def _retire(self, worker: str, view: _View) -> None:
        self._owner.pop(view.slot, None)
        self._ones &= ~(1 << (_W * view.slot))
        self._live &= ~(_NIB << (_W * view.slot))
        self._retired.add(view.slot)

    def _go_stale(self, worker: str, view: _View) -> None:
        """A gap: the view no longer counts (reads mask the slot out) until a snapshot replaces it."""
        view.stale = True
        self._ones &= ~(1 << (_W * view.slot))
        self._live &= ~(_NIB << (_W * view.slot))

    def _buffer(self, view: _View, ev: KVEvent) -> None:
        if len(view.buffer) < self.max_buffered:
            view.buffer.append(ev)

    def _apply_one(self, view: _View, ev: KVEvent) -> None:
        base, swa = _TIER_BITS[ev.tier]
        shift = _W * view.slot
        blocks = self._blocks
        if ev.kind is EventKind.STORED:
            held: Sequence[bool] = getattr(ev, "swa_held", ()) or held_from_flags(ev.swa_checkpoint,
                                                                                 self.window_pages)
            sets = [base | swa if k else base for k in held] if held else [base] * len(ev.block_hashes)
            clear = swa
        else:
            sets = None
            clear = base | swa if ev.kind is EventKind.REMOVED else swa
        for i, h in enumerate(ev.block_hashes):
            v = blocks.get(h, 0)
            nib = (v >> shift) & _NIB
            new = nib & ~clear | (sets[i] if sets is not None else 0)
            if new == nib:
                continue
            v += (new - nib) << shift
            if v:
                blocks[h] = v
            else:
                del blocks[h]
            view.blocks += (new != 0) - (nib != 0)

    # ---------------------------------------------------------------- the prediction

    def predict(self, block_hashes: Sequence[int], num_tokens: int, rebuild: bool = True) -> dict[str, PredictedHit]:
        """Per worker with any overlap, the hit its `KVCache.match(prompt, rebuild=rebuild)` returns (workers
        absent: no overlap; stale workers count as empty). Exact while the worker has room to lock and load
        the hit; when it has not, `match` falls back along `candidates`."""
        return {w: c[0] for w, c in self.candidates(block_hashes, num_tokens, rebuild).items()}

    def predict_both(self, block_hashes: Sequence[int], num_tokens: int
                     ) -> tuple[dict[str, PredictedHit], dict[str, PredictedHit]]:
        """(`predict(..., rebuild=True)`, `predict(..., rebuild=False)`) from one walk of the chain: the
        disaggregated route needs both (prefill may take a rebuild hit, decode never does)."""
        walked = self._walk(block_hashes, num_tokens)

        def first(rebuild: bool) -> dict[str, PredictedHit]:
            return {self._owner[s]: self._choices(*v, num_tokens, rebuild)[0] for s, v in walked.items()}
        return first(True), first(False)

    def candidates(self, block_hashes: Sequence[int], num_tokens: int,
                   rebuild: bool = True) -> dict[str, list[PredictedHit]]:
        """Per worker, the hits `match` tries in order (rebuild at the full match's end, at the device part's
        end, best valid counting host, best valid on device, none): it returns the first it can lock (and
        load) within the memory no running sequence was promised."""
        out = {}
        for slot, (raw, dev, best_any, best_dev) in self._walk(block_hashes, num_tokens).items():
            out[self._owner[slot]] = self._choices(raw, dev, best_any, best_dev, num_tokens, rebuild)
        return out

    def _walk(self, chain: Sequence[int], num_tokens: int) -> dict[int, tuple[int, int, int, int]]:
        """Per slot with overlap: (raw pages, on-device pages, best valid page count, best valid on device).
        The hot loop of a routing decision: one dict lookup and a dozen big-int operations per page."""
        P, wp = self.page_size, self.window_pages
        max_raw = 0 if num_tokens <= P else min(len(chain), num_tokens // P)
        max_pages = min(max_raw, (num_tokens - 1) // P)
        blocks, live = self._blocks, self._live
        in_tree = dev_run = self._ones
        runs = [in_tree] + [0] * wp  # runs[k]: slots whose last k pages all hold SWA (runs[0]: every slot)
        raw_drops: list[tuple[int, int]] = []
        dev_drops: list[tuple[int, int]] = []
        valid: list[int] = [0]  # valid[g]: slots for which a hit of g pages is valid
        get = blocks.get
        g = 0
        while g < max_raw:
            v = get(chain[g], 0) & live
            here = (v | v >> 2) & in_tree
            if here != in_tree:
                raw_drops.append((g, in_tree ^ here))
                in_tree = here
                if not here:
                    break
            dev = v & in_tree
            if dev_run & dev != dev_run:
                dev_drops.append((g, dev_run ^ (dev_run & dev)))
                dev_run &= dev
            eff = (v >> 1 & dev) | (v >> 3 & (in_tree ^ dev))
            if wp == 2:  # the common shape (window = 2 pages): no inner loop
                runs[2] = runs[1] & eff
                runs[1] = eff
            else:
                for k in range(wp, 0, -1):
                    runs[k] = runs[k - 1] & eff
            g += 1
            if g <= max_pages:
                valid.append(runs[g if g < wp else wp])
        raw_drops.append((g, in_tree))
        dev_drops.append((g, dev_run))
        raw = _ends(raw_drops)
        on_dev = _ends(dev_drops)
        best_any = _last_set(valid, raw.keys())
        out = {}
        for s, r in raw.items():
            if r:
                d, b = on_dev.get(s, 0), best_any.get(s, 0)
                # device nodes form a root-connected prefix: the best device hit is the best valid g <= d
                out[s] = (r, d, b, b if b <= d else _last_set(valid[:d + 1], (s,)).get(s, 0))
        return out

    def _choices(self, raw: int, dev: int, best_any: int, best_dev: int, num_tokens: int,
                 rebuild: bool) -> list[PredictedHit]:
        """`match`'s order of hits (pages in, tokens out); the host part of a hit is its pages past `dev`."""
        P, S = self.page_size, self.rebuild_tokens
        max_pages = (num_tokens - 1) // P
        raw_t = raw * P
        out = []
        if rebuild and S:
            for end in dict.fromkeys((min(raw, max_pages), min(dev, max_pages))):
                if end * P - S > best_any * P:
                    out.append(PredictedHit(end * P - S, end * P, raw_t, (end - min(end, dev)) * P))
        if best_any > best_dev:
            out.append(PredictedHit(best_any * P, best_any * P, raw_t, (best_any - dev) * P))
        if best_dev:
            out.append(PredictedHit(best_dev * P, best_dev * P, raw_t, 0))
        out.append(PredictedHit(0, 0, raw_t, 0))
        return out

    # ---------------------------------------------------------------- size

    def __len__(self) -> int:
        """Distinct block hashes indexed (any worker, any tier)."""
        return len(self._blocks)

    def entries(self) -> int:
        """(worker, block) pairs indexed, live and in-sync workers only."""
        return sum(v.blocks for v in self._views.values() if not v.stale)

    def memory_bytes(self) -> int:
        """Bytes the index holds: the dict's table plus its key and value ints (small cached ints excluded;
        O(blocks): for measurements, not the request path)."""
        total = sys.getsizeof(self._blocks)
        for h, v in self._blocks.items():
            total += sys.getsizeof(h) + (sys.getsizeof(v) if v > 256 else 0)
        return total


def _ends(drops: list[tuple[int, int]]) -> dict[int, int]:
    """Slot -> the page count at which its bit left the running mask (each slot leaves once)."""
    out: dict[int, int] = {}
    for g, mask in drops:
        for s in _slots(mask):
            out.setdefault(s, g)
    return out


def _last_set(masks: list[int], slots: Iterable[int]) -> dict[int, int]:
    """Slot -> the highest g with its bit set in masks[g] (absent: none), scanning down from the top."""
    todo = 0
    for s in slots:
        todo |= 1 << (_W * s)
    out: dict[int, int] = {}
    g = len(masks) - 1
    while todo and g > 0:
        hit = masks[g] & todo
        if hit:
            for s in _slots(hit):
                out[s] = g
            todo ^= hit
        g -= 1
    return out


def _slots(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append((low.bit_length() - 1) // _W)
        mask ^= low
    return out
