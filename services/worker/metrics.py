"""Prometheus metrics of the worker (served on WINDSERVE_METRICS_PORT by the service base)."""

from prometheus_client import Gauge

KV_PAGES = Gauge("windserve_worker_kv_pages", "KV pages by pool and state", ["pool", "state"])
REQUESTS = Gauge("windserve_worker_requests", "Requests in the engine by state", ["state"])
OUTCOMES = Gauge("windserve_worker_requests_done", "Requests since start by outcome", ["outcome"])
