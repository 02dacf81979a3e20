"""Worker settings (env prefix WINDSERVE_). Role-specific fields land here with their handlers."""

from libs.service import ServiceConfig


class WorkerConfig(ServiceConfig):
    """Shared service settings only, for now."""
