"""KV-affinity router: picks (prefill, decode) workers per request."""
