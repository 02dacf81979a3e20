"""Logic of the router service (pure where possible)."""

from services.router.config import RouterConfig


def health_details(config: RouterConfig) -> dict[str, str]:
    """Extra health fields: which model is configured and whether serving handlers exist yet."""
    return {"model": config.model or "none", "serving": "not yet"}
