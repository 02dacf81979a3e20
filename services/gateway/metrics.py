"""Prometheus metrics of the gateway (process-global, exported on GET /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("windserve_gateway_requests_total", "HTTP API requests by endpoint and status",
                   ["endpoint", "status"])
IN_FLIGHT = Gauge("windserve_gateway_in_flight", "Requests running downstream")
QUEUED = Gauge("windserve_gateway_queued", "Requests waiting for an admission slot")
REJECTED = Counter("windserve_gateway_rejected_total", "Requests refused with 429 (queue full)")
FAILOVERS = Counter("windserve_gateway_failovers_total",
                    "Attempts retried on another instance (a worker gone or busy before the first token)")
MIGRATIONS = Counter("windserve_gateway_migrations_total",
                     "Streams continued on another instance after their worker failed mid-stream (docs/faults.md)")
MIGRATED_PREFIX = Counter("windserve_gateway_migrated_prefix_tokens_total",
                          "Tokens a migrated stream continued from (its prompt and the tokens already sent), counted "
                          "when it finishes")
MIGRATED_PREFIX_LOADED = Counter("windserve_gateway_migrated_prefix_loaded_tokens_total",
                                 "Of those, tokens the new worker loaded from a cache tier (L1, L2 or GCache) rather "
                                 "than recomputed")
STREAM_GAPS = Counter("windserve_gateway_stream_gaps_total",
                      "Token chunks found missing (a gap in a worker's numbering, or a silent interval after which "
                      "the worker had sent more): lost in transit by NATS, fetched again from the worker")
STREAM_REPLAYED = Counter("windserve_gateway_stream_replayed_chunks_total",
                          "Token chunks fetched again from their worker after NATS lost them")
REASKS = Counter("windserve_gateway_unreachable_reasks_total",
                 "Attempts sent again to a listed instance that had no responders, because nothing else could take "
                 "the request (within unreachable_grace_s: its client may be moving to another NATS node)")
CONTROL_PLANE_WAITS = Counter("windserve_gateway_control_plane_waits_total",
                              "Requests routed or subscribed again after waiting for NATS to be reachable (this "
                              "gateway's client reconnecting or its node hung, within reconnect_bound_s) instead of "
                              "failing with control_plane_unavailable")
ROUTE_RETRIES = Counter("windserve_gateway_route_retries_total",
                        "Route requests asked again of another router (one did not answer within route_try_timeout_s, "
                        "was gone, or refused it)")
ROUTER_BYPASSED = Counter("windserve_gateway_router_bypassed_total",
                          "Requests placed from the registry because no router answered within route_timeout_s")
DISCONNECTS = Counter("windserve_gateway_client_disconnects_total", "Requests aborted because the client left")
PROMPT_TOKENS = Counter("windserve_gateway_prompt_tokens_total", "Prompt tokens of finished requests")
CACHED_TOKENS = Counter("windserve_gateway_cached_tokens_total", "Prompt tokens served from a prefix cache")
OUTPUT_TOKENS = Counter("windserve_gateway_output_tokens_total", "Generated tokens sent to clients")
TTFT = Histogram("windserve_gateway_ttft_seconds", "Time to first token (per choice)",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ITL = Histogram("windserve_gateway_itl_seconds", "Inter-token latency: the time between two chunks of a choice, "
                "divided by the later chunk's tokens (one observation per chunk)",
                buckets=(0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5))
LATENCY = Histogram("windserve_gateway_request_seconds", "Whole request latency",
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
