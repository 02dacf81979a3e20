"""MiMo-V2 model: config, paged-KV decoder (+MTP), checkpoint loading, tokenizer.

The torch parts load on first attribute access, so the configs (`libs.model.config`, `vision_config`) stay
torch-free for whoever only reads settings.
"""

from __future__ import annotations

import importlib
from typing import Any

from libs.model.config import ModelConfig

_LAZY = {
    "CheckpointError": "libs.model.loader", "load_model": "libs.model.loader", "MiMoV2Model": "libs.model.model",
    "BatchMeta": "libs.model.paged", "KVPools": "libs.model.paged", "Tokenizer": "libs.model.tokenizer",
    "load_tokenizer": "libs.model.tokenizer",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'libs.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = ["BatchMeta", "CheckpointError", "KVPools", "MiMoV2Model", "ModelConfig", "Tokenizer", "load_model",
           "load_tokenizer"]
