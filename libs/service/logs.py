"""Structured JSON logging on stdlib logging: one JSON object per line."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

# Attributes every LogRecord has; anything else was passed via `extra=` and is logged as a field.
_STANDARD = (set(vars(logging.LogRecord("", 0, "", 0, "", None, None)))
             | {"message", "asctime", "taskName", "color_message"})


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self._static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **self._static,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=repr).decode()


def setup_logging(level: str, **static: str) -> None:
    """Send all logs as JSON lines to stderr, tagged with `static` fields (service, instance)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(static))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
