"""Decode settings (env prefix WINDSERVE_): the disaggregated engine-service settings of libs/worker."""

from libs.worker.config import DisaggServiceConfig


class DecodeConfig(DisaggServiceConfig):
    """Decode role: admits shipped KV, decodes with continuous batching, streams tokens."""
