"""This router's own recent picks, counted on top of the registry load (pure: the caller passes the time)."""

from __future__ import annotations

from collections.abc import Mapping


class RecentPicks:
    """Picks this router made in the last `window_s` seconds, per instance (unix time).

    Registry load is refreshed every heartbeat, so a burst of requests between two refreshes would all see
    the same "least loaded" worker; counting our own recent picks on top of the advertised load spreads
    the burst (the pitfall of several routers choosing the same best worker from stale load is reduced,
    not removed: each router only knows its own picks). A pick made before the instance's load snapshot
    is already in that load and is not counted again: counting it twice made a worker whose load had just
    been refreshed look busier than one whose load had not, and sent a burst to the stale one."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"RecentPicks.window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._picks: dict[str, list[tuple[float, int]]] = {}

    def add(self, instance_id: str, now: float, weight: int = 1) -> None:
        """One pick at `now`; `weight` > 1 counts it as that much work (e.g. its prefill tokens)."""
        self._picks.setdefault(instance_id, []).append((now, weight))

    def counts(self, now: float, reflected: Mapping[str, float] | None = None) -> dict[str, int]:
        """Picks (their weights summed) per instance in the last window_s seconds, leaving out those made before
        `reflected[id]` (the time of the instance's load snapshot, which already counts them). Forgets older
        picks."""
        cutoff = now - self.window_s
        reflected = reflected or {}
        for iid in list(self._picks):
            kept = [p for p in self._picks[iid] if p[0] > cutoff]
            if kept:
                self._picks[iid] = kept
            else:
                del self._picks[iid]
        return {iid: n for iid, ts in self._picks.items()
                if (n := sum(w for t, w in ts if t > reflected.get(iid, cutoff)))}
