"""Gateway: OpenAI-compatible REST front door. Today: /health (registry view) and /metrics."""
