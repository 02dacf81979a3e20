"""Decode settings (env prefix WINDSERVE_): the engine knobs shared with prefill."""

from services.prefill.config import EngineServiceConfig


class DecodeConfig(EngineServiceConfig):
    """Decode role: admits shipped KV, decodes with continuous batching, streams tokens."""
