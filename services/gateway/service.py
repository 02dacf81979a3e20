"""Gateway wiring: the service base plus a uvicorn server running in the same event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn

from libs.service import Service
from protos.messages import RegistryEntry, Role
from services.gateway import handlers
from services.gateway.config import GatewayConfig


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service base owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayService(Service):
    role = Role.GATEWAY
    config: GatewayConfig

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None

    async def _list_services(self) -> list[RegistryEntry]:
        assert self.registry is not None
        return await self.registry.list(timeout=self.config.registry_timeout_s)

    async def setup(self) -> None:
        app = handlers.build_app(self._list_services, self.config.instance_id)
        uv_config = uvicorn.Config(
            app, host=self.config.http_host, port=self.config.http_port, log_config=None, lifespan="off"
        )
        self._http = _EmbeddedServer(uv_config)
        self._http_task = task = self.spawn(self._http.serve(), name="http", critical=True)
        # Bounded wait for the socket: the gateway is registered only once it can answer.
        async with asyncio.timeout(10):
            while not self._http.started:
                if task.done():
                    raise OSError(f"HTTP server failed to start on {self.config.http_host}:{self.config.http_port}")
                await asyncio.sleep(0.02)

    @property
    def http_url(self) -> str:
        assert self._http is not None and self._http.servers
        port = self._http.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.config.http_host}:{port}"

    def health_details(self) -> dict[str, str]:
        return {"http": self.http_url} if self._http is not None and self._http.started else {}

    async def teardown(self) -> None:
        if self._http is not None and self._http_task is not None:
            self._http.should_exit = True  # uvicorn finishes open responses, then returns
            await asyncio.wait({self._http_task}, timeout=self.config.drain_timeout_s)
