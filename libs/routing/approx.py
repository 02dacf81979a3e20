"""The approximate prefix index (pure): without KV events (`WINDSERVE_KV_EVENTS=0`) a router predicts hits from
its own decisions: the block-hash chains it routed to each worker in the last `ttl_s` seconds.

A worker that ran a prompt holds (for a while) the KV of its pages, so a later request sharing a prefix of
that chain is predicted to hit the longest routed prefix: page aligned, capped like `KVCache.match` (at least
one token is left to compute). Nothing here knows evictions or SWA validity: the prediction is an upper bound
the TTL keeps plausible, and the workers' hit reports (`KVHitReport`) show how far off it is. Same `predict`
call as `ClusterPrefixIndex`, so `AffinityRouter`'s cost uses either.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from libs.routing.index import PredictedHit


class ApproxIndex:
    """Per worker, the block hashes routed there, each with its expiry (unix time).

    A chain is recorded whole with one expiry, so a block's ancestors never expire before it; predictions walk
    the chain from its root and stop at a worker's first missing block (a hash chain: block i stands for the
    whole prefix up to it). At most `max_entries` (worker, block) entries are kept: past it the oldest go first.
    Call `expire(now)` before `predict` (amortised O(1) per recorded entry)."""

    def __init__(self, page_size: int, ttl_s: float = 120.0, max_entries: int = 1 << 20) -> None:
        if page_size <= 0 or ttl_s <= 0 or max_entries <= 0:
            raise ValueError(f"ApproxIndex: page_size={page_size}, ttl_s={ttl_s}, max_entries={max_entries} "
                             "must be > 0")
        self._page_size = page_size
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._blocks: dict[int, dict[str, float]] = {}  # block hash -> {worker: expiry}
        self._order: deque[tuple[float, int, str]] = deque()  # (expiry, hash, worker) in recording order
        self._entries = 0

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def workers(self) -> list[str]:
        return sorted({w for held in self._blocks.values() for w in held})

    def __len__(self) -> int:
        """Distinct block hashes held for any worker."""
        return len(self._blocks)

    def entries(self) -> int:
        """(worker, block) entries held."""
        return self._entries

    def record(self, worker: str, block_hashes: Sequence[int], now: float) -> None:
        """`worker` was sent a prompt with this chain at `now`: it holds these blocks until `now + ttl_s`."""
        expiry = now + self.ttl_s
        for h in block_hashes:
            held = self._blocks.setdefault(h, {})
            if worker not in held:
                self._entries += 1
            held[worker] = expiry
            self._order.append((expiry, h, worker))
        while self._entries > self.max_entries:
            self._pop_oldest()
        if len(self._order) > 4 * self.max_entries:  # superseded entries piled up (re-recorded chains): compact
            self._order = deque(sorted((e, h, w) for h, held in self._blocks.items() for w, e in held.items()))

    def expire(self, now: float) -> None:
        """Forget entries whose expiry has passed."""
        while self._order and self._order[0][0] <= now:
            self._pop_oldest()

    def remove_worker(self, worker: str) -> None:
        """The worker left: it holds nothing (O(blocks); its entries in the expiry queue lapse on their own)."""
        for h in [h for h, held in self._blocks.items() if worker in held]:
            self._drop(h, worker)

    def predict_both(self, block_hashes: Sequence[int], num_tokens: int
                     ) -> tuple[dict[str, PredictedHit], dict[str, PredictedHit]]:
        """`predict` with and without rebuild hits (the same here: this index predicts no rebuild hits)."""
        hits = self.predict(block_hashes, num_tokens)
        return hits, hits

    def predict(self, block_hashes: Sequence[int], num_tokens: int, rebuild: bool = True) -> dict[str, PredictedHit]:
        """Per worker with a routed prefix of the chain: that prefix, capped like `match` (`rebuild` unused)."""
        P = self._page_size
        max_raw = min(len(block_hashes), num_tokens // P)
        max_pages = min(max_raw, (num_tokens - 1) // P) if num_tokens > 0 else 0
        out: dict[str, PredictedHit] = {}
        live: set[str] = set()
        g = 0
        while g < max_raw:
            held = self._blocks.get(block_hashes[g])
            here = set(held) if held else set()
            if g == 0:
                live = here
            else:
                for w in live - here:
                    out[w] = _hit(g, max_pages, P)
                live &= here
            if not live:
                break
            g += 1
        for w in live:
            out[w] = _hit(g, max_pages, P)
        return out

    def _pop_oldest(self) -> None:
        expiry, h, worker = self._order.popleft()
        held = self._blocks.get(h)
        if held is not None and held.get(worker) == expiry:  # else re-recorded later: a newer entry stands
            self._drop(h, worker)

    def _drop(self, h: int, worker: str) -> None:
        held = self._blocks[h]
        del held[worker]
        self._entries -= 1
        if not held:
            del self._blocks[h]


def _hit(pages: int, max_pages: int, page_size: int) -> PredictedHit:
    tokens = min(pages, max_pages) * page_size
    return PredictedHit(tokens, tokens, pages * page_size, 0)
