"""Gateway HTTP app: OpenAI-compatible API, /health (/health/live, /health/ready), /metrics.

The registry and the downstream are reached through injected objects (`ListServices`, `Api.backend`), so
the app runs in tests without NATS. Auth and body size are checked before the body is read or parsed.
Errors use OpenAI's error object, each documented in the OpenAPI document (`ERRORS`); 429 and 503 carry
Retry-After. Status codes: docs/gateway.md, "Errors".
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from libs.mm.api import EncoderAPI
from protos.messages import RegistryEntry
from services.gateway import messages_api as messages
from services.gateway import metrics
from services.gateway import responses_api as responses
from services.gateway.admission import Admission, Overloaded
from services.gateway.backend import Backend
from services.gateway.generation import (
    ChatMedia,
    Limits,
    Plan,
    Renderer,
    Streams,
    TextCodec,
    chat_messages,
    collect,
    plan_chat,
    plan_completion,
    stream_events,
)
from services.gateway.media import MediaCollector, MediaConfig, VisionTokens, encode_all, load_all
from services.gateway.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    error_body,
    validation_status,
)
from services.gateway.readiness import CachedListing, serving_path

ListServices = Callable[[], Awaitable[list[RegistryEntry]]]


@dataclass
class Api:
    """Everything the /v1 endpoints need."""

    backend: Backend
    tokenizer: TextCodec
    model_name: str
    limits: Limits
    admission: Admission
    api_keys: frozenset[str] = frozenset()
    retry_after_s: int = 1
    created: int = 0
    max_body_bytes: int = 8 << 20
    docs_auth: bool = True  # with api_keys: /docs and /openapi.json need a key too
    vision: VisionTokens | None = None  # the model's vision tokens; None = it takes no images (400)
    encoder: EncoderAPI | None = None  # the encoder tier (EncoderClient; a test's EncoderAPI)
    media: MediaConfig = field(default_factory=MediaConfig)
    streams: Streams = field(default_factory=Streams)  # requests in flight, ended with an error at shutdown
    responses: responses.ResponseStore = field(default_factory=responses.ResponseStore)  # previous_response_id


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


_ERROR_WHEN = {
    400: "malformed JSON, an unsupported field, a schema mismatch, an integer out of range, a prompt (+ max_tokens) "
         "longer than the context, or a request that cannot be served as asked (the error's code says which)",
    401: "missing or wrong API key (`WWW-Authenticate: Bearer`)",
    404: "unknown model or route",
    405: "method not allowed (`Allow` lists the allowed ones)",
    413: "body above the size limit",
    429: "admission queue full (`Retry-After`)",
    431: "request headers larger than max_header_bytes",
    500: "a worker failed",
    503: "no worker available, worker gone, router down, or every decode worker full (`Retry-After`)",
}
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": when} for status, when in _ERROR_WHEN.items()
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The documented errors of one path: `statuses` plus those any path can answer (405, 431)."""
    return {status: ERRORS[status] for status in sorted({*statuses, 405, 431})}


