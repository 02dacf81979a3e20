"""Prefill settings (env prefix WINDSERVE_): the disaggregated engine-service settings of libs/worker plus
the decode retry budget."""

from __future__ import annotations

from pydantic import Field

from libs.worker.config import DisaggServiceConfig


class PrefillConfig(DisaggServiceConfig):
    """Prefill role: prefill-only engine + KV sender."""

    decode_attempts: int = Field(
        default=3, ge=1, description="decode workers tried per request when they answer full (1 = no retry)")
    kv_segment_pages: int | None = Field(
        default=None, ge=0, description="full-layer KV pages per segment streamed while the prefill computes "
        "(unset: max_num_batched_tokens // page_size, one step's worth; 0: one segment after the whole prefill)")
