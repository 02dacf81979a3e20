"""The router's boundary (pure): registry entries and wire messages in, the routing views (`libs.routing`,
`libs.kvcache`) out, and the ledger of recent predictions the workers' hit reports are matched against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from libs.routing import Fleet, Instance, instance_of
from protos.messages import KV_LAYOUT_LABELS, RegistryEntry, Role
from services.router.config import RouterConfig

ENGINE_ROLES = (Role.PREFILL, Role.DECODE, Role.WORKER)


def health_details(config: RouterConfig) -> dict[str, str]:
    """Extra health fields."""
    return {"bucket_edges": ",".join(map(str, config.buckets.bucket_edges)), "policy": config.policy,
            "kv_events": "on" if config.kv_index else "approximate"}


def fleet_of(entries: Sequence[RegistryEntry]) -> Fleet:
    """The live prefill, decode and combined workers of a registry listing (other roles are not routed to)."""
    def of(role: Role) -> tuple[Instance, ...]:
        return tuple(instance_of(e) for e in entries if e.role is role)
    return Fleet(prefills=of(Role.PREFILL), decodes=of(Role.DECODE), workers=of(Role.WORKER))


@dataclass(frozen=True)
class IndexLayout:
    """What the index must share with a worker (its `KV_LAYOUT_LABELS`): one page size, window and rebuild
    span to predict its `match`, one hash seed for the gateway's chain to name its blocks."""

    page_size: int
    window: int
    rebuild_tokens: int
    hash_seed: int


def layout_of(entry: RegistryEntry) -> IndexLayout | None:
    """The worker's KV layout from its registry labels; None when it advertises none. ValueError when the
    labels are there but not decimal ints."""
    labels = entry.labels
    if not any(k in labels for k in KV_LAYOUT_LABELS):
        return None
    try:
        page, window, rebuild, seed = (int(labels[k]) for k in KV_LAYOUT_LABELS)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"worker {entry.instance_id}: bad KV layout labels "
                         f"{ {k: labels.get(k) for k in KV_LAYOUT_LABELS} }") from exc
    return IndexLayout(page, window, rebuild, seed)


@dataclass(frozen=True)
class Prediction:
    side: str
    """"prefill" (the prefill or combined worker) or "decode" (disaggregated decode side)."""
    tokens: int
    at: float


class Predictions:
    """This router's recent predictions by request id, kept for the workers' hit reports: bounded (the
    oldest go first past `max_entries`) and forgotten after `ttl_s` (a request whose report never came)."""

    def __init__(self, max_entries: int = 1 << 16, ttl_s: float = 300.0) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._by_request: OrderedDict[str, dict[str, Prediction]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, request_id: str, now: float, prefill: str, hit: int, decode: str = "", decode_hit: int = 0
            ) -> None:
        """A decision: the prefill (or combined) worker's predicted hit, and the decode side's when it differs.
        A request routed again (a retry) replaces its earlier prediction."""
        picks = {prefill: Prediction("prefill", hit, now)}
        if decode and decode != prefill:
            picks[decode] = Prediction("decode", decode_hit, now)
        self._by_request.pop(request_id, None)
        self._by_request[request_id] = picks
        self._expire(now)

    def take(self, request_id: str, instance_id: str, now: float) -> Prediction | None:
        """The prediction a hit report of `instance_id` answers (once); None when this router made none."""
        self._expire(now)
        picks = self._by_request.get(request_id)
        if picks is None:
            return None
        pred = picks.pop(instance_id, None)
        if not picks:
            del self._by_request[request_id]
        return pred

    def _expire(self, now: float) -> None:
        cutoff = now - self.ttl_s
        by = self._by_request
        while by and (len(by) > self.max_entries or min(p.at for p in next(iter(by.values())).values()) < cutoff):
            by.popitem(last=False)
