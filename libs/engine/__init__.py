"""windserve engine: pure scheduler + torch model runner + step loop.

    from libs.engine import LLM, SamplingParams
    outs = LLM().generate([[1, 2, 3]], SamplingParams(max_tokens=8))

The pure parts (request types, scheduler) import no torch; the torch parts are loaded
lazily on first attribute access so `import libs.engine.scheduler` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

from libs.engine.plan import BatchPlan, ScheduledSeq
from libs.engine.request import FinishReason, Request, RequestOutput, SamplingParams, TokenLogprob
from libs.engine.scheduler import Scheduler, SchedulerConfig, SeqStatus

_LAZY = {
    "EngineConfig": "libs.engine.config",
    "EngineCore": "libs.engine.core",
    "HeldPrefill": "libs.engine.core",
    "AsyncEngine": "libs.engine.async_engine",
    "EngineDeadError": "libs.engine.async_engine",
    "LLM": "libs.engine.llm",
    "Output": "libs.engine.llm",
    "ModelRunner": "libs.engine.runner",
    "build_engine": "libs.engine.worker",
    "build_async_engine": "libs.engine.worker",
}

__all__ = [
    "BatchPlan", "FinishReason", "Request", "RequestOutput", "SamplingParams", "ScheduledSeq",
    "Scheduler", "SchedulerConfig", "SeqStatus", "TokenLogprob", *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'libs.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
