"""Gateway settings (env prefix WINDSERVE_)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, model_validator

from libs.service import ServiceConfig

if TYPE_CHECKING:
    from services.gateway.media import MediaConfig


class GatewayConfig(ServiceConfig):
    http_host: str = Field(default="127.0.0.1", description="bind address of the REST API")
    http_port: int = Field(default=8000, ge=0, le=65535, description="port of the REST API (0 = any free)")
    registry_timeout_s: float = Field(default=2.0, gt=0, description="max time /health waits for the registry")
    api_keys: str = Field(default="", description="comma-separated API keys; empty = no authentication")
    served_model_name: str = Field(
        default="", description="model id clients must send; empty = the model directory's name or 'windserve-tiny'"
    )
    max_model_len: int | None = Field(
        default=None, ge=1, description="most prompt + output tokens of one request (413); unset = the "
        "checkpoint's max_position_embeddings (the built-in tiny model's without a model directory)")
    default_max_tokens: int = Field(
        default=256, ge=0, description="cap of max_tokens when a request sends null or omits it (both mean "
        "'up to the context'); 0 = no cap")
    max_n: int = Field(default=16, ge=1, description="largest n (choices per prompt)")
    max_batch: int = Field(default=64, ge=1, description="most prompts in one completions request")
    max_fanout: int = Field(
        default=32, ge=1, description="choices of one request running downstream at once (the rest wait their "
        "turn): a fan-out of max_n x max_batch is served, not refused as busy")
    max_stop_strings: int = Field(default=16, ge=1, description="most stop strings of one request (400)")
    max_stop_length: int = Field(default=256, ge=1, description="longest stop string in characters (400)")
    max_messages: int = Field(default=1024, ge=1, description="most messages of one chat request (400)")
    max_body_bytes: int = Field(
        default=8 << 20, ge=1024, description="largest request body (413, checked before it is parsed)")
    max_header_bytes: int = Field(
        default=16384, ge=1024, description="largest request line + headers (400 with an OpenAI error body)")
    docs_auth: bool = Field(default=True, description="with API keys: /docs and /openapi.json need a key too")
    max_in_flight: int = Field(default=64, ge=1, description="HTTP requests running downstream at once")
    max_queued: int = Field(default=256, ge=0, description="requests waiting for a slot; beyond that: 429")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="longest wait for a slot before 429")
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After (seconds) sent with 429 and with 503 server_busy")
    page_size: int = Field(default=16, ge=1, description="KV page size of the route's block-hash chain until a worker advertises its kv_page_size label")
    route_timeout_s: float = Field(
        default=2.0, gt=0, description="max wait for a router's answer, every router asked together; past it "
        "(routers registered but silent: hung, or behind a hung NATS node) the request is placed from the registry")
    route_try_timeout_s: float = Field(
        default=0.75, gt=0, description="max wait for one router's answer before the next registered router is "
        "asked (within route_timeout_s)")
    router_suspect_s: float = Field(
        default=5.0, gt=0, description="a router that did not answer is asked last among the routers for this long")
    ack_timeout_s: float = Field(default=30.0, gt=0, description="max wait for a worker to accept a request")
    liveness_interval_s: float = Field(
        default=1.0, gt=0, description="without tokens for this long, the gateway probes the worker's health"
    )
    liveness_misses: int = Field(default=2, ge=1, description="failed probes in a row after which a worker is gone")
    liveness_silent_s: float = Field(
        default=6.0, gt=0, description="a worker whose probes time out (no 'no responders': its subscriptions still "
        "stand, e.g. its NATS node hangs) is gone only after this long silent: its client leaves a hung node within "
        "the bus's ping bound (libs/bus BusConfig ping_interval_s x max_outstanding_pings)")
    max_attempts: int = Field(
        default=3, ge=1, description="attempts of one request: before its first token, a request whose worker is "
        "gone or refuses as busy is retried on another instance (1 = no failover)")
    failover_timeout_s: float = Field(
        default=30.0, gt=0, description="no retry starts later than this after the request's first attempt")
    reconnect_bound_s: float = Field(
        default=10.0, gt=0, description="NATS unreachable this long fails a waiting request (control plane down)")
    unreachable_grace_s: float = Field(
        default=1.5, gt=0, description="a listed router or worker with no responders on its subject (gone, or its "
        "client moving to another node of a NATS cluster) is asked again for this long when nothing else can take "
        "the request, before the request fails; a streaming worker is gone only once its probes found no "
        "responders for this long")
    idle_timeout_s: float = Field(
        default=300.0, gt=0, description="longest gap between two chunks of a live worker before the request fails"
    )

    mm_max_items: int = Field(default=8, ge=1, description="images + videos of one chat request at most (400)")
    mm_max_item_bytes: int = Field(default=16 << 20, ge=1, description="file bytes of one image / video (400)")
    mm_max_total_bytes: int = Field(default=32 << 20, ge=1, description="file bytes of all items of a request (400)")
    mm_url_hosts: str = Field(default="", description="comma-separated hosts image / video http(s) URLs may name "
                              "(and redirect to); empty = URLs off (data: URIs only)")
    mm_url_timeout_s: float = Field(default=10.0, gt=0, description="one media URL's whole fetch (400 past it)")
    mm_url_max_redirects: int = Field(default=3, ge=0, description="redirects one media URL may take")
    mm_local_root: str = Field(default="", description="local image / video paths (file:// or absolute) are read "
                               "only under this directory; empty = off")

    @model_validator(mode="after")
    def _liveness_below_idle(self) -> GatewayConfig:
        if self.liveness_interval_s >= self.idle_timeout_s:
            raise ValueError("liveness_interval_s must be below idle_timeout_s")
        return self

    def media_config(self) -> MediaConfig:
        from services.gateway.media import MediaConfig  # (the media stack only where the API is served)

        return MediaConfig(
            max_items=self.mm_max_items, max_item_bytes=self.mm_max_item_bytes,
            max_total_bytes=self.mm_max_total_bytes,
            url_hosts=frozenset(h.strip().lower() for h in self.mm_url_hosts.split(",") if h.strip()),
            url_timeout_s=self.mm_url_timeout_s, url_max_redirects=self.mm_url_max_redirects,
            local_root=self.mm_local_root)

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.api_keys.split(",") if k.strip())

    @property
    def context_length(self) -> int:
        """max_model_len if set, else the checkpoint's max_position_embeddings."""
        return self.max_model_len or checkpoint_context(self.model)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if self.model else "windserve-tiny"


FALLBACK_CONTEXT = 32768  # a model directory whose config.json names no max_position_embeddings


def checkpoint_context(model: str) -> int:
    """The model's context length: `max_position_embeddings` of `<model>/config.json` (also inside a
    multimodal checkpoint's `text_config`); the built-in tiny model's without a model directory."""
    if not model:
        from libs.model.config import ModelConfig  # torch-free

        return ModelConfig.tiny().max_position_embeddings
    path = Path(model) / "config.json"
    if not path.is_file():
        return FALLBACK_CONTEXT
    cfg = json.loads(path.read_text())
    value = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return int(value) if value else FALLBACK_CONTEXT
