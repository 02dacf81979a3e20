"""The SLA planner (#38): sizes the engine roles of a deployment to TTFT / ITL targets (docs/planner.md)."""
