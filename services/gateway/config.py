"""Gateway settings (env prefix WINDSERVE_)."""

from pydantic import Field

from libs.service import ServiceConfig


class GatewayConfig(ServiceConfig):
    http_host: str = Field(default="127.0.0.1", description="bind address of the REST API")
    http_port: int = Field(default=8000, ge=0, le=65535, description="port of the REST API (0 = any free)")
    registry_timeout_s: float = Field(default=2.0, gt=0, description="max time /health waits for the registry")
