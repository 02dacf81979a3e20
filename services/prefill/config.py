"""Prefill settings (env prefix WINDSERVE_): the disaggregated engine-service settings of libs/worker plus
the decode retry budget and the bounded wait for decode room."""

from __future__ import annotations

from pydantic import Field

from libs.worker.config import DisaggServiceConfig


class PrefillConfig(DisaggServiceConfig):
    """Prefill role: prefill-only engine + KV sender."""

    decode_attempts: int = Field(
        default=3, ge=1, description="decode workers tried per request when they answer full (1 = no retry)")
    decode_wait_s: float = Field(
        default=10.0, ge=0, description="a request every decode worker refuses as full waits this long for room "
        "(before any compute), then gets 503 + Retry-After; 0 = refuse at once")
    decode_wait_queue: int = Field(
        default=64, ge=0, description="requests waiting for decode room at once on this prefill; beyond: 503 at once")
    decode_unreachable_grace_s: float = Field(
        default=1.5, ge=0, description="a listed decode worker with no responders on kv_prepare (gone, or its client "
        "moving to another node of a NATS cluster) is asked again for this long when the router finds no other")
    kv_segment_pages: int | None = Field(
        default=None, ge=0, description="full-layer KV pages per segment streamed while the prefill computes "
        "(unset: max_num_batched_tokens // page_size, one step's worth; 0: one segment after the whole prefill)")
