"""Combined worker: prefill and decode in one process (small deployments, tests)."""
