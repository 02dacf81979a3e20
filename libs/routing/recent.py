"""Recent picks (this router's and its replicas'), counted on top of the registry load (pure: the caller
passes the time)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from libs.routing.instance import Instance

_MAX_INSTANCES = 4096  # arrivals remembered past this many instances: only those in view or with picks


@dataclass(frozen=True)
class Reflected:
    """What an instance's latest load snapshot covers: its time (unix) and, when the instance reports it, how many
    requests it had taken on since it started (`arrivals`, monotonic; None = not reported)."""

    at: float
    arrivals: int | None = None


@dataclass
class _Pick:
    at: float
    weight: int
    request_id: str
    target: int | None  # the instance's arrivals count that includes this pick (None: not known at pick time)


class RecentPicks:
    """Picks made in the last `window_s` seconds, per instance (unix time): this router's own, and those its
    replicas shared (`add` with their time and request id), counted on top of the registry load so a burst
    between two heartbeats spreads.

    `counts` leaves out the picks an instance's latest load snapshot already covers: those within its
    reported `arrivals` count, or, where it reports none, those made before the snapshot. A pick counts until
    the window ends unless covered or dropped (`drop`: the request went elsewhere). A later pick of the same
    request on the same instance replaces the earlier one, and `counts(skip_request=...)` leaves a request's
    own picks out, so every replica computes the same costs for it. Rationale: docs/routing.md, "The choice".
    """

    def __init__(self, window_s: float = 2.0) -> None:
        if window_s <= 0:
            raise ValueError(f"RecentPicks.window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._picks: dict[str, list[_Pick]] = {}
        self._arrivals: dict[str, int] = {}  # instance -> arrivals of its latest snapshot seen by `counts`

    def add(self, instance_id: str, now: float, weight: int = 1, request_id: str = "") -> None:
        """One pick at `now`; `weight` > 1 counts it as that much work (e.g. its prefill tokens)."""
        picks = self._picks.setdefault(instance_id, [])
        replaced = next((p for p in picks if request_id and p.request_id == request_id), None)
        if replaced is not None:  # the same request again: it still arrives once
            picks.remove(replaced)
            target = replaced.target
        else:
            seen = self._arrivals.get(instance_id)  # one past the snapshot's count and every outstanding target
            target = None if seen is None else max([seen, *(p.target for p in picks if p.target is not None)]) + 1
        picks.append(_Pick(now, weight, request_id, target))

    def drop(self, request_id: str, instance_ids: Iterable[str]) -> None:
        """Forget `request_id`'s picks on `instance_ids` (they refused it or are gone: it never arrives there)."""
        for iid in instance_ids:
            picks = self._picks.get(iid)
            if picks and request_id:
                kept = [p for p in picks if p.request_id != request_id]
                if kept:
                    self._picks[iid] = kept
                else:
                    del self._picks[iid]

    def counts(self, now: float, reflected: Mapping[str, Reflected] | None = None,
               skip_request: str = "") -> dict[str, int]:
        """Picks (their weights summed) per instance in the last window_s seconds, leaving out those the
        instance's latest snapshot (`reflected[id]`) already covers and those of `skip_request`. Forgets older
        picks."""
        cutoff = now - self.window_s
        reflected = reflected or {}
        for iid, r in reflected.items():
            if r.arrivals is not None:
                self._arrivals[iid] = r.arrivals
        out: dict[str, int] = {}
        for iid in list(self._picks):
            kept = [p for p in self._picks[iid] if p.at > cutoff]
            if not kept:
                del self._picks[iid]
                continue
            self._picks[iid] = kept
            snap = reflected.get(iid)
            n = sum(p.weight for p in kept
                    if not (p.request_id and p.request_id == skip_request) and not _covered(p, snap))
            if n:
                out[iid] = n
        if len(self._arrivals) > _MAX_INSTANCES:  # instances that left: keep those in view or with picks
            self._arrivals = {i: a for i, a in self._arrivals.items() if i in reflected or i in self._picks}
        return out


def snapshots(instances: Iterable[Instance]) -> dict[str, Reflected]:
    """What each instance's load snapshot covers (those that reported a load)."""
    return {i.instance_id: Reflected(i.updated_at, i.arrivals) for i in instances if i.updated_at is not None}


def _covered(pick: _Pick, snapshot: Reflected | None) -> bool:
    if snapshot is None:
        return False
    if snapshot.arrivals is not None and pick.target is not None:
        return snapshot.arrivals >= pick.target
    return pick.at <= snapshot.at
