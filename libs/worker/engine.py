"""The engine of an engine worker: a model, an EngineCore (or a subclass) over it, driven by an AsyncEngine
(its step loop on a thread of its own)."""

from __future__ import annotations

from libs.engine.async_engine import AsyncEngine
from libs.engine.config import EngineConfig
from libs.engine.core import EngineCore, load_core


def build_engine(model_path: str | None, config: EngineConfig | None = None,
                 core_class: type[EngineCore] = EngineCore, tiny_weights: str | None = None) -> EngineCore:
    """libs.engine.core.load_core (a parallel engine over a checkpoint loads no full model: each rank reads its
    own shard). Loading a checkpoint takes a while: services call this in a thread (asyncio.to_thread)."""
    return load_core(model_path, config, core_class, tiny_weights)


def build_async_engine(model_path: str | None, config: EngineConfig | None = None, *,
                       core_class: type[EngineCore] = EngineCore, output_timeout_s: float = 300.0,
                       tiny_weights: str | None = None) -> AsyncEngine:
    """An AsyncEngine over build_engine(...), not started (call start() or use `async with`)."""
    return AsyncEngine(build_engine(model_path, config, core_class, tiny_weights), output_timeout_s=output_timeout_s)
