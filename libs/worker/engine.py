"""The engine of an engine worker: a model, an EngineCore (or a subclass) over it, driven by an AsyncEngine
(its step loop on a thread of its own)."""

from __future__ import annotations

from libs.engine.async_engine import AsyncEngine
from libs.engine.config import EngineConfig
from libs.engine.core import EngineCore


def build_engine(model_path: str | None, config: EngineConfig | None = None,
                 core_class: type[EngineCore] = EngineCore) -> EngineCore:
    """`core_class` over libs.model.load_model(model_path) (None = built-in tiny model) and its tokenizer; a
    parallel engine over a checkpoint loads no full model: each rank reads its own shard of `model_path`.
    Loading a checkpoint takes a while: services call this in a thread (asyncio.to_thread)."""
    from libs.model import load_model, load_tokenizer
    from libs.model.loader import checkpoint_config

    config = config or EngineConfig()
    if model_path is not None and config.layout.is_parallel:
        return core_class(config, None, checkpoint_config(model_path), load_tokenizer(model_path),
                          model_path=model_path)
    model, model_config = load_model(model_path, dtype=config.torch_dtype, device=config.device)
    return core_class(config, model, model_config, load_tokenizer(model_path))


def build_async_engine(model_path: str | None, config: EngineConfig | None = None, *,
                       core_class: type[EngineCore] = EngineCore, output_timeout_s: float = 300.0) -> AsyncEngine:
    """An AsyncEngine over build_engine(...), not started (call start() or use `async with`)."""
    return AsyncEngine(build_engine(model_path, config, core_class), output_timeout_s=output_timeout_s)
