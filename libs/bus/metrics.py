"""Prometheus metrics of the bus (process-global, like every prometheus-client metric)."""

from prometheus_client import Counter, Gauge, Histogram

CONNECTION_EVENTS = Counter(
    "windserve_bus_connection_events_total", "NATS connection events", ["event"]
)
REQUESTS = Counter("windserve_bus_requests_total", "Outgoing requests by outcome", ["subject", "outcome"])
REQUEST_SECONDS = Histogram("windserve_bus_request_seconds", "Outgoing request latency", ["subject"])
HANDLED = Counter("windserve_bus_handled_total", "Served requests by outcome", ["subject", "outcome"])
IN_FLIGHT = Gauge("windserve_bus_in_flight", "Requests being handled now")
LARGE_PAYLOADS = Counter(
    "windserve_bus_large_payloads_total", "Payloads sent through the object store", ["direction"]
)
