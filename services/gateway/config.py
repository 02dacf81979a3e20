"""Gateway settings (env prefix WINDSERVE_)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from libs.service import ServiceConfig
from services.gateway.admission import AdmissionConfig
from services.gateway.backend import BackendConfig


@dataclass(frozen=True)
class MediaConfig:
    """Limits and sources of images / videos (every breach a 400)."""

    mm_max_items: int = 8
    """Images + videos of one chat request at most."""
    mm_max_item_bytes: int = 16 << 20
    """File bytes of one image / video at most."""
    mm_max_total_bytes: int = 32 << 20
    """File bytes of all items of a request at most."""
    mm_url_hosts: str = ""
    """Comma-separated hosts image / video http(s) URLs may name (and redirect to); empty = URLs off (data: URIs
    only)."""
    mm_url_timeout_s: float = 10.0
    """One media URL's whole fetch, redirects included (400 past it)."""
    mm_url_max_redirects: int = 3
    """Redirects one media URL may take."""
    mm_local_root: str = ""
    """Local image / video paths (file:// or absolute) are read only under this directory; empty = off."""

    def __post_init__(self) -> None:
        if min(self.mm_max_items, self.mm_max_item_bytes, self.mm_max_total_bytes) < 1 or self.mm_url_timeout_s <= 0:
            raise ValueError("MediaConfig: item counts, byte limits and mm_url_timeout_s must be positive")
        if self.mm_url_max_redirects < 0:
            raise ValueError("MediaConfig: mm_url_max_redirects must be >= 0")

    @property
    def url_hosts(self) -> frozenset[str]:
        return frozenset(h.strip().lower() for h in self.mm_url_hosts.split(",") if h.strip())


class GatewayConfig(ServiceConfig):
    http_host: str = Field(default="127.0.0.1", description="bind address of the REST API")
    http_port: int = Field(default=8000, ge=0, le=65535, description="port of the REST API (0 = any free)")
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
    responses_store_entries: int = Field(
        default=1024, ge=0, description="/v1/responses: responses kept for previous_response_id at most (oldest "
        "dropped first); 0 = none kept")
    responses_store_ttl_s: float = Field(
        default=3600.0, gt=0, description="/v1/responses: how long a response is kept for previous_response_id")
    docs_auth: bool = Field(default=True, description="with API keys: /docs and /openapi.json need a key too")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="backpressure (admission.py)")
    backend: BackendConfig = Field(default_factory=BackendConfig, description="placing and following requests "
                                   "(backend.py)")
    media: MediaConfig = Field(default_factory=MediaConfig, description="image / video limits and sources")

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
