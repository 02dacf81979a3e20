"""The gateway's failover and admission decisions (pure: registry entries in, decisions out; no IO).

- `Avoid`: the instances one request already failed on (gone, or refused it as busy); a retry asks the router
  with them excluded, and `repick` chooses without them when the answer still names one;
- `too_large`: the message (a 400) when no live serving path can ever hold a request (checked before routing, so
  nothing computes a prompt that no decode worker can take);
- `fallback_pick`: the no-router path (a combined worker from the registry), with the real cause when there
  is none (a disaggregated fleet needs the router; every worker already failed; nothing registered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from libs.routing import LengthBuckets, instance_of, pick_pair, pick_worker
from protos.messages import RegistryEntry, Role


@dataclass
class Avoid:
    """Instances a request must not be sent to again: `instances` prefill or combined workers, `decodes`
    decode workers (the two exclusion lists of `RouteRequest`)."""

    instances: set[str] = field(default_factory=set)
    decodes: set[str] = field(default_factory=set)

    def add(self, instance: str, decode: bool) -> None:
        (self.decodes if decode else self.instances).add(instance)

    def hits(self, prefill: str, decode: str) -> bool:
        """Does the route (prefill, decode) name an instance this request already failed on?"""
        return prefill in self.instances or decode in self.decodes or decode in self.instances

    def __bool__(self) -> bool:
        return bool(self.instances or self.decodes)

    def __str__(self) -> str:
        return ", ".join(sorted(self.instances | self.decodes))


@dataclass(frozen=True)
class Registered:
    """The fresh registry entries by role."""

    prefills: tuple[RegistryEntry, ...] = ()
    decodes: tuple[RegistryEntry, ...] = ()
    workers: tuple[RegistryEntry, ...] = ()
    routers: tuple[RegistryEntry, ...] = ()

    @classmethod
    def of(cls, entries: Sequence[RegistryEntry], now: float) -> Registered:
        """Entries whose heartbeat is within their TTL (a stale one may be a ghost of a dead process)."""
        live = [e for e in entries if e.fresh(now)]

        def role(r: Role) -> tuple[RegistryEntry, ...]:
            return tuple(e for e in live if e.role is r)
        return cls(role(Role.PREFILL), role(Role.DECODE), role(Role.WORKER), role(Role.ROUTER))

    @property
    def disaggregated(self) -> bool:
        """The router places pairs when prefill and decode workers are live (as `libs.routing.Router`)."""
        return bool(self.prefills and self.decodes)

    def hash_layout(self) -> tuple[int, int] | None:
        """(page size, hash seed) the workers' caches hash prompts with (their `kv_page_size` / `kv_hash_seed`
        labels): the router's index only matches a chain made the same way. None when no worker says."""
        for e in (*self.workers, *self.prefills, *self.decodes):
            try:
                return int(e.labels["kv_page_size"]), int(e.labels["kv_hash_seed"])
            except (KeyError, ValueError):
                continue
        return None


def _why_not(entry: RegistryEntry, prompt_tokens: int, max_tokens: int) -> str | None:
    total = prompt_tokens + max_tokens
    if entry.max_prompt_tokens and prompt_tokens > entry.max_prompt_tokens:
        return f"a prompt of {prompt_tokens} tokens exceeds the limit of {entry.max_prompt_tokens} prompt tokens"
    if entry.max_tokens and total > entry.max_tokens:
        return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds the limit "
                f"of {entry.max_tokens}")
    return None


def too_large(fleet: Registered, prompt_tokens: int, max_tokens: int) -> str | None:
    """Why no live serving path can ever hold the request (every candidate of a needed role is too small),
    or None when one can, or when the fleet cannot serve at all (routing reports that)."""
    groups = [("prefill", fleet.prefills), ("decode", fleet.decodes)] if fleet.disaggregated else [
        ("combined", fleet.workers)]
    for role, entries in groups:
        if not entries:
            continue
        reasons = [_why_not(e, prompt_tokens, max_tokens) for e in entries]
        if all(reasons):
            largest = max(range(len(entries)), key=lambda i: (entries[i].max_tokens, entries[i].max_prompt_tokens))
            return f"{reasons[largest]} of every live {role} worker"
    return None


def fallback_pick(fleet: Registered, num_tokens: int, buckets: LengthBuckets, request_id: str, avoid: Avoid) -> str:
    """No router answers: the combined worker to use (the router's own choice function), or LookupError
    naming why there is none."""
    if fleet.workers:
        return pick_worker([instance_of(w) for w in fleet.workers], num_tokens, buckets, request_id,
                           exclude_instances=sorted(avoid.instances)).instance_id
    if fleet.prefills and fleet.decodes:
        raise LookupError(f"prefill ({len(fleet.prefills)}) and decode ({len(fleet.decodes)}) workers are live, "
                          "but only the router places a disaggregated request: start a router")
    if fleet.prefills or fleet.decodes:
        raise LookupError(f"disaggregated mode needs a router and both roles; live: {len(fleet.prefills)} prefill, "
                          f"{len(fleet.decodes)} decode")
    raise LookupError("no live worker in the registry")


def repick(fleet: Registered, num_tokens: int, buckets: LengthBuckets, request_id: str,
           avoid: Avoid) -> tuple[str, str]:
    """(prefill, decode) from the registry without the avoided instances: used when the router's answer names
    one (a router that ignores `exclude_instances`, or a registry view that still lists a dead instance).
    Raises LookupError when no such path is live."""
    if fleet.disaggregated:
        prefill, decode = pick_pair([instance_of(e) for e in fleet.prefills], [instance_of(e) for e in fleet.decodes],
                                    num_tokens, buckets, request_id, exclude_decodes=sorted(avoid.decodes),
                                    exclude_instances=sorted(avoid.instances))
        return prefill.instance_id, decode.instance_id
    worker = fallback_pick(fleet, num_tokens, buckets, request_id, avoid)
    return worker, worker
