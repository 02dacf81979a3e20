"""Worker settings (env prefix WINDSERVE_): the engine-service settings of libs/worker, nothing of its own."""

from __future__ import annotations

from libs.worker.config import EngineServiceConfig


class WorkerConfig(EngineServiceConfig):
    """A combined (prefill + decode) worker. `model` empty = the built-in tiny model."""
