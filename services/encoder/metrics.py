"""Prometheus metrics of an encoder (served on WINDSERVE_METRICS_PORT by the service base)."""

from prometheus_client import Counter, Gauge, Histogram

ENCODES = Counter("windserve_encoder_encodes_total", "Encode requests by outcome: encoded (the tower ran), hit "
                  "(cached), joined (waited for an encode of the same hash in flight), error (bad input), "
                  "unavailable (cache full of leased entries), internal (the tower failed)", ["outcome"])
CACHE = Counter("windserve_encoder_cache_lookups_total", "Embedding-cache lookups by encode and fetch, by outcome",
                ["op", "outcome"])
EVICTIONS = Counter("windserve_encoder_cache_evictions_total", "Embeddings evicted (LRU, unleased) for room")
CACHE_BYTES = Gauge("windserve_encoder_cache_bytes", "Embedding-cache bytes: used, leased, budget", ["kind"])
CACHE_ENTRIES = Gauge("windserve_encoder_cache_entries", "Embeddings held")
BATCH_ITEMS = Histogram("windserve_encoder_batch_items", "Items per tower call",
                        buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
BATCH_PATCHES = Histogram("windserve_encoder_batch_patches", "Patches per tower call",
                          buckets=tuple(64 * 4 ** i for i in range(7)))  # 64 .. 256Ki patches
TOWER_SECONDS = Histogram("windserve_encoder_tower_seconds", "Seconds of one tower call (a batch)",
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
ENCODE_SECONDS = Histogram("windserve_encoder_encode_seconds", "Seconds from an encode request to its reply, by "
                           "outcome", ["outcome"],
                           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
FETCH_BYTES = Counter("windserve_encoder_fetch_bytes_total", "Embedding bytes sent to workers")
SEND_FAILURES = Counter("windserve_encoder_send_failures_total", "Fetch transfers that failed (worker gone or slow)")
