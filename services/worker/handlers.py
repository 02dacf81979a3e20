"""Logic of the worker service (pure where possible)."""

from services.worker.config import WorkerConfig


def health_details(config: WorkerConfig) -> dict[str, str]:
    """Extra health fields: which model is configured and whether serving handlers exist yet."""
    return {"model": config.model or "none", "serving": "not yet"}
