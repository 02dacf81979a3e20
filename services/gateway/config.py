"""Gateway settings (env prefix WINDSERVE_)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from libs.service import ServiceConfig


class GatewayConfig(ServiceConfig):
    http_host: str = Field(default="127.0.0.1", description="bind address of the REST API")
    http_port: int = Field(default=8000, ge=0, le=65535, description="port of the REST API (0 = any free)")
    registry_timeout_s: float = Field(default=2.0, gt=0, description="max time /health waits for the registry")
    api_keys: str = Field(default="", description="comma-separated API keys; empty = no authentication")
    served_model_name: str = Field(
        default="", description="model id clients must send; empty = the model directory's name or 'windserve-tiny'"
    )
    max_model_len: int = Field(default=32768, ge=1, description="most prompt + output tokens of one request (413)")
    default_max_tokens: int = Field(default=256, ge=1, description="max_tokens of chat requests that omit it")
    max_n: int = Field(default=16, ge=1, description="largest n (choices per prompt)")
    max_batch: int = Field(default=64, ge=1, description="most prompts in one completions request")
    max_in_flight: int = Field(default=64, ge=1, description="HTTP requests running downstream at once")
    max_queued: int = Field(default=256, ge=0, description="requests waiting for a slot; beyond that: 429")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="longest wait for a slot before 429")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After (seconds) sent with 429 and with 503 server_busy")
    page_size: int = Field(default=16, ge=1, description="KV page size for the route's block-hash chain")
    route_timeout_s: float = Field(default=2.0, gt=0, description="max wait for the router's answer")
    ack_timeout_s: float = Field(default=30.0, gt=0, description="max wait for a worker to accept a request")
    liveness_interval_s: float = Field(
        default=1.0, gt=0, description="without tokens for this long, the gateway probes the worker's health"
    )
    liveness_misses: int = Field(default=2, ge=1, description="failed probes in a row after which a worker is gone")
    idle_timeout_s: float = Field(
        default=300.0, gt=0, description="longest gap between two chunks of a live worker before the request fails"
    )

    @model_validator(mode="after")
    def _liveness_below_idle(self) -> GatewayConfig:
        if self.liveness_interval_s >= self.idle_timeout_s:
            raise ValueError("liveness_interval_s must be below idle_timeout_s")
        return self

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if self.model else "windserve-tiny"
