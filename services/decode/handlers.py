"""Logic of the decode service (pure where possible)."""

from services.decode.config import DecodeConfig


def health_details(config: DecodeConfig) -> dict[str, str]:
    """Extra health fields: which model is configured and whether serving handlers exist yet."""
    return {"model": config.model or "none", "serving": "not yet"}