def _json_error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _error(request: Request, status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An error in the format of the API the request called: Anthropic's on /v1/messages, else OpenAI's."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(messages.error_body(status, message), status_code=status, headers=headers)
    return _json_error(status, message, type_, param, code, headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return _error(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        status, message, param, code = validation_status(list(exc.errors()))
        return _error(request, status, message, "invalid_request_error", param, code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json_error(exc.status_code, str(exc.detail), type_, headers=exc.headers)  # 405 keeps Allow

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> Response:
        return _error(request, 500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


@dataclass(frozen=True)
class Shape:
    """Another API's rendering of a chat answer: the whole body, and the SSE stream."""

    body: Callable[[dict[str, Any]], dict[str, Any]]
    events: Callable[[AsyncIterator[bytes], str], AsyncIterator[bytes]]


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


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes: from
    Content-Length before anything is read, else while it streams in (chunked uploads)."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(int(length), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"request body of {size}+ bytes; the limit is {limit} bytes", code="request_too_large")


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], raw: bytes) -> M:
    """Strict validation straight from the JSON bytes (one parse; lone surrogates are invalid JSON)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        status, message, param, code = validation_status(list(exc.errors()))
        raise ApiError(status, message, param=param, code=code) from None


def _request_body(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI requestBody of an endpoint that reads its body itself (after auth and the size check)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _with_body_schemas(schema: dict[str, Any], models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
    return schema


def _auth_dependency(keys: frozenset[str]) -> Callable[[Request], Awaitable[None]]:
    async def auth(request: Request) -> None:
        anthropic_key = request.headers.get("x-api-key", "")  # how Anthropic's clients send it
        if keys and not (bearer_ok(request.headers.get("authorization", ""), keys)
                         or (anthropic_key and bearer_ok(f"Bearer {anthropic_key}", keys))):
            raise ApiError(401, "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key')",
                           type_="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return auth


def _add_v1_routes(app: FastAPI, api: Api) -> None:
    auth = _auth_dependency(api.api_keys)

    def check_model(name: str) -> None:
        if name != api.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {api.model_name!r}",
                           type_="not_found_error", param="model", code="model_not_found")

    async def serve(planned: Plan | Callable[[], Coroutine[Any, Any, Plan]], request: Request,
                    shape: Shape | None = None) -> Response:
        """Run a plan under an admission slot; a plan that needs IO first (images: load, encode) is made inside
        the slot, so the encoders see no more requests than the workers. `shape`: another API's rendering of the
        chat answer (Anthropic's Messages, OpenAI's Responses) instead of a chat completion."""
        try:
            slot = await api.admission.enter()
        except Overloaded as exc:
            metrics.REJECTED.inc()
            raise ApiError(429, f"server is busy: {exc}; retry after {api.retry_after_s}s", type_="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(api.retry_after_s)}) from exc
        if isinstance(planned, Plan):
            plan = planned
        else:
            try:
                plan = await until_disconnect(planned(), request)
            except ClientGone:
                slot.release()
                return Response(status_code=499)
            except BaseException:
                slot.release()
                raise
        decode_text = lambda ids: api.tokenizer.decode(ids, skip_special_tokens=plan.skip_special_tokens)
        renderer = Renderer(plan, lambda ids: api.tokenizer.decode(ids), api.tokenizer.token_bytes)
        if plan.stream:
            events = stream_events(plan, api.backend, renderer, decode_text, slot.release, api.streams)
            if shape is not None:
                events = shape.events(events, plan.model)
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(slot.release),
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": plan.id})
        try:
            body = await until_disconnect(collect(plan, api.backend, renderer, decode_text, api.streams), request)
        except ClientGone:
            return Response(status_code=499)
        finally:
            slot.release()
        if shape is not None:
            body = shape.body(body)
        return JSONResponse(body, headers={"X-Request-Id": plan.id})

    guarded = [Depends(auth)]  # auth runs before the body is read: a keyless malformed body gets 401

    @app.get("/v1/models", dependencies=guarded, responses=_errors(401))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(api)]}

    @app.get("/v1/models/{model}", dependencies=guarded, responses=_errors(401, 404))
    async def model(model: str) -> dict[str, Any]:
        check_model(model)
        return _model_card(api)

    generate_errors = _errors(400, 401, 404, 413, 429, 500, 503)

    @app.post("/v1/completions", dependencies=guarded, responses=generate_errors,
              openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_body(request, api.max_body_bytes))
        check_model(body.model)
        plan = plan_completion(body, api.tokenizer, api.limits, f"cmpl-{secrets.token_hex(12)}", api.model_name)
        return await serve(plan, request)

    @app.post("/v1/chat/completions", dependencies=guarded, responses=generate_errors,
              openapi_extra=_request_body(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_body(request, api.max_body_bytes))
        return await run_chat(body, request)

    messages_errors = {status: {**doc, "model": messages.MessagesErrorResponse}
                       for status, doc in generate_errors.items()}

    @app.post("/v1/messages", dependencies=guarded, responses=messages_errors,
              openapi_extra=_request_body(messages.MessagesRequest))
    async def messages_endpoint(request: Request) -> Response:
        """Anthropic's Messages API, served by the chat pipeline (services/gateway/messages_api.py)."""
        body = messages.to_chat(parse_body(messages.MessagesRequest, await read_body(request, api.max_body_bytes)))
        return await run_chat(body, request, Shape(messages.to_message, messages.to_events))

    @app.post("/v1/responses", dependencies=guarded, responses=generate_errors,
              openapi_extra=_request_body(responses.ResponsesRequest))
    async def responses_endpoint(request: Request) -> Response:
        """OpenAI's Responses API, served by the chat pipeline (services/gateway/responses_api.py)."""
        asked = parse_body(responses.ResponsesRequest, await read_body(request, api.max_body_bytes))
        body = responses.to_chat(asked, api.responses)
        remember = responses.remembering(api.responses, body, asked.store is not False)

        def whole(chat: dict[str, Any]) -> dict[str, Any]:
            response = responses.to_response(chat)
            remember(response)
            return response

        return await run_chat(body, request, Shape(whole, lambda events, model: responses.to_events(
            events, model, remember)))

    @app.post("/v1/messages/count_tokens", dependencies=guarded, responses=messages_errors,
              openapi_extra=_request_body(messages.CountTokensRequest))
    async def count_tokens(request: Request) -> dict[str, int]:
        """The prompt tokens a Messages request would bring (its template and tools included)."""
        body = messages.to_chat(parse_body(messages.CountTokensRequest,
                                           await read_body(request, api.max_body_bytes)))
        check_model(body.model)
        if api.vision is not None and any(isinstance(m.content, list) and any(
                p.get("type") == "image_url" for p in m.content) for m in body.messages):
            raise ApiError(400, "count_tokens does not count image blocks yet", param="messages")
        plan = plan_chat(body, api.tokenizer, replace(api.limits, max_model_len=1 << 62), "count", api.model_name)
        return {"input_tokens": len(plan.prompts[0])}

    async def run_chat(body: ChatCompletionRequest, request: Request, shape: Shape | None = None) -> Response:
        check_model(body.model)
        request_id = f"chatcmpl-{secrets.token_hex(12)}"
        if api.vision is None:  # a text-only model (an image part is a 400 in plan_chat)
            return await serve(plan_chat(body, api.tokenizer, api.limits, request_id, api.model_name), request,
                               shape)
        collector = MediaCollector(api.vision, api.media)
        texts = chat_messages(body, api.limits, collector)  # every 400 of the parts: before anything is queued
        if not collector.parts:
            return await serve(plan_chat(body, api.tokenizer, api.limits, request_id, api.model_name,
                                         messages=texts), request, shape)
        vision, parts = collector.vision, collector.parts

        async def plan_with_media() -> Plan:
            datas = await load_all(parts, api.media)
            encoded = await encode_all(api.encoder, request_id, parts, datas, api.retry_after_s)
            return plan_chat(body, api.tokenizer, api.limits, request_id, api.model_name,
                             ChatMedia(texts, vision, parts, encoded))

        return await serve(plan_with_media, request, shape)


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


DOCS_ASSETS = "/docs/assets"


def _add_docs(app: FastAPI, api: Api | None) -> None:
    """/openapi.json and /docs, behind the API key when keys are set (unless `docs_auth` is off)."""
    keys = api.api_keys if api is not None and api.docs_auth else frozenset()

    async def docs_auth(request: Request) -> None:
        """A browser cannot send the Bearer header: the docs also take the key as `?api_key=`."""
        query_key = request.query_params.get("api_key", "")
        if keys and not (query_key and bearer_ok(f"Bearer {query_key}", keys)):
            await _auth_dependency(keys)(request)

    guarded = [Depends(docs_auth)]

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _with_body_schemas(
                get_openapi_schema(app), (CompletionRequest, ChatCompletionRequest, messages.MessagesRequest,
                                                  responses.ResponsesRequest))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guarded)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    async def docs(request: Request) -> HTMLResponse:
        key = request.query_params.get("api_key", "")
        url = f"/openapi.json?{urlencode({'api_key': key})}" if key else "/openapi.json"
        return get_swagger_ui_html(openapi_url=url, title=f"{app.title} - docs",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")

    from starlette.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    # Swagger UI's own files, served here: the page works offline, and a browser loads them without a key
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")


def get_openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with its automatic 422 (validation) answered as 400, as this server answers it."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", {"description": _ERROR_WHEN[400], "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
    return schema


class HeaderLimit:
    """ASGI middleware answering 431 (OpenAI error body) when the request's headers exceed `limit`
    bytes. The HTTP layer refuses far larger ones itself (see service.JsonErrorH11Protocol)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) + 4 for k, v in scope["headers"])  # "k: v\r\n"
            if size > self.limit:
                response = _json_error(431, f"request headers of {size} bytes; the limit is {self.limit} bytes",
                                       "invalid_request_error", code="headers_too_large")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _json_doc(description: str, properties: dict[str, Any], retry_after: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": {
        "type": "object", "properties": properties, "required": ["status"]}}}}
    if retry_after:
        doc["headers"] = {"Retry-After": {"description": "seconds before probing again",
                                          "schema": {"type": "string"}}}
    return doc


_STR = {"type": "string"}
_STRS = {"type": "array", "items": _STR}
_HEALTH_BODY = {"status": {"type": "string", "enum": ["ok", "not_ready"]}, "gateway": _STR,
                "services": {"type": "object", "additionalProperties": _STRS},
                "instances": {"type": "array", "items": {"type": "object"}}, "ready": {"type": "boolean"},
                "missing": _STRS, "room": {"type": "boolean"}, "model": _STR, "queue": {"type": "object"}}
_HEALTH_DOC: dict[str, dict[str, Any]] = {
    "live": _json_doc("the gateway process is up (liveness: says nothing about serving)",
                      {"status": {"type": "string", "enum": ["live"]}, "gateway": _STR}),
    "ready": _json_doc("a complete serving path is registered and fresh: a combined worker, or a router, a "
                       "prefill worker and a decode worker with a KV transfer address",
                       {"status": {"type": "string", "enum": ["ready"]}, "gateway": _STR,
                        "room": {"type": "boolean"}}),
    "not_ready": _json_doc("no complete serving path (`missing` names what the disaggregated one lacks), the "
                           "registry is unreachable (`status: unavailable`), or, asked with `capacity=true`, every "
                           "path's workers have no KV pages left (`status: no_room`, `saturated` names them)",
                           {"status": {"type": "string", "enum": ["not_ready", "unavailable", "no_room"]},
                            "gateway": _STR, "missing": _STRS, "saturated": _STRS, "error": _STR}, retry_after=True),
    "health": _json_doc("ready: the registry view grouped by role, each instance's entry, the queue", _HEALTH_BODY),
    "health_503": _json_doc("not ready (the same body, `status: not_ready`), or the registry is unreachable "
                            "(`status: unavailable`, `error`)",
                            {**_HEALTH_BODY, "status": {"type": "string", "enum": ["not_ready", "unavailable"]},
                             "error": _STR}, retry_after=True),
}


def _unavailable(exc: Exception, retry_after: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "error": f"registry unreachable: {exc}"}, status_code=503,
                        headers={"Retry-After": retry_after})


def build_app(list_services: ListServices, instance_id: str, api: Api | None = None,
              max_header_bytes: int = 16384) -> FastAPI:
    """The gateway app; without `api` only /health, /metrics and the docs exist."""
    app = FastAPI(title="windserve gateway", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)

    app.add_middleware(HeaderLimit, limit=max_header_bytes)
    app.add_middleware(CountRequests)
    _add_docs(app, api)

    retry_after = str(api.retry_after_s if api is not None else 1)
    # readiness probes poll often: one registry read per 0.5 s (the service passes the listing its backend
    # shares)
    probe = list_services if isinstance(list_services, CachedListing) else CachedListing(list_services)

    @app.get("/health/live", responses={200: _HEALTH_DOC["live"], **_errors()})
    async def live() -> Response:
        return JSONResponse({"status": "live", "gateway": instance_id})

    @app.get("/health/ready", responses={200: _HEALTH_DOC["ready"], 503: _HEALTH_DOC["not_ready"], **_errors()})
    async def ready(capacity: bool = False) -> Response:
        """`capacity=true`: also 503 while every complete path's workers report no KV pages left (a load
        balancer may then prefer another deployment; without it readiness says only that a path exists)."""
        try:
            entries = await probe()
        except Exception as exc:  # registry unreachable: not ready, and say why
            return _unavailable(exc, retry_after)
        path = serving_path(entries, time.time())
        if path.ready and capacity and not path.room:
            return JSONResponse({"status": "no_room", "gateway": instance_id, "saturated": list(path.saturated),
                                 "error": path.full_reason}, status_code=503, headers={"Retry-After": retry_after})
        if path.ready:
            return JSONResponse({"status": "ready", "gateway": instance_id, **({"room": True} if capacity else {})})
        return JSONResponse({"status": "not_ready", "gateway": instance_id, "missing": list(path.missing),
                             "error": path.reason}, status_code=503, headers={"Retry-After": retry_after})

    @app.get("/health", responses={200: _HEALTH_DOC["health"], 503: _HEALTH_DOC["health_503"], **_errors()})
    async def health() -> Response:
        try:
            entries = await list_services()
        except Exception as exc:  # registry unreachable: say so instead of a bare 500
            return _unavailable(exc, retry_after)
        path = serving_path(entries, time.time())
        body: dict[str, Any] = {
            "status": "ok" if path.ready else "not_ready",
            "gateway": instance_id,
            "services": group_by_role(entries),
            "instances": [e.model_dump(mode="json", exclude={"schema_version"}) for e in entries],
            "ready": path.ready,
            "missing": list(path.missing),
            "room": path.ready and path.room,
        }
        if api is not None:
            body["model"] = api.model_name
            body["queue"] = {"in_flight": api.admission.in_flight, "queued": api.admission.queued}
        if path.ready:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": retry_after})

    metrics_doc: dict[int | str, dict[str, Any]] = {
        200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(),
    }

    def refresh_queue_gauges() -> None:
        if api is not None:
            metrics.IN_FLIGHT.set(api.admission.in_flight)
            metrics.QUEUED.set(api.admission.queued)

    @app.get("/metrics", response_class=PlainTextResponse, responses=metrics_doc)
    async def prometheus() -> Response:
        refresh_queue_gauges()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/cluster", response_class=PlainTextResponse, responses=metrics_doc)
    async def cluster_prometheus() -> Response:
        """Every live instance's series (and this gateway's), labelled with `role` and `instance`."""
        from services.gateway.cluster_metrics import cluster_text

        try:
            entries = await list_services()
        except Exception as exc:  # registry unreachable: say so instead of a bare 500
            return _unavailable(exc, retry_after)
        refresh_queue_gauges()
        now = time.time()
        text = await cluster_text([e for e in entries if e.fresh(now)], "gateway", instance_id)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    if api is not None:
        api.created = api.created or int(time.time())
        _add_v1_routes(app, api)
    return app
