"""The engine-worker base: what every engine-hosting service (combined worker, prefill, decode) shares.

    config.py    EngineServiceConfig, DisaggServiceConfig (+ KV hand-off)
    engine.py    build_engine / build_async_engine: model + EngineCore on its own thread
    tasks.py     RequestTasks: one task per request id
    wire.py      wire (protos) <-> engine conversions
    metrics.py   Outcomes and the Prometheus gauges every engine role exports
    service.py   EngineWorkerService / DisaggWorkerService
    kv_stream.py the hand-off's service side (KVSender)
    kv_events.py KVFeed: KV events, snapshots, hit reports on the bus
    kv_wire.py   KV events / snapshots / hit reports <-> wire (pure: the router imports it too)

The roles keep only their own logic in services/{worker,prefill,decode}; rules in docs/worker.md. Names
load lazily, so importing the pure parts (tasks, wire) does not pull in the service stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "EngineServiceConfig": "libs.worker.config",
    "DisaggServiceConfig": "libs.worker.config",
    "build_engine": "libs.worker.engine",
    "build_async_engine": "libs.worker.engine",
    "RequestTasks": "libs.worker.tasks",
    "DuplicateRequest": "libs.worker.tasks",
    "Outcomes": "libs.worker.metrics",
    "EngineWorkerService": "libs.worker.service",
    "DisaggWorkerService": "libs.worker.service",
    "KVFeed": "libs.worker.kv_events",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'libs.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
