"""Gateway HTTP app: OpenAI-compatible API, /health, /metrics.

The registry and the downstream are reached through injected objects (`ListServices`, `Api.backend`)
so the app runs in tests without NATS. Status codes: 400 bad request (well-formed JSON that cannot be
served as asked, or malformed JSON), 401 missing/wrong API key, 404 unknown model or route, 413 prompt
(+ max_tokens) longer than the context, 422 schema validation, 429 queue full (Retry-After), 500 a
worker failed, 503 no worker / worker gone / router down / every decode worker full (Retry-After).
Bodies use OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protos.messages import RegistryEntry
from services.gateway import metrics
from services.gateway.admission import Admission, Overloaded
from services.gateway.backend import Backend
from services.gateway.generation import (
    Limits,
    Plan,
    Renderer,
    Tokenizer,
    collect,
    plan_chat,
    plan_completion,
    stream_events,
)
from services.gateway.protocol import ApiError, ChatCompletionRequest, CompletionRequest, error_body

ListServices = Callable[[], Awaitable[list[RegistryEntry]]]


@dataclass
class Api:
    """Everything the /v1 endpoints need."""

    backend: Backend
    tokenizer: Tokenizer
    model_name: str
    limits: Limits
    admission: Admission
    api_keys: frozenset[str] = frozenset()
    retry_after_s: int = 1
    created: int = 0


def group_by_role(entries: list[RegistryEntry]) -> dict[str, list[str]]:
    """{role: sorted instance ids} of the live entries."""
    out: dict[str, list[str]] = {}
    for e in entries:
        out.setdefault(e.role.value, []).append(e.instance_id)
    return {role: sorted(ids) for role, ids in sorted(out.items())}


def bearer_ok(header: str, keys: frozenset[str]) -> bool:
    """True when `Authorization: Bearer <key>` names one of `keys` (compared in constant time)."""
    scheme, _, token = header.partition(" ")
    token = token.strip()
    # Compare against every key, so timing does not reveal which one (or how many) matched.
    matches = [hmac.compare_digest(token.encode(), k.encode()) for k in keys]
    return scheme.lower() == "bearer" and any(matches)


def validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    """(status, message, param) of a request that failed schema validation: 400 for unparsable JSON,
    422 for a schema mismatch, with every problem listed as `field: reason`."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "request body is not valid JSON", None
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
    return 422, "; ".join(parts), param


def _json_error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return _json_error(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        status, message, param = validation_message(exc)
        return _json_error(status, message, "invalid_request_error", param, "invalid_value" if status == 422 else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json_error(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(Exception)
    async def crashed(_: Request, exc: Exception) -> Response:
        return _json_error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class ClientGone(Exception):
    """The HTTP client disconnected before the (non-streaming) response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(work: Coroutine[Any, Any, Any], request: Request) -> Any:
    """Run `work`; cancel it (aborting everything downstream) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        metrics.DISCONNECTS.inc()
        raise ClientGone()
    finally:
        watch.cancel()
        task.cancel()


def _add_v1_routes(app: FastAPI, api: Api) -> None:
    async def auth(request: Request) -> None:
        if api.api_keys and not bearer_ok(request.headers.get("authorization", ""), api.api_keys):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type_="authentication_error", code="invalid_api_key")

    def check_model(name: str) -> None:
        if name != api.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {api.model_name!r}",
                           type_="not_found_error", param="model", code="model_not_found")

    async def serve(plan: Plan, request: Request) -> Response:
        try:
            slot = await api.admission.enter()
        except Overloaded as exc:
            metrics.REJECTED.inc()
            raise ApiError(429, f"server is busy: {exc}; retry after {api.retry_after_s}s", type_="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(api.retry_after_s)}) from exc
        decode_text = lambda ids: api.tokenizer.decode(ids, skip_special_tokens=True)
        renderer = Renderer(plan, lambda ids: api.tokenizer.decode(ids))
        if plan.stream:
            events = stream_events(plan, api.backend, renderer, decode_text, slot.release)
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(slot.release),
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": plan.id})
        try:
            body = await until_disconnect(collect(plan, api.backend, renderer, decode_text), request)
        except ClientGone:
            return Response(status_code=499)
        finally:
            slot.release()
        return JSONResponse(body, headers={"X-Request-Id": plan.id})

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(api)]}

    @app.get("/v1/models/{model}", dependencies=[Depends(auth)])
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return _model_card(api)

    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        plan = plan_completion(body, api.tokenizer, api.limits, f"cmpl-{secrets.token_hex(12)}", api.model_name)
        return await serve(plan, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        plan = plan_chat(body, api.tokenizer, api.limits, f"chatcmpl-{secrets.token_hex(12)}", api.model_name)
        return await serve(plan, request)


def _model_card(api: Api) -> dict[str, Any]:
    return {"id": api.model_name, "object": "model", "created": api.created, "owned_by": "windserve",
            "max_model_len": api.limits.max_model_len}


class CountRequests:
    """ASGI middleware counting responses by route and status (pure ASGI: it leaves streaming and
    disconnect detection untouched, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            metrics.REQUESTS.labels(getattr(scope.get("route"), "path", "other"), str(status)).inc()


def build_app(list_services: ListServices, instance_id: str, api: Api | None = None) -> FastAPI:
    """The gateway app; without `api` only /health and /metrics exist."""
    app = FastAPI(title="windserve gateway")
    _install_error_handlers(app)

    app.add_middleware(CountRequests)

    @app.get("/health")
    async def health() -> Response:
        try:
            entries = await list_services()
        except Exception as exc:  # registry unreachable: say so instead of a bare 500
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        body: dict[str, Any] = {
            "status": "ok",
            "gateway": instance_id,
            "services": group_by_role(entries),
            "instances": [e.model_dump(mode="json", exclude={"schema_version"}) for e in entries],
        }
        if api is not None:
            body["model"] = api.model_name
            body["queue"] = {"in_flight": api.admission.in_flight, "queued": api.admission.queued}
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus() -> Response:
        if api is not None:
            metrics.IN_FLIGHT.set(api.admission.in_flight)
            metrics.QUEUED.set(api.admission.queued)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    if api is not None:
        api.created = api.created or int(time.time())
        _add_v1_routes(app, api)
    return app
