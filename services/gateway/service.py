"""Gateway wiring: the service base plus a uvicorn server running in the same event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import h11
import orjson
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from libs.bus import RegistryView, ViewConfig
from libs.service import Service
from protos.messages import RegistryEntry, Role
from services.gateway import handlers
from services.gateway.admission import Admission
from services.gateway.backend import NatsBackend
from services.gateway.config import GatewayConfig
from services.gateway.generation import Limits
from services.gateway.media import VisionTokens
from services.gateway.protocol import error_body
from services.gateway.readiness import CachedListing
from services.gateway.responses_api import ResponseStore

if TYPE_CHECKING:
    from libs.mm.api import EncoderAPI
    from libs.mm.client import EncoderClient


def model_config(model: str) -> Any:
    """The served model's ModelConfig: its vision tower and tokens decide whether images are taken. None when the
    model directory has no config this code reads (then the gateway serves text only, as before)."""
    from libs.model.config import ModelConfig

    if not model:
        return ModelConfig.tiny()
    try:
        return ModelConfig.from_pretrained(model)
    except Exception as exc:
        log.warning("no model config read: images are off", extra={"model": model, "error": repr(exc)})
        return None


log = logging.getLogger("windserve.gateway")
SHUTDOWN_CUT_SHARE = 0.8  # of the drain bound: requests still running then are ended with an error event


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service base owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol answering an unparsable request (not HTTP, or a request line and headers
    too large to buffer) with OpenAI's error body instead of plain text."""

    def send_400_response(self, msg: str) -> None:
        body = orjson.dumps(error_body(
            "invalid HTTP request: malformed, or its request line and headers are above the server's size limit",
            "invalid_request_error", code="invalid_http_request"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def http_config(app: FastAPI, host: str, port: int, max_header_bytes: int) -> uvicorn.Config:
    """h11 buffers up to 8x the header limit (at least 64 KB): headers in between reach the app,
    whose HeaderLimit answers 431; beyond that h11 gives up and JsonErrorH11Protocol answers 400.
    (h11 checks its limit only while a request is incomplete, so it alone would be timing-dependent.)"""
    return uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="off", http=JsonErrorH11Protocol,
                          h11_max_incomplete_event_size=max(65536, 8 * max_header_bytes))


class GatewayService(Service):
    role = Role.GATEWAY
    config: GatewayConfig

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self._http: uvicorn.Server | None = None
        self._http_task: asyncio.Task[None] | None = None
        self.backend: NatsBackend | None = None
        self.encoder: EncoderAPI | None = None  # a test injects an EncoderAPI here before setup
        self._encoder: EncoderClient | None = None  # else, for a multimodal model: the encoder tier's client
        self._encoder_view: RegistryView | None = None
        self.api: handlers.Api | None = None
        # one registry listing, reused for 0.5 s, shared by readiness probes and the backend
        self._listing = CachedListing(self._list_services, config.backend.fleet_cache_s)

    async def _list_services(self) -> list[RegistryEntry]:
        assert self.registry is not None
        return await self.registry.list(timeout=self.config.registry_timeout_s)

    async def _build_api(self) -> handlers.Api:
        from libs.model.tokenizer import load_tokenizer  # heavy import, only where the API is served

        cfg = self.config
        assert self.bus is not None
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model or None)
        self.backend = NatsBackend(self.bus, self._listing, cfg.backend, namespace=cfg.namespace,
                                   registry_timeout_s=cfg.registry_timeout_s)
        mc = await asyncio.to_thread(model_config, cfg.model)
        vision = VisionTokens.of(mc, tokenizer.decode) if mc is not None else None
        if vision is not None and self.encoder is None:
            await self._start_encoder(mc.vision)
        return handlers.Api(
            vision=vision, encoder=self.encoder or self._encoder, media=cfg.media,
            backend=self.backend, tokenizer=tokenizer, model_name=cfg.model_name,
            limits=Limits(cfg.context_length, cfg.default_max_tokens, cfg.max_n, cfg.max_batch, cfg.max_stop_strings,
                          cfg.max_stop_length, cfg.max_messages, cfg.max_fanout),
            admission=Admission(cfg.admission),
            api_keys=cfg.keys, retry_after_s=cfg.backend.retry_after_s, max_body_bytes=cfg.max_body_bytes,
            responses=ResponseStore(cfg.responses_store_entries, cfg.responses_store_ttl_s),
            docs_auth=cfg.docs_auth,
        )

    async def _start_encoder(self, vision: Any) -> None:
        """The EncoderClient over the live encoders of the registry (encode by content-hash affinity); the
        content hash covers the served model's preprocessing (`vision`, its VisionConfig)."""
        from libs.mm.client import EncoderClient, EncoderClientConfig

        assert self.bus is not None and self.registry is not None
        self._encoder_view = RegistryView(self.registry, role=Role.ENCODER,
                                          config=ViewConfig(list_timeout_s=self.config.registry_timeout_s))
        await self._encoder_view.start()
        self._encoder = EncoderClient(self.bus, self.config.namespace, self._encoder_view,
                                      config=EncoderClientConfig(vision=vision))
        await self._encoder.start()

    async def setup(self) -> None:
        self.api = await self._build_api()
        app = handlers.build_app(self._listing, self.config.instance_id, self.api, self.config.max_header_bytes)
        uv_config = http_config(app, self.config.http_host, self.config.http_port, self.config.max_header_bytes)
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
            # Requests still running near the end of the drain bound are ended with an error the client reads
            # (an SSE error event, or a 503 body), not a dropped connection; the rest of the bound flushes them.
            bound = self.config.drain_timeout_s
            done, _ = await asyncio.wait({self._http_task}, timeout=bound * SHUTDOWN_CUT_SHARE)
            if not done and self.api is not None:
                cut = self.api.streams.cut("the server is shutting down: this request was stopped before it "
                                           "finished; retry it once the server is back")
                log.warning("drain bound near: ended requests in flight with an error", extra={"requests": cut})
            await asyncio.wait({self._http_task}, timeout=bound * (1 - SHUTDOWN_CUT_SHARE))
        if self.backend is not None:
            await self.backend.close()  # aborts of cancelled streams go out before the bus closes
        if self._encoder is not None:
            with contextlib.suppress(Exception):
                await self._encoder.close()
        if self._encoder_view is not None:
            with contextlib.suppress(Exception):
                await self._encoder_view.stop()
