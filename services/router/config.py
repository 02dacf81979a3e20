"""Router settings (env prefix WINDSERVE_)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from libs.buckets import BucketConfig
from libs.routing import AffinityWeights
from libs.service import ServiceConfig

_W = AffinityWeights()  # the one source of the cost's default weights


class RouterConfig(ServiceConfig):
    buckets: BucketConfig = Field(default_factory=BucketConfig, description="the length buckets (libs/buckets.py)")
    registry_resync_s: float = Field(default=60.0, ge=0, description="full registry listing this often besides "
                                                                      "the watch; 0 = only after watch errors")
    policy: Literal["affinity", "least_loaded"] = Field(
        default="affinity", description="affinity: predicted KV hit + load (docs/routing.md); least_loaded: queue "
                                        "and KV share only")
    kv_index: bool = Field(default=True, description="index the workers' KV events (false: approximate mode, "
                                                      "an index of this router's own decisions with a TTL)")
    host_penalty: float = Field(default=_W.host_penalty, ge=0, description="cost of a host-tier hit token (share "
                                                                           "of computing it)")
    queue_weight: float = Field(default=_W.queue_weight, ge=0, description="cost per prefill token queued ahead")
    decode_weight: float = Field(default=_W.decode_weight, ge=0, description="cost per request running there")
    transfer_weight: float = Field(default=_W.transfer_weight, ge=0,
                                   description="disaggregated: cost per token of KV shipped to the decode worker")
    temperature: float = Field(default=_W.temperature, ge=0, description="0: lowest cost; > 0: softmax sampling "
                                                                         "(deterministic per request id)")
    credit: Literal["valid", "raw"] = Field(default="valid", description="hit credited: SWA-valid, or raw overlap")
    recent_window_s: float = Field(default=2.0, gt=0, description="picks (own and replicas') counted as load this "
                                                                  "long, until the registry load shows them")
    snapshot_timeout_s: float = Field(default=5.0, gt=0, description="max wait for one worker's KV snapshot")
    snapshot_retry_s: float = Field(default=0.5, gt=0, description="first wait before asking a worker again for a "
                                                                   "snapshot; doubles per failure")
    snapshot_retry_max_s: float = Field(default=30.0, gt=0, description="longest wait between snapshot attempts")
    max_buffered_events: int = Field(default=1 << 16, ge=1, description="events kept per worker while its "
                                                                        "snapshot is awaited")
    predictions_max: int = Field(default=1 << 16, ge=1, description="predictions kept for the hit reports")
    predictions_ttl_s: float = Field(default=300.0, gt=0, description="a prediction no hit report matched "
                                                                      "is dropped after this")
    approx_ttl_s: float = Field(default=120.0, gt=0, description="approximate mode: a routed chain counts "
                                                                 "as cached this long")
    approx_max_entries: int = Field(default=1 << 20, ge=1, description="approximate mode: most (worker, block) "
                                                                       "entries kept")
    maintain_interval_s: float = Field(default=1.0, gt=0, description="index sweep and metrics refresh period")

    def weights(self) -> AffinityWeights:
        return AffinityWeights(host_penalty=self.host_penalty, queue_weight=self.queue_weight,
                               decode_weight=self.decode_weight, transfer_weight=self.transfer_weight,
                               temperature=self.temperature, credit=self.credit)
