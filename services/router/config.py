"""Router settings (env prefix WINDSERVE_)."""

from __future__ import annotations

from pydantic import Field, model_validator

from libs.routing import DEFAULT_BUCKET_EDGES, LengthBuckets
from libs.service import ServiceConfig


class RouterConfig(ServiceConfig):
    bucket_edges: list[int] = Field(
        default_factory=lambda: list(DEFAULT_BUCKET_EDGES), description="length bucket edges (tokens), JSON list"
    )
    registry_timeout_s: float = Field(default=2.0, gt=0, description="max time one registry listing may take")

    @model_validator(mode="after")
    def _edges_valid(self) -> RouterConfig:
        LengthBuckets(tuple(self.bucket_edges))  # positive, strictly increasing
        return self
