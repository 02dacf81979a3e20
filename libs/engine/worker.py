"""What a colocated worker (prefill + decode in one process) needs from the engine.

The service wiring (NATS subjects, registry, KV events publishing) lives in services/worker;
this module only builds the engine from a model path or the built-in tiny model.
"""

from __future__ import annotations

from libs.engine.async_engine import AsyncEngine
from libs.engine.config import EngineConfig
from libs.engine.core import EngineCore


def build_engine(model_path: str | None, config: EngineConfig | None = None) -> EngineCore:
    """EngineCore over libs.model.load_model(model_path) (None = built-in tiny model) and its tokenizer."""
    from libs.model import load_model, load_tokenizer

    config = config or EngineConfig()
    model, model_config = load_model(model_path, dtype=config.torch_dtype, device=config.device)
    return EngineCore(config, model, model_config, load_tokenizer(model_path))


def build_async_engine(model_path: str | None, config: EngineConfig | None = None, *,
                       output_timeout_s: float = 300.0) -> AsyncEngine:
    """An AsyncEngine (not started: call start() or use `async with`) for the colocated worker."""
    return AsyncEngine(build_engine(model_path, config), output_timeout_s=output_timeout_s)
