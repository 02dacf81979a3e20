"""Worker settings (env prefix WINDSERVE_): the shared service settings plus the engine's knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from libs.routing import DEFAULT_BUCKET_EDGES
from libs.service import ServiceConfig


class WorkerConfig(ServiceConfig):
    """A combined (prefill + decode) worker. `model` empty = the built-in tiny model."""

    page_size: int = Field(default=16, ge=1, description="tokens per KV page")
    num_full_pages: int = Field(default=2048, ge=1, description="pages of the full-attention KV pool")
    num_swa_pages: int = Field(default=512, ge=1, description="pages of the sliding-window KV pool")
    max_num_seqs: int = Field(default=64, ge=1, description="most requests running at once")
    max_num_batched_tokens: int = Field(default=512, ge=1, description="token budget of one engine step")
    enable_prefix_cache: bool = Field(default=True, description="reuse KV across requests")
    bucket_edges: list[int] = Field(
        default_factory=lambda: list(DEFAULT_BUCKET_EDGES), description="length bucket edges (uncached tokens), JSON list"
    )
    served_buckets: list[int] = Field(
        default_factory=list, description="length buckets this worker is meant for (JSON list); empty = all"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="KV/activation dtype")
    device: str = Field(default="cpu", description="torch device of the model and KV pools")
    seed: int = Field(default=0, description="seed of the engine-wide generator (unseeded sampling)")
    output_timeout_s: float = Field(
        default=300.0, gt=0, description="longest wait for a request's next engine output before it fails"
    )
    load_interval_s: float = Field(
        default=0.5, gt=0, description="how often the load snapshot (registry entry, health) is refreshed"
    )
    recent_aborts: int = Field(
        default=4096, ge=1, description="aborted request ids remembered (an abort may overtake its request)"
    )

    @model_validator(mode="after")
    def _buckets_in_range(self) -> WorkerConfig:
        num_buckets = len(self.bucket_edges) + 1
        bad = [b for b in self.served_buckets if not 0 <= b < num_buckets]
        if bad:
            raise ValueError(f"served_buckets {bad} outside [0, {num_buckets}) for bucket_edges {self.bucket_edges}")
        return self

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens that one request can ever hold (the whole full pool)."""
        return self.page_size * self.num_full_pages
