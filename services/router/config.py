"""Router settings (env prefix WINDSERVE_)."""

from pydantic import Field

from libs.service import ServiceConfig


class RouterConfig(ServiceConfig):
    bucket_edges: list[int] = Field(
        default_factory=lambda: [65536, 262144], description="length bucket edges (tokens), JSON list"
    )
    registry_timeout_s: float = Field(default=2.0, gt=0, description="max time one registry listing may take")
