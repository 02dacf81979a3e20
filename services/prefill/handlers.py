"""Logic of the prefill service (pure where possible)."""

from services.prefill.config import PrefillConfig


def health_details(config: PrefillConfig) -> dict[str, str]:
    """Extra health fields: which model is configured and whether serving handlers exist yet."""
    return {"model": config.model or "none", "serving": "not yet"}
