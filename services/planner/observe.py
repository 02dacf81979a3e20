"""What the planner observes: the gateways' /metrics (request stream, TTFT / ITL histograms) and the registry's
load reports, turned into one `Observation` per interval (the difference of two readings)."""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from protos.messages import RegistryEntry
from services.planner.core import ROLES, Observation, RoleLoad

_G = "windserve_gateway_"
COUNTERS = {"finished": f"{_G}request_seconds_count", "prompt": f"{_G}prompt_tokens_total",
            "cached": f"{_G}cached_tokens_total", "output": f"{_G}output_tokens_total"}
GAUGES = (f"{_G}in_flight", f"{_G}queued")
HISTOGRAMS = {"ttft": f"{_G}ttft_seconds_bucket", "itl": f"{_G}itl_seconds_bucket"}


@dataclass
class Reading:
    """The gateways' metrics at one moment, summed over the gateways that answered."""

    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    in_system: float = 0.0
    buckets: dict[str, dict[float, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    gateways: int = 0  # how many answered

    def add(self, text: str) -> None:
        self.gateways += 1
        names = {v: k for k, v in COUNTERS.items()}
        hists = {v: k for k, v in HISTOGRAMS.items()}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in names:
                    self.counters[names[s.name]] += s.value
                elif s.name in GAUGES:
                    self.in_system += s.value
                elif s.name in hists:
                    self.buckets[hists[s.name]][float(s.labels["le"])] += s.value


def p90(now: dict[float, float], before: dict[float, float]) -> float | None:
    """The 0.9 quantile of the observations between two readings of a cumulative histogram (linear within the
    bucket it falls in, as Prometheus' histogram_quantile); None when nothing was observed."""
    edges = sorted(now)
    counts = [now[e] - before.get(e, 0.0) for e in edges]
    if not counts or counts[-1] <= 0:
        return None
    target = 0.9 * counts[-1]
    lower, below = 0.0, 0.0
    for edge, cum in zip(edges, counts, strict=True):
        if cum >= target:
            if math.isinf(edge):
                return lower
            return lower + (edge - lower) * ((target - below) / (cum - below) if cum > below else 1.0)
        lower, below = edge, cum
    return lower


async def read_gateways(client: httpx.AsyncClient, urls: list[str], timeout_s: float) -> tuple[Reading, int]:
    """One reading of every gateway at once, each within `timeout_s`; (reading, gateways that failed)."""
    async def one(url: str) -> str | None:
        try:
            resp = await client.get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
            resp.raise_for_status()
            return resp.text
        except (httpx.HTTPError, OSError):
            return None

    reading = Reading()
    texts = await asyncio.gather(*(one(u) for u in urls))
    for text in texts:
        if text is not None:
            reading.add(text)
    return reading, sum(t is None for t in texts)


def role_loads(entries: list[RegistryEntry]) -> dict[str, RoleLoad]:
    """The live engine instances per role, with their load reports summed."""
    acc: dict[str, list[int]] = {r: [0, 0, 0, 0, 0] for r in ROLES}
    for e in entries:
        if e.role.value not in acc:
            continue
        a = acc[e.role.value]
        a[0] += 1
        if e.load is not None:
            a[1] += e.load.running
            a[2] += e.load.waiting
            a[3] += e.load.kv_units_used or (e.load.kv_full_used + e.load.kv_swa_used)
            a[4] += e.load.kv_units_total or (e.load.kv_full_total + e.load.kv_swa_total)
    return {r: RoleLoad(*a) for r, a in acc.items()}


def observe(before: Reading, now: Reading, interval_s: float, roles: dict[str, RoleLoad]) -> Observation:
    """The interval between two readings."""
    d = {k: max(0.0, now.counters[k] - before.counters[k]) for k in COUNTERS}
    return Observation(
        interval_s=interval_s, finished=d["finished"], in_system_delta=now.in_system - before.in_system,
        prompt_tokens=d["prompt"], cached_tokens=d["cached"], output_tokens=d["output"],
        ttft_p90_s=p90(now.buckets["ttft"], before.buckets["ttft"]),
        itl_p90_s=p90(now.buckets["itl"], before.buckets["itl"]), roles=roles)
