"""Prometheus metrics of the router (process-global, like every prometheus-client metric)."""

from prometheus_client import Counter, Gauge, Histogram

DECISIONS = Counter("windserve_router_decisions_total", "Route decisions", ["policy", "outcome"])
DECISION_SECONDS = Histogram("windserve_router_decision_seconds", "Time of one route decision (view, index, cost)",
                             buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0))

# feedback: counted when a worker's hit report matches one of this router's predictions (same population)
PREDICTED_HIT_TOKENS = Counter("windserve_router_predicted_hit_tokens_total",
                               "Predicted prefix-hit tokens of the requests a hit report came back for", ["side"])
ACTUAL_HIT_TOKENS = Counter("windserve_router_actual_hit_tokens_total", "Prefix-hit tokens the workers reported",
                            ["side"])
MISPREDICTED_TOKENS = Counter("windserve_router_mispredicted_tokens_total",
                              "Sum of max(0, predicted - actual) hit tokens", ["side"])
HIT_REPORTS = Counter("windserve_router_hit_reports_total", "Hit reports by match with this router's predictions",
                      ["outcome"])

INDEX_BLOCKS = Gauge("windserve_router_index_blocks", "Distinct block hashes in the prefix index")
INDEX_ENTRIES = Gauge("windserve_router_index_entries", "(worker, block) entries in the prefix index")
INDEX_BYTES = Gauge("windserve_router_index_bytes", "Bytes the prefix index holds (measured)")
INDEX_WORKERS = Gauge("windserve_router_index_workers", "Workers whose KV events this router indexes")
STALE_WORKERS = Gauge("windserve_router_stale_workers", "Indexed workers awaiting a KV snapshot")
SNAPSHOT_RESYNCS = Counter("windserve_router_snapshot_resyncs_total", "KV snapshot requests by outcome", ["outcome"])
EVENT_GAPS = Counter("windserve_router_event_gaps_total", "Event id gaps seen (each leads to a snapshot resync)")
EVENT_BATCHES = Counter("windserve_router_kv_event_batches_total", "KV event batches received", ["outcome"])
LAYOUT_REFUSALS = Counter("windserve_router_layout_refusals_total",
                          "Workers not indexed: their KV layout differs from the index's or is malformed")
REMOTE_PICKS = Counter("windserve_router_remote_picks_total", "Picks of other router replicas counted as load")
