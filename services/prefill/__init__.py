"""Prefill worker: chunked prefill with the SWA-aware prefix cache, ships KV to decode."""
