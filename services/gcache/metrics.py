"""Prometheus metrics of a storage node (served on WINDSERVE_METRICS_PORT by the service base)."""

from prometheus_client import Counter, Gauge

BYTES = Counter("windserve_cache_bytes_total", "Value bytes moved by completed transfers", ["direction"])
LOOKUPS = Counter("windserve_cache_lookups_total", "Keys asked by gets, by outcome (a value failing its checksum "
                  "is a miss)", ["outcome"])
PUTS = Counter("windserve_cache_puts_total", "Put items by outcome: accepted / refused (already stored, being "
               "stored, no room) at announce; committed / dropped (checksum mismatch) / aborted (transfer failed)",
               ["outcome"])
SEND_FAILURES = Counter("windserve_cache_send_failures_total", "Get transfers that failed (client gone or slow)")
USAGE = Gauge("windserve_cache_usage_bytes", "Bytes of committed values and capacity per tier", ["tier", "kind"])
KEYS = Gauge("windserve_cache_keys", "Committed values (both tiers)")
STORE = Gauge("windserve_cache_store", "The store's own counters since start (checksum_failures, demotions, "
              "promotions, evictions, ...)", ["counter"])
