"""The engine-worker base: what every engine-hosting service (combined worker, prefill, decode) shares.

    config.py   EngineServiceConfig (engine knobs, the one engine_config()), DisaggServiceConfig (+ KV hand-off)
    engine.py   build_engine / build_async_engine: model + EngineCore (or a subclass) on its own thread
    tasks.py    RequestTasks: one task per request id; abort (remembered when early), duplicates, drain
    wire.py     wire (protos) <-> engine conversions: params, refusals, chunks, logprobs, load
    metrics.py  Outcomes and the Prometheus gauges every engine role exports
    service.py  EngineWorkerService / DisaggWorkerService: setup, aborts, load, registry, health, teardown
    kv_stream.py the hand-off's service side: engine payload specs as transfer LayerSpecs, KVSender (prefill)
    kv_events.py KVFeed: the cache's KV events on the bus, the kv_snapshot responder, hit reports
    kv_wire.py   KV events / snapshots / hit reports <-> wire (pure, no torch: the router imports it too)

The roles keep only their own logic in services/{worker,prefill,decode}. docs/worker.md has the request
task lifecycle, the abort and drain rules and the metrics list. Names are loaded lazily, so importing the
pure parts (tasks, wire) does not pull in the service stack.
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
