"""Gateway HTTP app. The registry is reached through a callable so the app stays testable."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from protos.messages import RegistryEntry

ListServices = Callable[[], Awaitable[list[RegistryEntry]]]


def group_by_role(entries: list[RegistryEntry]) -> dict[str, list[str]]:
    """{role: sorted instance ids} of the live entries."""
    out: dict[str, list[str]] = {}
    for e in entries:
        out.setdefault(e.role.value, []).append(e.instance_id)
    return {role: sorted(ids) for role, ids in sorted(out.items())}


def build_app(list_services: ListServices, instance_id: str) -> FastAPI:
    app = FastAPI(title="windserve gateway")

    @app.get("/health")
    async def health() -> Response:
        try:
            entries = await list_services()
        except Exception as exc:  # registry unreachable: say so instead of a bare 500
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse(
            {
                "status": "ok",
                "gateway": instance_id,
                "services": group_by_role(entries),
                "instances": [e.model_dump(mode="json", exclude={"schema_version"}) for e in entries],
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
