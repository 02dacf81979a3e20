"""Service-level Prometheus metrics and the per-service metrics HTTP endpoint."""

from __future__ import annotations

import socket
from typing import Any

from prometheus_client import Gauge, Info, start_http_server

SERVICE_INFO = Info("windserve_service", "Role and instance of this process")
SERVICE_STATE = Gauge("windserve_service_state", "1 for the current lifecycle state", ["state"])
BACKGROUND_FAILURES = Gauge("windserve_background_task_failures", "Background tasks that raised")


def _reachable(host: str) -> str:
    """The address peers dial for a server bound to `host`: this host's own address for a wildcard bind."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class MetricsServer:
    """prometheus-client's HTTP server, stoppable (port 0 in config means: do not start)."""

    def __init__(self, host: str, port: int) -> None:
        self._server: Any
        self._thread: Any
        try:
            self._server, self._thread = start_http_server(port, addr=host)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.port = int(self._server.server_port)
        self.url = f"http://{_reachable(host)}:{self.port}/metrics"  # advertised in the registry entry

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
