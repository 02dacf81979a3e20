"""What every engine worker reports: request outcomes, and the Prometheus gauges of its engine.

Served on WINDSERVE_METRICS_PORT by the service base; the same families on every engine role (combined
worker, prefill, decode), refreshed with the load snapshot every `load_interval_s`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import Gauge

from libs.engine.core import EngineLoad
from protos.messages import TokenChunk, WireFinishReason

KV_PAGES = Gauge("windserve_worker_kv_pages", "KV pages by pool, tier and state", ["pool", "tier", "state"])
REQUESTS = Gauge("windserve_worker_requests", "Requests in the engine by state", ["state"])
OUTCOMES = Gauge("windserve_worker_requests_done", "Requests since start by outcome", ["outcome"])
PROMPT_TOKENS = Gauge("windserve_worker_prompt_tokens", "Prompt tokens admitted by the engine since start")
HIT_TOKENS = Gauge("windserve_worker_prefix_hit_tokens", "Prompt tokens served from the prefix cache since start")
KV_EVICTIONS = Gauge("windserve_worker_kv_evictions", "Cache evictions since start by reason (victims)", ["reason"])
KV_HIT_KINDS = Gauge("windserve_worker_kv_hit_tokens", "Prompt tokens of admitted requests since start: the full-KV "
                     "match (raw) and the valid hit it gave (valid); raw - valid was lost to missing SWA KV", ["kind"])
HIT_TIER_TOKENS = Gauge("windserve_worker_prefix_hit_tier_tokens", "Prompt tokens served from the prefix cache since "
                        "start, by the tier the KV came from: device (L1), host (L2), gcache (L3, imported into L2)",
                        ["tier"])
GCACHE = Gauge("windserve_worker_gcache", "GCache (L3) since start: lookups, hits, misses, refused, timeouts, errors, "
               "imported_tokens, writebacks, written_values, dropped, writeback_failures", ["event"])
KV_ARENA_UNITS = Gauge("windserve_worker_kv_arena_units", "KV arena units by tier (device, host) and state (free, "
                       "full_in_use, full_cached, swa_in_use, swa_cached; reserved: the part of free + cached promised "
                       "to running sequences); units: the arena's size. Bytes = units x the arena's unit bytes "
                       "(docs/kvcache.md)", ["tier", "state"])
COMPILED_CALLS = Gauge("windserve_worker_compiled_calls", "Compiled-step graph calls since start (docs/engine.md, "
                       "Compiled step)")
EAGER_FALLBACKS = Gauge("windserve_worker_eager_fallbacks", "Compiled-step calls that ran eager since start, by reason "
                        "(tokens_over_max: a step above the compiled sizes; compile_failed)", ["reason"])
PREEMPTIONS = Gauge("windserve_worker_preemptions", "Sequences preempted (recomputed later) since start")
SPEC_TOKENS = Gauge("windserve_worker_spec_tokens", "MTP speculative decoding since start: draft tokens verified "
                    "(drafted) and accepted", ["kind"])
SPEC_ACCEPT = Gauge("windserve_worker_spec_accept_length", "MTP verify steps since start by tokens emitted (accepted "
                    "drafts + 1): the acceptance length histogram", ["tokens"])

_PAGE_STATES = ("free", "cached", "in_use", "reserved")
_FINAL = {WireFinishReason.STOP: "finished", WireFinishReason.LENGTH: "finished", WireFinishReason.ABORT: "aborted",
          WireFinishReason.ERROR: "failed"}


@dataclass
class Outcomes:
    """What became of this worker's requests since start. `accepted` / `refused`: how the entry point
    (generate ack, kv_prepare reply) answered; the others count the final chunks this worker published."""

    accepted: int = 0
    refused: int = 0
    finished: int = 0  # stop or length
    aborted: int = 0
    failed: int = 0

    def observe(self, chunk: TokenChunk) -> None:
        """Count `chunk` if it is a final one (call before publishing it)."""
        if chunk.finish_reason is not None:
            field = _FINAL[chunk.finish_reason]
            setattr(self, field, getattr(self, field) + 1)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def export(load: EngineLoad, outcomes: Mapping[str, int], gcache: Mapping[str, int] | None = None) -> None:
    """Set every gauge from one load snapshot, the outcome counts and the GCache counts (None: GCache off)."""
    usage = load.usage
    for pool, tier, stats in (("full", "device", usage.full), ("swa", "device", usage.swa),
                              ("full", "host", usage.host_full), ("swa", "host", usage.host_swa)):
        for state in _PAGE_STATES:
            KV_PAGES.labels(pool, tier, state).set(getattr(stats, state))
    for tier, arena in (("device", usage.arena), ("host", usage.host_arena)):
        if arena is not None:
            for state in ("units", "free", "full_in_use", "full_cached", "swa_in_use", "swa_cached", "reserved"):
                KV_ARENA_UNITS.labels(tier, state).set(getattr(arena, state))
    REQUESTS.labels("running").set(load.running)
    REQUESTS.labels("waiting").set(load.waiting)
    for outcome, n in outcomes.items():
        OUTCOMES.labels(outcome).set(n)
    PROMPT_TOKENS.set(load.prompt_tokens)
    HIT_TOKENS.set(load.hit_tokens)
    for tier, n in (("device", load.hit_tokens - load.host_hit_tokens - load.l3_hit_tokens),
                    ("host", load.host_hit_tokens), ("gcache", load.l3_hit_tokens)):
        HIT_TIER_TOKENS.labels(tier).set(n)
    for event, n in (gcache or {}).items():
        GCACHE.labels(event).set(n)
    PREEMPTIONS.set(load.preemptions)
    COMPILED_CALLS.set(load.compiled_calls)
    for reason, n in load.eager_fallbacks.items():
        EAGER_FALLBACKS.labels(reason).set(n)
    if load.spec is not None:
        SPEC_TOKENS.labels("drafted").set(load.spec.drafted_tokens)
        SPEC_TOKENS.labels("accepted").set(load.spec.accepted_tokens)
        for accepted, steps in enumerate(load.spec.accept_hist):
            SPEC_ACCEPT.labels(str(accepted + 1)).set(steps)
    if load.cache is not None:
        for reason, (victims, _) in load.cache.evictions.items():
            KV_EVICTIONS.labels(reason).set(victims)
        KV_HIT_KINDS.labels("raw").set(load.cache.raw_hit_tokens)
        KV_HIT_KINDS.labels("valid").set(load.cache.valid_hit_tokens)
