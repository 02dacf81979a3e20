"""Recent picks (this router's and its replicas'), counted on top of the registry load (pure: the caller
passes the time)."""

from __future__ import annotations

from collections.abc import Mapping


class RecentPicks:
    """Picks made in the last `window_s` seconds, per instance (unix time): this router's own, and those its
    replicas shared (`add` with their time and request id).

    Registry load is refreshed every heartbeat, so a burst of requests between two refreshes would all see
    the same "least loaded" worker; counting recent picks on top of the advertised load spreads the burst.
    Several router replicas share their picks (`RoutePick`), so a burst split over them spreads too. A pick
    made before the instance's load snapshot is already in that load and is not counted again: counting it
    twice made a worker whose load had just been refreshed look busier than one whose load had not, and sent
    a burst to the stale one.

    A pick names its request: a later pick of the same request on the same instance replaces it (a replica
    asked the same request again, or a retry), and `counts(skip_request=...)` leaves the request's own earlier
    picks out (a request is no load against itself), so every replica computes the same costs for it."""

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"RecentPicks.window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._picks: dict[str, list[tuple[float, int, str]]] = {}  # instance -> [(time, weight, request id)]

    def add(self, instance_id: str, now: float, weight: int = 1, request_id: str = "") -> None:
        """One pick at `now`; `weight` > 1 counts it as that much work (e.g. its prefill tokens)."""
        picks = self._picks.setdefault(instance_id, [])
        if request_id:
            picks[:] = [p for p in picks if p[2] != request_id]
        picks.append((now, weight, request_id))

    def counts(self, now: float, reflected: Mapping[str, float] | None = None,
               skip_request: str = "") -> dict[str, int]:
        """Picks (their weights summed) per instance in the last window_s seconds, leaving out those made before
        `reflected[id]` (the time of the instance's load snapshot, which already counts them) and those of
        `skip_request`. Forgets older picks."""
        cutoff = now - self.window_s
        reflected = reflected or {}
        for iid in list(self._picks):
            kept = [p for p in self._picks[iid] if p[0] > cutoff]
            if kept:
                self._picks[iid] = kept
            else:
                del self._picks[iid]
        return {iid: n for iid, ts in self._picks.items()
                if (n := sum(w for t, w, r in ts if t > reflected.get(iid, cutoff) and not (r and r == skip_request)))}
