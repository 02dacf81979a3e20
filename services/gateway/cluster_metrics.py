"""One Prometheus view of the whole deployment: the gateway's `/metrics/cluster`.

Every live instance in the registry that serves metrics (its entry's `metrics_url`) is scraped at once, each
within `timeout_s`; their series and the gateway's own are re-exposed in one text exposition with `role` and
`instance` labels added, so one scrape (or one curl) sees engines, routers, encoders and GCache nodes beside the
gateway. `windserve_cluster_scrape_up{role,instance}` says which instances answered: one that did not is
missing from the view, never waited for past the bound.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from protos.messages import RegistryEntry

UP = "windserve_cluster_scrape_up"


class _Snapshot:
    """A collector that yields families already gathered."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


async def _scrape(client: httpx.AsyncClient, entry: RegistryEntry) -> str | None:
    try:
        resp = await client.get(entry.metrics_url)
        resp.raise_for_status()
        return resp.text
    except (httpx.HTTPError, OSError):
        return None


def merge(sources: Iterable[tuple[str, str, str]]) -> dict[str, Metric]:
    """(role, instance, exposition text) -> families by name, each sample labelled with its role and instance."""
    merged: dict[str, Metric] = {}
    for role, instance, text in sources:
        for family in text_string_to_metric_families(text):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            into.samples += [Sample(s.name, {**s.labels, "role": role, "instance": instance}, s.value, s.timestamp,
                                    s.exemplar) for s in family.samples]
    return merged


async def cluster_text(entries: list[RegistryEntry], own_role: str, own_instance: str,
                       timeout_s: float = 2.0) -> bytes:
    """The exposition text of every instance in `entries` (scraped concurrently) and of this process."""
    targets = [e for e in entries if e.metrics_url and e.instance_id != own_instance]
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        texts = await asyncio.gather(*(_scrape(client, e) for e in targets))
    own = generate_latest(REGISTRY).decode()
    sources = [(own_role, own_instance, own)]
    sources += [(e.role.value, e.instance_id, t) for e, t in zip(targets, texts, strict=True) if t is not None]
    families = merge(sources)
    up = Metric(UP, "1 when the instance's metrics were scraped into this view, 0 when it did not answer", "gauge")
    up.samples = [Sample(UP, {"role": own_role, "instance": own_instance}, 1.0)]
    up.samples += [Sample(UP, {"role": e.role.value, "instance": e.instance_id}, float(t is not None))
                   for e, t in zip(targets, texts, strict=True)]
    families[UP] = up
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families.values()))  # type: ignore[arg-type]
    return generate_latest(registry)
